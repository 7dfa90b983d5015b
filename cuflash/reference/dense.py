"""Standard attention in float64, materialising S: the forward, its analytic backward, and the
shared front end (masks, casting, the NaN-free shift) of every reference function."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .broadcasting import _reduce_kv_grad, _sum_to_shape, broadcast_plan, expand_kv

class ReferenceOutput(NamedTuple):
    """Attention result: ``o`` (*batch, Nq, dv), ``l`` and ``m`` (*batch, Nq)."""

    o: np.ndarray
    l: np.ndarray
    m: np.ndarray


def allowed_keys(nq: int, nk: int, *, causal: bool = False, mask=None, batch_shape=()) -> np.ndarray:
    """Boolean array (*batch_shape, Nq, Nk): True where key j is visible to query i.

    ``causal`` hides key j from query i when ``j > i + (Nk - Nq)``; ``mask``
    (boolean, broadcastable to the result, True = allowed) is combined by AND.
    The result may be a read-only broadcast view.
    """
    batch_shape = tuple(batch_shape)
    target = batch_shape + (nq, nk)
    allowed = np.ones((nq, nk), dtype=bool)
    if causal:
        rows = np.arange(nq)[:, None]
        cols = np.arange(nk)[None, :]
        allowed = cols <= rows + (nk - nq)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be a boolean array (True = allowed), got dtype {mask.dtype}")
        try:
            combined = tuple(np.broadcast_shapes(mask.shape, target))
        except ValueError:
            combined = None
        if combined != target:
            raise ValueError(f"mask.shape={mask.shape} does not broadcast to (*batch, Nq, Nk)={target}")
        allowed = allowed & mask
    return np.broadcast_to(allowed, target)


def _prepare(q, k, v, causal, scale, mask, dtype=np.float64):
    """Shared front end: cast, expand batch/grouped dims, build the mask."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    plan = broadcast_plan(q.shape, k.shape, v.shape)
    q_x, k_x, v_x = expand_kv(q.astype(dtype), k.astype(dtype), v.astype(dtype))
    nq, nk = q.shape[-2], k.shape[-2]
    allowed = allowed_keys(nq, nk, causal=causal, mask=mask, batch_shape=plan.batch_shape)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return q_x, k_x, v_x, allowed, float(scale), plan


def _shift_of(row_max: np.ndarray) -> np.ndarray:
    """Row max made safe for subtraction.

    A row (or block row) with no allowed key has max -inf, and
    ``exp(-inf - (-inf)) = exp(nan)``.  Subtracting 0 instead gives
    ``exp(-inf - 0) = 0`` for every masked score, which is the right answer;
    for any row with an allowed key the shift is the true max.
    """
    return np.where(row_max == -np.inf, 0.0, row_max)


def _safe_divisor(x: np.ndarray) -> np.ndarray:
    """Replace zero row sums by 1: those rows have all-zero numerators."""
    return np.where(x == 0, 1.0, x)


def _softmax_parts(s: np.ndarray, allowed: np.ndarray):
    """Return (exp(S - m) with masked entries 0, l, m) along the last axis."""
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, initial=-np.inf)  # initial= also covers Nk == 0
    p_unnormalised = np.exp(s - _shift_of(m)[..., None])
    l = p_unnormalised.sum(axis=-1)
    return p_unnormalised, l, m


def standard_attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None, mask=None) -> ReferenceOutput:
    """Exact attention in float64, materialising S = scale * q @ k^T.

    q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv): any float arrays
    (float16, float32, float64, ml_dtypes.bfloat16), converted exactly to
    float64.  mask: optional bool, broadcastable to (*batch, Nq, Nk).

    Returns ReferenceOutput(o (*batch, Nq, dv), l (*batch, Nq), m (*batch, Nq)),
    all float64.
    """
    q, k, v, allowed, scale, _ = _prepare(q, k, v, causal, scale, mask)
    s = scale * (q @ np.swapaxes(k, -1, -2))
    p_unnormalised, l, m = _softmax_parts(s, allowed)
    o = (p_unnormalised @ v) / _safe_divisor(l)[..., None]
    return ReferenceOutput(o, l, m)


def standard_attention_backward(
    do, q, k, v, *, causal: bool = False, scale: Optional[float] = None, mask=None
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Analytic gradient of standard attention, float64.

    do: (*batch, Nq, dv) (or broadcastable to it), the gradient of the loss
    with respect to o.  Returns (dq, dk, dv) with dq.shape == q.shape,
    dk.shape == k.shape, dv.shape == v.shape: gradients of broadcast or
    grouped inputs are summed back over every position that reused them.

        P  = softmax(S) over allowed keys (0 on masked entries / empty rows)
        dV = P^T dO
        dP = dO V^T
        D  = rowsum(dO * O)          (= rowsum(P * dP))
        dS = P * (dP - D)
        dQ = scale * dS K,   dK = scale * dS^T Q
    """
    q_in, k_in, v_in = np.asarray(q), np.asarray(k), np.asarray(v)
    q_x, k_x, v_x, allowed, scale, plan = _prepare(q_in, k_in, v_in, causal, scale, mask)
    do = np.broadcast_to(np.asarray(do).astype(np.float64), plan.batch_shape + (q_x.shape[-2], v_x.shape[-1]))

    s = scale * (q_x @ np.swapaxes(k_x, -1, -2))
    p_unnormalised, l, _ = _softmax_parts(s, allowed)
    p = p_unnormalised / _safe_divisor(l)[..., None]
    o = p @ v_x

    dv_x = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v_x, -1, -2)
    row_dot = np.sum(do * o, axis=-1)
    ds = p * (dp - row_dot[..., None])
    dq_x = scale * (ds @ k_x)
    dk_x = scale * (np.swapaxes(ds, -1, -2) @ q_x)

    dq = _sum_to_shape(dq_x, q_in.shape)
    dk = _reduce_kv_grad(dk_x, k_in.shape, plan)
    dv = _reduce_kv_grad(dv_x, v_in.shape, plan)
    return dq, dk, dv
