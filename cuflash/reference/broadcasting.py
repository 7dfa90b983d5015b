"""Leading (batch) dims of q, k and v: NumPy broadcasting plus grouped heads, and its adjoint
(summing gradients back over every position that reused an input)."""

from __future__ import annotations

from typing import NamedTuple, Tuple

import numpy as np

from .. import _broadcast


class BroadcastPlan(NamedTuple):
    """How q, k and v leading (batch) shapes combine.

    batch_shape: leading shape of every output (o, l, m).
    kv_shape:    broadcast of k's and v's leading shapes, before grouping.
    group_size:  query heads per key/value head (1 when not grouped).
    """

    batch_shape: Tuple[int, ...]
    kv_shape: Tuple[int, ...]
    group_size: int


def broadcast_plan(q_shape, k_shape, v_shape) -> BroadcastPlan:
    """Check the shapes of q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv).

    Returns the :class:`BroadcastPlan`; raises ValueError (naming the
    offending arguments and their shapes) if the shapes are incompatible.
    """
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) < 2:
            raise ValueError(f"{name} must have at least 2 dimensions, got shape {shape}")
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(
            f"q and k must have the same head dimension d (last axis): "
            f"q.shape={q_shape}, k.shape={k_shape}"
        )
    if q_shape[-1] == 0:
        raise ValueError(f"head dimension d must be positive: q.shape={q_shape}")
    if k_shape[-2] != v_shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys Nk (axis -2): "
            f"k.shape={k_shape}, v.shape={v_shape}"
        )

    # The rule itself is cuflash's one (cuflash/_broadcast.py), which the kernels' launches use.
    batch_shape = _broadcast.out_lead_shape(q_shape, k_shape, v_shape)
    kv_shape = tuple(np.broadcast_shapes(k_shape[:-2], v_shape[:-2]))
    q_lead = q_shape[:-2]
    group_size = _broadcast.kv_group(q_lead[-1], kv_shape[-1]) if q_lead and kv_shape else 1
    return BroadcastPlan(batch_shape, kv_shape, group_size)


def _expand_one_kv(x: np.ndarray, plan: BroadcastPlan) -> np.ndarray:
    """Broadcast k or v to kv_shape, repeat grouped heads, broadcast to batch."""
    tail = x.shape[-2:]
    x = np.broadcast_to(x, plan.kv_shape + tail)
    if plan.group_size > 1:
        # Head axis is -3; each kv head is repeated group_size times in a row,
        # so query head h lands on kv head h // group_size.
        x = np.repeat(x, plan.group_size, axis=-3)
    return np.broadcast_to(x, plan.batch_shape + tail)


def expand_kv(q, k, v) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Make the leading dimensions of q, k and v explicit and equal.

    Returns ``(q, k, v)`` with shapes ``(*batch, Nq, d)``, ``(*batch, Nk, d)``,
    ``(*batch, Nk, dv)``: grouped heads are repeated and all batch dimensions
    broadcast.  Dtypes are kept; results may be read-only broadcast views.
    Raises ValueError naming the arguments and shapes that do not fit.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    plan = broadcast_plan(q.shape, k.shape, v.shape)
    q = np.broadcast_to(q, plan.batch_shape + q.shape[-2:])
    return q, _expand_one_kv(k, plan), _expand_one_kv(v, plan)


def _sum_to_shape(x: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """Adjoint of np.broadcast_to: sum x over the axes broadcasting created."""
    extra = x.ndim - len(shape)
    if extra:
        x = x.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    if stretched:
        x = x.sum(axis=stretched, keepdims=True)
    return x


def _reduce_kv_grad(grad: np.ndarray, own_shape, plan: BroadcastPlan) -> np.ndarray:
    """Adjoint of _expand_one_kv: gradient (*batch, Nk, x) -> own_shape."""
    tail = grad.shape[-2:]
    grouped_kv_shape = plan.kv_shape
    if plan.group_size > 1:
        grouped_kv_shape = plan.kv_shape[:-1] + (plan.kv_shape[-1] * plan.group_size,)
    grad = _sum_to_shape(grad, grouped_kv_shape + tail)
    if plan.group_size > 1:
        # Undo np.repeat: split the head axis into (Hk, group) and sum groups.
        split = plan.kv_shape + (plan.group_size,) + tail
        grad = grad.reshape(split).sum(axis=len(plan.kv_shape))
    return _sum_to_shape(grad, tuple(own_shape))
