"""Low precision: rounding to float16 / bfloat16 / float32, and plain attention (forward and
backward) evaluated the way a framework does it in those dtypes -- the kernels' error budget."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from .broadcasting import _reduce_kv_grad, _sum_to_shape
from .dense import ReferenceOutput, _prepare, _safe_divisor, _shift_of, _softmax_parts

_LOWP_NAMES = ("float16", "bfloat16", "float32")


def _dtype_name(dtype) -> str:
    """'float16' | 'bfloat16' | 'float32' | 'float64' from a name or dtype-like."""
    if isinstance(dtype, str):
        name = dtype.lower()
    else:
        # np.dtype(ml_dtypes.bfloat16).name is 'bfloat16'.
        name = np.dtype(dtype).name
    if name not in _LOWP_NAMES + ("float64",):
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {_LOWP_NAMES + ('float64',)}")
    return name


def _round_float32_to_bfloat16(x32: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 precision (nearest, ties to even).

    bfloat16 is the top 16 bits of a float32.  Adding 0x7FFF plus the lowest
    kept bit (bit 16) and truncating the low 16 bits rounds to nearest with
    ties to even; a carry into the exponent is the correct rounding up, and
    values past the largest bfloat16 carry into +-inf as they should.
    Infinities pass through unchanged.  NaNs are kept NaN by forcing the
    quiet bit, since truncation alone could turn a NaN whose payload sits
    only in the low 16 bits into an infinity.
    """
    bits = x32.view(np.uint32).astype(np.uint64)
    lowest_kept_bit = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lowest_kept_bit) & 0xFFFF0000
    quiet_nan = (bits & 0xFFFF0000) | 0x00400000
    out = np.where(np.isnan(x32), quiet_nan, rounded)
    return out.astype(np.uint32).view(np.float32)


def round_to(x, dtype) -> np.ndarray:
    """Round x to the nearest value representable in dtype (ties to even).

    dtype: 'float16' | 'bfloat16' | 'float32' | 'float64' (or the matching
    NumPy / ml_dtypes dtype).  Returns float32 for the first three (every
    value is exactly representable there) and float64 for 'float64'.
    Overflow gives +-inf, NaN stays NaN.  bfloat16 rounding is done with bit
    operations (no ml_dtypes needed); float64 input is first rounded to
    float32, the same double rounding ml_dtypes and PyTorch perform.
    """
    name = _dtype_name(dtype)
    x = np.asarray(x)
    if x.dtype not in (np.float16, np.float32, np.float64):
        x = x.astype(np.float64)  # e.g. ml_dtypes.bfloat16 or ints; exact
    with np.errstate(over="ignore"):  # overflow to inf is the intended result
        if name == "float64":
            return x.astype(np.float64)
        if name == "float16":
            return x.astype(np.float16).astype(np.float32)
        x32 = x.astype(np.float32)
    if name == "float32":
        return x32
    return _round_float32_to_bfloat16(x32)


def lowp_attention(
    q, k, v, *, dtype, causal: bool = False, scale: Optional[float] = None, mask=None
) -> ReferenceOutput:
    """Plain (non-fused) attention evaluated the way a framework does it in dtype.

    dtype: 'float16' | 'bfloat16' | 'float32'.  Every tensor a framework
    would store in dtype is rounded to dtype; matrix products accumulate in
    float32; softmax runs in float32:

        q, k, v  rounded to dtype (the kernel's inputs)
        S  = round(q @ k^T)                      float32 accumulation
        S  = round(S * round(scale))
        P  = round(softmax_float32(S))           masked entries -> 0
        O  = round(P @ v)                        float32 accumulation

    Returns ReferenceOutput(o, l, m) as float64 arrays; o holds dtype values,
    m is the row max of the rounded S and l the float32 row sum of
    exp(S - m).  Empty rows give o = 0, l = 0, m = -inf (a framework would
    give NaN there).  The kernels' error budget is 2x this function's error
    against :func:`standard_attention`.
    """
    name = _dtype_name(dtype)
    if name not in _LOWP_NAMES:
        raise ValueError(f"lowp_attention dtype must be one of {_LOWP_NAMES}, got {dtype!r}")
    q_r, k_r, v_r = (round_to(x, name).astype(np.float32) for x in (q, k, v))
    q_x, k_x, v_x, allowed, scale, _ = _prepare(q_r, k_r, v_r, causal, scale, mask, dtype=np.float32)

    with np.errstate(over="ignore"):  # inf in dtype is what the framework would get
        s = round_to(q_x @ np.swapaxes(k_x, -1, -2), name)
        s = round_to(s * round_to(np.float64(scale), name), name)
        s = np.where(allowed, s, np.float32(-np.inf))
        m = np.max(s, axis=-1, initial=np.float32(-np.inf))
        e = np.exp(s - _shift_of(m)[..., None].astype(np.float32))
        l = e.sum(axis=-1, dtype=np.float32)
        p = round_to(e / _safe_divisor(l)[..., None].astype(np.float32), name)
        o = round_to(p @ v_x, name)
    return ReferenceOutput(o.astype(np.float64), l.astype(np.float64), m.astype(np.float64))


def lowp_attention_backward(
    do, q, k, v, *, dtype, causal: bool = False, scale: Optional[float] = None, mask=None
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of plain attention the way a framework's autograd computes them in dtype.

    Every tensor a framework would store in dtype is rounded to dtype; products accumulate
    in float32 (the forward is :func:`lowp_attention`'s):

        dV = round(P^T dO)     dP = round(dO V^T)     D = rowsum(dO * O)  (float32)
        dS = round(P * (dP - D))
        dQ = round(round(dS K) * scale)     dK = round(round(dS^T Q) * scale)

    Returns float64 (dq, dk, dv) with q's, k's and v's shapes (broadcast positions summed,
    each sum rounded to dtype).
    The kernels' gradient error budget is 3x this function's error against
    :func:`standard_attention_backward`.
    """
    name = _dtype_name(dtype)
    if name not in _LOWP_NAMES:
        raise ValueError(f"lowp_attention_backward dtype must be one of {_LOWP_NAMES}, got {dtype!r}")
    q_in, k_in, v_in = np.asarray(q), np.asarray(k), np.asarray(v)
    q_r, k_r, v_r = (round_to(x, name).astype(np.float32) for x in (q_in, k_in, v_in))
    q_x, k_x, v_x, allowed, scale, plan = _prepare(q_r, k_r, v_r, causal, scale, mask, dtype=np.float32)
    shape_o = plan.batch_shape + (q_x.shape[-2], v_x.shape[-1])
    do_x = np.broadcast_to(round_to(do, name).astype(np.float32), shape_o)
    scale_r = round_to(np.float64(scale), name)

    def t(x):
        return np.swapaxes(x, -1, -2)

    with np.errstate(over="ignore"):
        s = round_to(round_to(q_x @ t(k_x), name) * scale_r, name)
        e, l, _ = _softmax_parts(s, allowed)
        p = round_to(e / _safe_divisor(l)[..., None].astype(np.float32), name)
        o = round_to(p @ v_x, name)
        dv_x = round_to(t(p) @ do_x, name)
        dp = round_to(do_x @ t(v_x), name)
        row_dot = np.sum(do_x * o, axis=-1, dtype=np.float32)
        ds = round_to(p * (dp - row_dot[..., None]), name)
        dq_x = round_to(round_to(ds @ k_x, name) * scale_r, name)
        dk_x = round_to(round_to(t(ds) @ q_x, name) * scale_r, name)
    # A framework sums the gradients of broadcast or repeated (grouped) heads in float32 and
    # stores the sum in dtype: one more rounding where heads share q, k or v.
    to64 = lambda x: np.asarray(x, dtype=np.float64)
    stored = lambda x: to64(round_to(x, name))
    return (
        stored(_sum_to_shape(to64(dq_x), q_in.shape)),
        stored(_reduce_kv_grad(to64(dk_x), k_in.shape, plan)),
        stored(_reduce_kv_grad(to64(dv_x), v_in.shape, plan)),
    )
