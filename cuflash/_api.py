"""cuflash.attention: argument checking, broadcasting, and the kernel launch."""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import numpy as np

from . import _config, _loader

MAX_LEAD_DIMS = 4  # kMaxLead in kernels/common.cuh


class AttentionOutput(NamedTuple):
    """What :func:`attention` returns.

    o: (..., Nq, dv), q's dtype.  l, m: (..., Nq), float32, where S = scale * q k^T with masked
    entries excluded, ``m = max_j S``, ``l = sum_j exp(S - m)``; ``m + log(l)`` is the
    log-sum-exp. A row with no allowed key has o = 0, l = 0, m = -inf.
    """

    o: Any
    l: Any
    m: Any


# ---- inputs ------------------------------------------------------------------------------

_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


def as_cupy(x, name: str):
    """Take a GPU array zero-copy as a cupy.ndarray, or raise TypeError naming ``name``."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} is a NumPy array (host memory, shape {x.shape}, dtype {x.dtype}); cuflash "
            f"needs a GPU array: pass cupy.asarray({name}) or a CUDA tensor"
        )
    if hasattr(x, "__dlpack__"):
        if hasattr(x, "__dlpack_device__"):
            dev_type, _ = x.__dlpack_device__()
            if int(dev_type) not in _DLPACK_CUDA_DEVICES:
                raise TypeError(
                    f"{name} ({type(x).__module__}.{type(x).__name__}) lives on DLPack device "
                    f"type {int(dev_type)}, not on a CUDA GPU"
                )
        if getattr(x, "requires_grad", False):
            raise TypeError(
                f"{name} is a torch tensor that requires grad; use cuflash.torch.attention for "
                f"autograd, or pass {name}.detach()"
            )
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(
        f"{name} must be a GPU array (cupy.ndarray or an object exporting __dlpack__ or "
        f"__cuda_array_interface__), got {type(x).__module__}.{type(x).__name__}"
    )


def check_head_dims(q_shape, k_shape, v_shape):
    """Validate the trailing (N, d) dims; returns (nq, nk, d, dv)."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) < 2:
            raise ValueError(f"{name} must have shape (..., N, head_dim), got {tuple(shape)}")
    nq, d = q_shape[-2:]
    nk, dk = k_shape[-2:]
    nv, dv = v_shape[-2:]
    if dk != d:
        raise ValueError(f"q and k head dims differ: q {tuple(q_shape)}, k {tuple(k_shape)}")
    if nv != nk:
        raise ValueError(f"k and v sequence lengths differ: k {tuple(k_shape)}, v {tuple(v_shape)}")
    for name, dim, shape in (("q/k", d, q_shape), ("v", dv, v_shape)):
        if dim < _config.HEAD_DIM_MULTIPLE or dim % _config.HEAD_DIM_MULTIPLE or dim > _config.MAX_HEAD_DIM:
            raise ValueError(
                f"head dim of {name} must be a multiple of {_config.HEAD_DIM_MULTIPLE} between "
                f"{_config.HEAD_DIM_MULTIPLE} and {_config.MAX_HEAD_DIM}, got {dim} (shape {tuple(shape)})"
            )
    return nq, nk, d, dv


def check_dtypes(q_dtype, k_dtype, v_dtype) -> str:
    names = [np.dtype(t).name for t in (q_dtype, k_dtype, v_dtype)]
    if len(set(names)) != 1:
        raise TypeError(f"q, k and v must share one dtype, got q {names[0]}, k {names[1]}, v {names[2]}")
    if names[0] not in _config.SUPPORTED_DTYPES:
        raise TypeError(f"dtype {names[0]} is not supported; use one of {', '.join(_config.SUPPORTED_DTYPES)}")
    return names[0]


class BatchLayout(NamedTuple):
    lead_shape: tuple  # output leading dims, after merging (at most MAX_LEAD_DIMS)
    out_lead_shape: tuple  # output leading dims as the user sees them
    q_strides: tuple  # element strides per merged dim, 0 where broadcast
    k_strides: tuple
    v_strides: tuple
    kv_group: int  # q heads per k/v head in the last dim


def broadcast_layout(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides) -> BatchLayout:
    """Broadcast the leading (batch) dims of q, k, v; strides are in elements.

    NumPy's rules, plus grouped heads: when k/v's last leading dim Hk > 1 divides q's Hq
    (and differs), q head h reads k/v head h // (Hq // Hk).
    """
    lq, lk, lv = (tuple(s[:-2]) for s in (q_shape, k_shape, v_shape))
    try:
        lkv = np.broadcast_shapes(lk, lv)
    except ValueError:
        raise ValueError(
            f"leading dims of k and v do not broadcast: k {tuple(k_shape)}, v {tuple(v_shape)}"
        ) from None
    hq = lq[-1] if lq else 1
    hkv = lkv[-1] if lkv else 1
    group = hq // hkv if (hkv > 1 and hq != hkv and hq % hkv == 0) else 1
    lkv_as_q = lkv[:-1] + (hq,) if group > 1 else lkv
    try:
        out = tuple(np.broadcast_shapes(lq, lkv_as_q))
    except ValueError:
        raise ValueError(
            f"leading dims of q, k, v do not broadcast: q {tuple(q_shape)}, k {tuple(k_shape)}, "
            f"v {tuple(v_shape)} (grouped heads need q's heads to be a multiple of k's)"
        ) from None
    rank = len(out)

    def aligned(shape, strides, grouped):
        shape, strides = tuple(shape[:-2]), tuple(strides[:-2])
        pad = rank - len(shape)
        result = []
        for i in range(rank):
            j = i - pad
            if j < 0 or shape[j] == 1 and not (grouped and i == rank - 1 and out[i] == 1):
                result.append(0)  # broadcast: every output coordinate reads the same slice
            else:
                result.append(strides[j])
        return result

    qs = aligned(q_shape, q_strides, False)
    ks = aligned(k_shape, k_strides, group > 1)
    vs = aligned(v_shape, v_strides, group > 1)
    # k/v's own head stride applies to coordinate // group in the kernel.
    # Drop size-1 dims and merge neighbours whose strides nest, so that any rank usually fits.
    dims = [[out[i], qs[i], ks[i], vs[i]] for i in range(rank) if out[i] != 1]
    keep_last = group > 1 and rank > 0 and out[-1] != 1
    merged: list = []
    for i, dim in enumerate(dims):
        is_last = i == len(dims) - 1
        if merged and not (keep_last and is_last):
            prev = merged[-1]
            if all(prev[t] == dim[t] * dim[0] for t in (1, 2, 3)):
                merged[-1] = [prev[0] * dim[0], dim[1], dim[2], dim[3]]
                continue
        merged.append(list(dim))
    if not keep_last:
        group = 1  # the grouped dim had size 1 or was merged away: plain broadcasting
    if len(merged) > MAX_LEAD_DIMS:
        raise ValueError(
            f"cuflash supports at most {MAX_LEAD_DIMS} leading dims that cannot be merged, got "
            f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}"
        )
    merged = [[1, 0, 0, 0]] * (MAX_LEAD_DIMS - len(merged)) + merged
    cols = list(zip(*merged))
    return BatchLayout(tuple(cols[0]), out, tuple(cols[1]), tuple(cols[2]), tuple(cols[3]), group)


def _element_strides(x, name):
    itemsize = x.dtype.itemsize
    strides = tuple(s // itemsize for s in x.strides)
    if x.size and x.shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"the last dim of {name} must be contiguous (stride 1), got shape {x.shape} with "
            f"element strides {strides}"
        )
    return strides


def _check_vector_alignment(x, name, strides):
    """The 16-bit kernels read 16-byte vectors: pointer and row/batch strides must allow it."""
    per_vector = 16 // x.dtype.itemsize
    bad = [s for dim, s in zip(x.shape[:-1], strides[:-1]) if dim > 1 and s % per_vector]
    if x.data.ptr % 16 or bad:
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of {per_vector} "
            f"elements for {x.dtype}; got shape {x.shape}, element strides {strides}, address "
            f"{x.data.ptr:#x} (a view that slices the head dim is not supported)"
        )


def _resolve_scale(scale, d):
    if scale is None:
        return 1.0 / math.sqrt(d)
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be finite and positive, got {scale!r}")
    return value


# Field order of struct FwdParams in kernels/common.cuh (every member 8 bytes).
_FWD_PARAM_FORMAT = "<" + "Q" * 6 + "q" * 4 + "q" + "q" * (4 * 4) + "q" * 3 + "q" + "dd"


def _pack_forward_params(q, k, v, o, l, m, nq, nk, d, dv, layout, row_strides, scale):
    num_batch = math.prod(layout.lead_shape)
    values = (
        q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr,
        nq, nk, d, dv, num_batch,
        *layout.lead_shape, *layout.q_strides, *layout.k_strides, *layout.v_strides,
        *row_strides, layout.kv_group, scale, scale * math.log2(math.e),
    )
    return np.void(struct.pack(_FWD_PARAM_FORMAT, *values))


def attention(q, k, v, *, causal: bool = False, scale=None) -> AttentionOutput:
    """Exact scaled dot-product attention, computed tile by tile (FlashAttention).

    Args:
        q: (..., Nq, d) query. k: (..., Nk, d) keys. v: (..., Nk, dv) values. CuPy arrays or
            any CUDA array exporting ``__dlpack__`` / ``__cuda_array_interface__`` (PyTorch,
            JAX), taken without a copy. One dtype for all three: float16, bfloat16 or float32.
            d and dv: multiples of 8 up to 256. Only the last dim must be contiguous: strided
            views such as ``x.swapaxes(-2, -3)`` of a (B, N, H, d) array are read in place.
            Leading dims broadcast by NumPy's rules; if q has Hq heads (last leading dim) and
            k/v have Hk that divides Hq, q head h uses k/v head h // (Hq // Hk) (GQA / MQA).
        causal: mask key j for query i when j > i + (Nk - Nq), i.e. aligned at the bottom
            right. For Nq = 2, Nk = 5 (1 = attended)::

                1 1 1 1 0
                1 1 1 1 1

            and for Nq = 5, Nk = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A row with no allowed key gets o = 0, l = 0, m = -inf.
        scale: multiplies q k^T; defaults to 1 / sqrt(d). Must be finite and positive.

    Returns:
        AttentionOutput(o, l, m) of CuPy arrays: o (..., Nq, dv) in q's dtype, l and m
        (..., Nq) float32, with S = scale * q k^T: m = max_j S, l = sum_j exp(S - m),
        o = softmax(S) v. The work runs on CuPy's current stream.

    Example:
        >>> q = cupy.random.randn(2, 8, 1024, 64, dtype=cupy.float32).astype(cupy.float16)
        >>> o, l, m = cuflash.attention(q, q, q, causal=True)
        >>> lse = m + cupy.log(l)
    """
    import cupy

    q, k, v = as_cupy(q, "q"), as_cupy(k, "k"), as_cupy(v, "v")
    dtype = check_dtypes(q.dtype, k.dtype, v.dtype)
    devices = {x.device.id for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k and v must be on one device, got devices q {q.device.id}, "
                         f"k {k.device.id}, v {v.device.id}")
    nq, nk, d, dv = check_head_dims(q.shape, k.shape, v.shape)
    strides = {name: _element_strides(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    layout = broadcast_layout(q.shape, strides["q"], k.shape, strides["k"], v.shape, strides["v"])
    scale = _resolve_scale(scale, d)

    with q.device:
        o = cupy.empty(layout.out_lead_shape + (nq, dv), dtype=q.dtype)
        l = cupy.empty(layout.out_lead_shape + (nq,), dtype=cupy.float32)
        m = cupy.empty(layout.out_lead_shape + (nq,), dtype=cupy.float32)
        num_batch = math.prod(layout.lead_shape)
        if num_batch == 0 or nq == 0:
            return AttentionOutput(o, l, m)
        if dtype != "float32":
            for name, x in (("q", q), ("k", k), ("v", v)):
                _check_vector_alignment(x, name, strides[name])
        variant = _config.forward_config(dtype, d, dv, causal)
        kernel = _loader.get_kernel(variant)
        smem = variant.smem_bytes(d, dv)
        if smem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < smem:
            kernel.max_dynamic_shared_size_bytes = smem
        row_strides = (strides["q"][-2], strides["k"][-2], strides["v"][-2])
        params = _pack_forward_params(q, k, v, o, l, m, nq, nk, d, dv, layout, row_strides, scale)
        grid_y = min(num_batch, 65535)
        grid = (-(-nq // variant.block_rows), grid_y, -(-num_batch // grid_y))
        kernel(grid, (variant.threads,), (params,), shared_mem=smem)
    return AttentionOutput(o, l, m)
