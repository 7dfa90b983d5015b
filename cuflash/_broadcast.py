"""Broadcasting of q, k and v's leading (batch) dims: the one module that owns the rule.

NumPy's rules, plus grouped heads: when k/v's last leading dim Hk > 1 divides q's Hq (and
differs), q head h reads k/v head h // (Hq // Hk). ``out_lead_shape`` gives the output's leading
dims (it also runs on symbolic sizes: the torch adapter's fake tensors pass their own
``broadcast_shapes``); ``broadcast_layout`` merges dims for a launch and gives every operand's
strides over them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ._constants import MAX_LEAD_DIMS


def kv_group(hq, hkv) -> int:
    """q heads per k/v head: Hq // Hk when Hk > 1 divides Hq and differs from it, else 1."""
    return hq // hkv if (hkv > 1 and hq != hkv and hq % hkv == 0) else 1


def out_lead_shape(q_shape, k_shape, v_shape, broadcast_shapes=np.broadcast_shapes) -> tuple:
    """The leading dims of o, l and m; raises ValueError quoting the shapes when q, k and v's
    leading dims do not broadcast."""
    lq, lk, lv = (tuple(s[:-2]) for s in (q_shape, k_shape, v_shape))
    try:
        lkv = tuple(broadcast_shapes(lk, lv))
    except (ValueError, RuntimeError):
        raise ValueError(
            f"leading dims of k and v do not broadcast: k {tuple(k_shape)}, v {tuple(v_shape)}"
        ) from None
    hq = lq[-1] if lq else 1
    hkv = lkv[-1] if lkv else 1
    if lq and lkv and kv_group(hq, hkv) > 1:
        lkv = lkv[:-1] + (hq,)
    try:
        return tuple(broadcast_shapes(lq, lkv))
    except (ValueError, RuntimeError):
        raise ValueError(
            f"leading dims of q, k, v do not broadcast: q {tuple(q_shape)}, k {tuple(k_shape)}, "
            f"v {tuple(v_shape)} (grouped heads need q's heads to be a multiple of k's)"
        ) from None


class BatchLayout(NamedTuple):
    lead_shape: tuple  # output leading dims, after merging (exactly MAX_LEAD_DIMS, 1s in front)
    out_lead_shape: tuple  # output leading dims as the user sees them
    q_strides: tuple  # element strides per merged dim, 0 where broadcast
    k_strides: tuple
    v_strides: tuple
    kv_group: int  # q heads per k/v head in the last dim
    extra_strides: tuple = ()  # per extra tensor (dO, O in the backward), like q_strides


@functools.lru_cache(maxsize=256)  # a training loop asks for the same few layouts every step
def broadcast_layout(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, extras=()) -> BatchLayout:
    """Broadcast the leading dims of q, k, v for a launch; strides are in elements (all tuples).

    ``extras`` are (shape, strides) of tensors whose leading dims are exactly the output's (dO
    and O in the backward, a block mask's batch); they take part in merging dims and get their
    own strides.
    """
    out = out_lead_shape(q_shape, k_shape, v_shape)
    lq, lkv = tuple(q_shape[:-2]), np.broadcast_shapes(tuple(k_shape[:-2]), tuple(v_shape[:-2]))
    group = kv_group(lq[-1] if lq else 1, lkv[-1] if lkv else 1)
    rank = len(out)

    def aligned(shape, strides):
        shape, strides = tuple(shape[:-2]), tuple(strides[:-2])
        pad = rank - len(shape)
        # a missing or size-1 dim is broadcast: every output coordinate reads the same slice
        return [0 if i < pad or shape[i - pad] == 1 else strides[i - pad] for i in range(rank)]

    per_tensor = [aligned(s, st) for s, st in ((q_shape, q_strides), (k_shape, k_strides),
                                              (v_shape, v_strides), *extras)]
    # Drop size-1 dims and merge neighbours whose strides nest, so that any rank usually fits.
    # A grouped head dim stays on its own: the kernel divides its coordinate for k and v.
    dims = [[out[i]] + [st[i] for st in per_tensor] for i in range(rank) if out[i] != 1]
    keep_last = group > 1
    merged: list = []
    for i, dim in enumerate(dims):
        if merged and not (keep_last and i == len(dims) - 1):
            prev = merged[-1]
            if all(prev[t] == dim[t] * dim[0] for t in range(1, len(dim))):
                merged[-1] = [prev[0] * dim[0]] + dim[1:]
                continue
        merged.append(list(dim))
    if len(merged) > MAX_LEAD_DIMS:
        raise ValueError(
            f"cuflash supports at most {MAX_LEAD_DIMS} leading dims that cannot be merged, got "
            f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}"
        )
    merged = [[1] + [0] * len(per_tensor)] * (MAX_LEAD_DIMS - len(merged)) + merged
    cols = [tuple(c) for c in zip(*merged)]
    return BatchLayout(cols[0], out, cols[1], cols[2], cols[3], group, tuple(cols[4:]))


def reduce_to(grad, out_lead, shape, group, xp_sum):
    """Sum a gradient laid out over the output's leading dims back to an input's shape.

    Grouped heads first (output head h came from input head h // group), then broadcasting in
    reverse: dims the input lacked or had as 1 are summed. ``xp_sum(x, axes)`` sums x over
    ``axes`` keeping them (each framework's own).
    """
    tail = tuple(grad.shape[len(out_lead):])
    if group > 1:
        out_lead = tuple(out_lead[:-1]) + (out_lead[-1] // group,)
        grad = xp_sum(grad.reshape(out_lead + (group,) + tail), (len(out_lead),))
        grad = grad.reshape(out_lead + tail)
    lead = tuple(shape[:-2])
    missing = len(out_lead) - len(lead)
    axes = tuple(range(missing)) + tuple(
        missing + i for i, n in enumerate(lead) if n == 1 and out_lead[missing + i] != 1
    )
    if axes:
        grad = xp_sum(grad, axes)
    return grad.reshape(tuple(shape))
