"""cuflash.merge: attention over disjoint key sets, combined exactly from the parts' (o, l, m).

Attention of one query row over keys K = A u B (disjoint), with cuflash's statistics
(:class:`cuflash.AttentionOutput`: ``m = max_j S``, ``l = sum_j exp(S - m)``, o normalised),
follows from the two parts alone::

    m = max(m_a, m_b)
    w_a = l_a exp(m_a - m)          w_b = l_b exp(m_b - m)     (each part's softmax mass)
    l = w_a + w_b
    o = (w_a o_a + w_b o_b) / l

This is the step split-KV decoding and ring attention end with. The code is written once for
every framework: NumPy, CuPy and JAX arrays are handled by their NumPy-style namespace, torch
tensors by torch's own functions (so the merge is differentiable, and traceable by
torch.compile and jax.jit), never copied between frameworks.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple

import numpy as np

from ._arrays import AttentionOutput

__all__ = ["merge", "merge_stacked"]

_O_DTYPES = ("float16", "bfloat16", "float32", "float64")
_STAT_DTYPES = ("float32", "float64")


class _Ops(NamedTuple):
    """The few array operations a merge needs, in one framework's spelling."""

    exp: Callable
    maximum: Callable
    where: Callable
    max_along: Callable  # (x, axis) -> max over axis
    sum_along: Callable  # (x, axis) -> sum over axis
    cast: Callable  # (x, dtype) -> x in that dtype (no copy when it already is)
    dtype_name: Callable  # x -> 'float32', 'bfloat16', ...
    float32: Any
    float64: Any


def _numpy_style_ops(xp) -> _Ops:
    return _Ops(
        exp=xp.exp,
        maximum=xp.maximum,
        where=xp.where,
        max_along=lambda x, axis: xp.max(x, axis=axis),
        sum_along=lambda x, axis: xp.sum(x, axis=axis),
        cast=lambda x, dtype: x.astype(dtype),
        dtype_name=lambda x: np.dtype(x.dtype).name,
        float32=xp.float32,
        float64=xp.float64,
    )


def _torch_ops(torch) -> _Ops:
    return _Ops(
        exp=torch.exp,
        maximum=torch.maximum,
        where=torch.where,
        max_along=lambda x, axis: torch.amax(x, dim=axis),
        sum_along=lambda x, axis: torch.sum(x, dim=axis),
        cast=lambda x, dtype: x.to(dtype),
        dtype_name=lambda x: str(x.dtype).removeprefix("torch."),
        float32=torch.float32,
        float64=torch.float64,
    )


def _framework(x) -> tuple:
    """(framework name, _Ops) of an array; the framework's module is only looked up when
    it is already imported (an array of it cannot exist otherwise)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch", _torch_ops(torch)
    if isinstance(x, np.ndarray):
        return "numpy", _numpy_style_ops(np)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy", _numpy_style_ops(cupy)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):  # tracers inside jax.jit are jax.Arrays too
        import jax.numpy as jnp

        return "jax", _numpy_style_ops(jnp)
    raise TypeError(
        f"cuflash.merge takes NumPy, CuPy, torch or JAX arrays, got {type(x).__module__}.{type(x).__name__}"
    )


def _check_parts(arrays: dict, o_names: tuple, stat_names: tuple):
    """One framework, one dtype per role, matching shapes; returns (_Ops, compute dtype).

    ``arrays``: name -> array; ``o_names`` name the outputs (..., Nq, dv), ``stat_names`` the
    l's and m's (..., Nq), all checked against the first of each.
    """
    frameworks = {name: _framework(x) for name, x in arrays.items()}
    if len({kind for kind, _ in frameworks.values()}) != 1:
        raise TypeError("cuflash.merge needs all arrays from one framework, got "
                        + ", ".join(f"{name} {kind}" for name, (kind, _) in frameworks.items()))
    ops = frameworks[o_names[0]][1]
    dtypes = {name: ops.dtype_name(x) for name, x in arrays.items()}
    for names, allowed in ((o_names, _O_DTYPES), (stat_names, _STAT_DTYPES)):
        given = {dtypes[n] for n in names}
        if len(given) != 1 or not given <= set(allowed):
            raise TypeError(
                f"{', '.join(names)} must share one dtype out of {', '.join(allowed)}, got "
                + ", ".join(f"{n} {dtypes[n]}" for n in names)
            )
    shapes = {name: tuple(x.shape) for name, x in arrays.items()}
    stat_shape = shapes[stat_names[0]]
    o_shape = stat_shape + (shapes[o_names[0]][-1:] or ("dv",))  # a 0-d o matches nothing
    expected = {**{n: o_shape for n in o_names}, **{n: stat_shape for n in stat_names}}
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ValueError(
                f"{name} must have shape {shape}: o {'(P, ' if len(o_names) == 1 else '('}..., Nq, dv) "
                f"and l, m the same without dv; got " + ", ".join(f"{n} {s}" for n, s in shapes.items())
            )
    return ops, (ops.float64 if "float64" in dtypes.values() else ops.float32)


def _shift_of(ops: _Ops, m):
    """The merged row max, made safe to subtract: a row that is empty in every part has
    m = -inf, and exp(-inf - (-inf)) would be NaN; subtracting 0 there gives each part's
    weight exp(-inf) * 0 = 0, and o = 0, l = 0 follow."""
    return ops.where(m == -float("inf"), 0.0, m)


def _weight(ops: _Ops, l, m, shift):
    """A part's softmax mass relative to exp(shift): 0 for an empty part (l = 0, m = -inf)."""
    return l * ops.exp(m - shift)


def _normalised(ops: _Ops, weighted_sum, l):
    """o from its unnormalised sum; rows with l = 0 have a zero sum and stay 0."""
    return weighted_sum / ops.where(l == 0, 1.0, l)[..., None]


def merge(o_a, l_a, m_a, o_b, l_b, m_b) -> AttentionOutput:
    """Attention over two disjoint key sets, combined exactly from each set's result.

    Args:
        o_a, l_a, m_a: :func:`cuflash.attention`'s result for the keys of part a: o (..., Nq, dv)
            in float16, bfloat16, float32 or float64; l and m (..., Nq) float32 or float64, with
            m = max_j S, l = sum_j exp(S - m) over the part's allowed keys. A row with no key
            in a part has l = 0, m = -inf (and o = 0) there.
        o_b, l_b, m_b: the same for part b; same shapes and dtypes as part a.
        All six are NumPy, CuPy, torch or JAX arrays of one framework; the merge runs in that
        framework (differentiable under torch autograd, traceable by torch.compile and jax.jit).

    Returns:
        AttentionOutput(o, l, m) of the union of the keys: o in o_a's dtype, l and m float32
        (float64 when any input is float64, the precision the merge is computed in). A row
        empty in both parts gets o = 0, l = 0, m = -inf, never NaN.

    Example:
        >>> half = k.shape[-2] // 2
        >>> a = cuflash.attention(q, k[..., :half, :], v[..., :half, :])
        >>> b = cuflash.attention(q, k[..., half:, :], v[..., half:, :])
        >>> o, l, m = cuflash.merge(*a, *b)    # == cuflash.attention(q, k, v)
    """
    arrays = {"o_a": o_a, "l_a": l_a, "m_a": m_a, "o_b": o_b, "l_b": l_b, "m_b": m_b}
    ops, compute = _check_parts(arrays, ("o_a", "o_b"), ("l_a", "m_a", "l_b", "m_b"))
    o_dtype = o_a.dtype
    o_a, l_a, m_a, o_b, l_b, m_b = (ops.cast(x, compute) for x in arrays.values())
    m = ops.maximum(m_a, m_b)
    shift = _shift_of(ops, m)
    w_a, w_b = _weight(ops, l_a, m_a, shift), _weight(ops, l_b, m_b, shift)
    l = w_a + w_b
    o = _normalised(ops, w_a[..., None] * o_a + w_b[..., None] * o_b, l)
    return AttentionOutput(ops.cast(o, o_dtype), l, m)


def merge_stacked(o, l, m) -> AttentionOutput:
    """:func:`merge` of P parts stacked along axis 0 (split-KV's partial results).

    Args:
        o: (P, ..., Nq, dv), part p's output at ``o[p]``; l, m: (P, ..., Nq). Dtypes and
            frameworks as in :func:`merge`. Empty parts (l = 0, m = -inf) contribute nothing;
            P = 0 gives the empty result.

    Returns:
        AttentionOutput(o (..., Nq, dv), l, m (..., Nq)) over the union of the parts' keys,
        dtypes as in :func:`merge`.

    Example:
        >>> parts = [cuflash.attention(q, k[..., s, :], v[..., s, :]) for s in key_slices]
        >>> o, l, m = cuflash.merge_stacked(*(cupy.stack(x) for x in zip(*parts)))
    """
    arrays = {"o": o, "l": l, "m": m}
    if len(l.shape) < 1:
        raise ValueError(f"l must have shape (P, ..., Nq) with the parts along axis 0, got {tuple(l.shape)}")
    ops, compute = _check_parts(arrays, ("o",), ("l", "m"))
    o_dtype = o.dtype
    o, l, m = (ops.cast(x, compute) for x in arrays.values())
    # Zero parts: the max of nothing is -inf (a sum over nothing is 0, of the right shape).
    m_max = ops.max_along(m, 0) if l.shape[0] else ops.sum_along(m, 0) - float("inf")
    shift = _shift_of(ops, m_max)
    w = _weight(ops, l, m, shift[None])
    l_sum = ops.sum_along(w, 0)
    o_sum = _normalised(ops, ops.sum_along(w[..., None] * o, 0), l_sum)
    return AttentionOutput(ops.cast(o_sum, o_dtype), l_sum, m_max)

