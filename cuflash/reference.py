"""NumPy reference implementation of cuflash attention -- the executable spec.

Everything in this module is plain NumPy, computed in float64 unless stated
otherwise.  It is the oracle every test compares the CUDA kernels against, and
it is meant to be read: when this file and any other description of cuflash
disagree, this file is right.

Conventions
-----------
Shapes::

    q    (..., Nq, d)        queries
    k    (..., Nk, d)        keys
    v    (..., Nk, dv)       values
    o    (*batch, Nq, dv)    output
    l, m (*batch, Nq)        softmax statistics (row sum and row max)

Scores are ``S = scale * q @ k^T`` with ``scale = 1 / sqrt(d)`` by default.

Key ``j`` is *allowed* for query ``i`` when

* ``causal`` is off, or ``j <= i + (Nk - Nq)`` (the causal diagonal is aligned
  to the bottom-right corner, as in flash-attention >= 2.1, so the last query
  always sees every key), and
* the optional boolean ``mask`` (broadcastable to ``(*batch, Nq, Nk)``, True
  meaning allowed) is True at ``[..., i, j]``.

Over the allowed keys of row ``i``::

    m[i] = max_j S[i, j]
    l[i] = sum_j exp(S[i, j] - m[i])
    o[i] = sum_j exp(S[i, j] - m[i]) / l[i] * v[j]

A row with no allowed key has ``o = 0``, ``l = 0`` and ``m = -inf``; nothing
here ever produces NaN or a floating-point warning for such rows.
``m + log(l)`` is the row's log-sum-exp.

Leading dimensions (all but the last two) are batch dimensions and broadcast
by NumPy rules, with one extension for grouped-query attention: when q's last
leading dimension ``Hq`` and the (k, v) last leading dimension ``Hk`` satisfy
``Hk > 1``, ``Hk != Hq`` and ``Hq % Hk == 0``, query head ``h`` reads key/value
head ``h // (Hq // Hk)``.  ``Hk == 1`` is ordinary broadcasting.  k and v must
broadcast with each other.  :func:`broadcast_plan` and :func:`expand_kv` are
the single place where these rules are written down.

Functions
---------
* :func:`standard_attention` -- direct float64 attention (materialises S).
* :func:`flash_forward_tiled` -- FlashAttention Algorithm 1, block by block.
* :func:`standard_attention_backward` -- analytic gradients.
* :func:`flash_backward_tiled` -- FlashAttention backward (Algorithm 4),
  block by block with recomputation.
* :func:`block_sparse_forward_tiled` -- block-sparse FlashAttention
  (Algorithm 5): Algorithm 1 that skips the tiles a
  :class:`cuflash.masks.BlockMask` marks absent.
* :func:`block_sparse_backward_tiled` -- its backward: Algorithm 4 that
  skips the same tiles.
* :func:`element_mask` -- the element mask a block mask and a sliding window
  stand for; ``standard_attention(mask=element_mask(...))`` is the oracle of
  block-sparse and windowed attention.
* :func:`lowp_attention` -- plain attention evaluated the way a framework does
  it in float16 / bfloat16 / float32; its error against the float64 reference
  sets the error budget of the kernels.
* :func:`round_to` -- round values to float16 / bfloat16 / float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .masks import BlockMask, _window_pair, sliding_window

__all__ = [
    "ReferenceOutput",
    "BroadcastPlan",
    "broadcast_plan",
    "expand_kv",
    "allowed_keys",
    "standard_attention",
    "standard_attention_backward",
    "flash_forward_tiled",
    "flash_backward_tiled",
    "block_sparse_forward_tiled",
    "block_sparse_backward_tiled",
    "element_mask",
    "round_to",
    "lowp_attention",
    "lowp_attention_backward",
]

DEFAULT_BLOCK_ROWS = 32
DEFAULT_BLOCK_COLS = 32


class ReferenceOutput(NamedTuple):
    """Attention result: ``o`` (*batch, Nq, dv), ``l`` and ``m`` (*batch, Nq)."""

    o: np.ndarray
    l: np.ndarray
    m: np.ndarray


class BroadcastPlan(NamedTuple):
    """How q, k and v leading (batch) shapes combine.

    batch_shape: leading shape of every output (o, l, m).
    kv_shape:    broadcast of k's and v's leading shapes, before grouping.
    group_size:  query heads per key/value head (1 when not grouped).
    """

    batch_shape: Tuple[int, ...]
    kv_shape: Tuple[int, ...]
    group_size: int


# --------------------------------------------------------------------------
# Shapes, broadcasting, grouped heads and masks
# --------------------------------------------------------------------------


def _broadcast_or_raise(message: str, *shapes: Tuple[int, ...]) -> Tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(message) from None


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

    q_lead, k_lead, v_lead = q_shape[:-2], k_shape[:-2], v_shape[:-2]
    kv_shape = _broadcast_or_raise(
        f"leading (batch) dimensions of k and v do not broadcast: "
        f"k.shape={k_shape}, v.shape={v_shape}",
        k_lead,
        v_lead,
    )

    group_size = 1
    grouped_kv_shape = kv_shape
    if q_lead and kv_shape:
        hq, hk = q_lead[-1], kv_shape[-1]
        if hk > 1 and hk != hq and hq % hk == 0:
            group_size = hq // hk
            grouped_kv_shape = kv_shape[:-1] + (hq,)

    batch_shape = _broadcast_or_raise(
        f"leading (batch) dimensions of q and k/v do not broadcast "
        f"(grouped heads need Hq % Hk == 0): "
        f"q.shape={q_shape}, k.shape={k_shape}, v.shape={v_shape}",
        q_lead,
        grouped_kv_shape,
    )
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
        combined = _broadcast_or_raise(
            f"mask.shape={mask.shape} does not broadcast to (*batch, Nq, Nk)={target}",
            mask.shape,
            target,
        )
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


# --------------------------------------------------------------------------
# Standard (materialised) attention
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# FlashAttention, tiled exactly as in the paper
# (Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention
#  with IO-Awareness", 2022 -- Algorithm 1 forward, Algorithm 4 backward.)
# --------------------------------------------------------------------------


def _blocks(n: int, size: int):
    if size < 1:
        raise ValueError(f"block size must be >= 1, got {size}")
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _online_softmax_step(s_ij, v_j, o_i, l_i, m_i):
    """One tile of the online softmax: fold scores s_ij (masked entries -inf) and values v_j
    into the row block's running (O_i, l_i, m_i). Returns (O_i, l_new, m_new).

    A row with no allowed key in this tile has m~ = -inf; the safe shift (_shift_of) makes its
    P~ row exactly 0, and if the row has seen no allowed key at all, m_new = -inf and both
    rescale factors are exp(-inf) = 0 rather than NaN.
    """
    m_tilde = s_ij.max(axis=1)
    p_tilde = np.exp(s_ij - _shift_of(m_tilde)[:, None])
    l_tilde = p_tilde.sum(axis=1)
    m_new = np.maximum(m_i, m_tilde)
    shift = _shift_of(m_new)
    old_factor = np.exp(m_i - shift)  # e^{m_i - m_i^new}
    block_factor = np.exp(m_tilde - shift)  # e^{m~_ij - m_i^new}
    l_new = old_factor * l_i + block_factor * l_tilde
    # O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~_ij - m_new} P~_ij V_j).
    # O_i is stored normalised, so it is re-scaled by l_i first; rows with l_new = 0 have a
    # zero numerator, and dividing by 1 keeps them 0.
    numerator = (l_i * old_factor)[:, None] * o_i + block_factor[:, None] * (p_tilde @ v_j)
    return numerator / _safe_divisor(l_new)[:, None], l_new, m_new


def _flash_forward_head(q, k, v, allowed, scale, block_rows, block_cols):
    """Algorithm 1 for one head: q (Nq, d), k (Nk, d), v (Nk, dv), allowed (Nq, Nk).

    Arrays named o, l, m play the role of HBM; the *_i / *_j slices copied
    out of them play the role of SRAM.
    """
    nq, nk = q.shape[0], k.shape[0]
    # Line 1: block sizes Bc, Br are given by the caller.
    # Line 2: initialise O = 0, l = 0, m = -inf in HBM.
    o = np.zeros((nq, v.shape[1]))
    l = np.zeros(nq)
    m = np.full(nq, -np.inf)
    # Lines 3-4: split Q, O, l, m into Tr row blocks and K, V into Tc column blocks.
    row_blocks = _blocks(nq, block_rows)
    col_blocks = _blocks(nk, block_cols)

    for cols in col_blocks:  # Line 5: for 1 <= j <= Tc
        k_j, v_j = k[cols], v[cols]  # Line 6: load K_j, V_j to SRAM.
        for rows in row_blocks:  # Line 7: for 1 <= i <= Tr
            # Line 8: load Q_i, O_i, l_i, m_i to SRAM.
            q_i, o_i, l_i, m_i = q[rows], o[rows], l[rows], m[rows]

            # Line 9: S_ij = Q_i K_j^T, here with the softmax scale tau and
            # the mask applied as in the paper's Algorithm 2 (masked -> -inf).
            s_ij = scale * (q_i @ k_j.T)
            s_ij = np.where(allowed[rows, cols], s_ij, -np.inf)

            # Lines 10-12: block-local max, exponentials and sums (m~, P~, l~),
            # merged with the running statistics, and the rescaled O_i written back.
            o[rows], l_new, m_new = _online_softmax_step(s_ij, v_j, o_i, l_i, m_i)

            # Line 13: write l_i <- l_new, m_i <- m_new to HBM.
            l[rows] = l_new
            m[rows] = m_new
        # Line 14: end for (rows).
    # Line 15: end for (columns).  Line 16: return O (and l, m for backward).
    return o, l, m


def flash_forward_tiled(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    block_cols: int = DEFAULT_BLOCK_COLS,
    mask=None,
) -> ReferenceOutput:
    """FlashAttention forward (paper Algorithm 1) in float64, block by block.

    Same arguments and result as :func:`standard_attention`; block_rows (Br)
    and block_cols (Bc) are the row/column tile sizes.  Equal to
    standard_attention up to float64 rounding; the tiling only changes the
    order of operations.  Batched inputs are processed one head at a time.
    """
    q, k, v, allowed, scale, plan = _prepare(q, k, v, causal, scale, mask)
    batch_shape = plan.batch_shape
    o = np.empty(batch_shape + (q.shape[-2], v.shape[-1]))
    l = np.empty(batch_shape + (q.shape[-2],))
    m = np.empty(batch_shape + (q.shape[-2],))
    for index in np.ndindex(*batch_shape):
        o[index], l[index], m[index] = _flash_forward_head(
            q[index], k[index], v[index], allowed[index], scale, block_rows, block_cols
        )
    return ReferenceOutput(o, l, m)


def _flash_backward_head(do, q, k, v, o, l, m, scale, block_rows, block_cols, row_blocks_of, tile_allowed):
    """Algorithm 4 (no dropout) for one head; shapes as in _flash_forward_head.

    row_blocks_of(j) gives the row blocks visited in column j (all of them for Algorithm 4;
    the present ones for the block-sparse backward) and tile_allowed(rows, cols) the element
    mask of a tile.  The row term D = rowsum(dO * O) is computed once up front, as in
    FlashAttention-2 (its Algorithm 2, line 4), instead of inside the loop.
    """
    nq, nk = q.shape[0], k.shape[0]
    # Lines 1 and 14-15, 18 (dropout RNG / mask) do not apply: cuflash has no dropout.
    # Lines 2-4: block sizes and splitting of Q, K, V, O, dO, l, m.
    row_blocks = _blocks(nq, block_rows)
    col_blocks = _blocks(nk, block_cols)
    # D_i of line 19, hoisted out of the loops.
    row_dot = np.sum(do * o, axis=1)
    # Recomputing P needs 1/l and a NaN-free shift; empty rows (l = 0,
    # m = -inf) get 1/l = 0 and shift 0, so their P rows are exactly 0.
    shift = _shift_of(m)
    inv_l = np.divide(1.0, l, out=np.zeros_like(l), where=l != 0)

    # Line 5: dQ, dK, dV = 0 in HBM.
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    for j, cols in enumerate(col_blocks):  # Line 6: for 1 <= j <= Tc
        visited = row_blocks_of(j)
        if len(visited) == 0:
            continue  # no tile in this column: dK_j = dV_j = 0 without loading K_j, V_j
        k_j, v_j = k[cols], v[cols]  # Line 7: load K_j, V_j.
        dk_j = np.zeros_like(k_j)  # Line 8: dK~_j = 0, dV~_j = 0 in SRAM.
        dv_j = np.zeros_like(v_j)
        for i in visited:  # Line 9: for 1 <= i <= Tr (block-sparse: if M_ij != 0)
            rows = row_blocks[i]
            # Line 10: load Q_i, O_i, dO_i, dQ_i, l_i, m_i (O_i enters via D_i).
            stats_i = (shift[rows], inv_l[rows], row_dot[rows])
            _backward_tile_step(q[rows], do[rows], k_j, v_j, tile_allowed(rows, cols), stats_i, scale,
                                dq[rows], dk_j, dv_j)
        # Line 23: end for.  Line 24: write dK_j, dV_j to HBM.
        dk[cols] = dk_j
        dv[cols] = dv_j
    # Line 25: end for.  Line 26: return dQ, dK, dV.
    return dq, dk, dv


def _backward_tile_step(q_i, do_i, k_j, v_j, allowed_ij, stats_i, scale, dq_i, dk_j, dv_j):
    """Lines 11-22 of Algorithm 4 for one tile: add its terms to dq_i, dk_j and dv_j in place.

    stats_i = (shift_i, inv_l_i, D_i): the row max made safe for subtraction, 1 / l (0 for
    empty rows) and rowsum(dO * O) of the tile's rows.
    """
    shift_i, inv_l_i, row_dot_i = stats_i
    s_ij = scale * (q_i @ k_j.T)  # Line 11: S_ij = tau Q_i K_j^T.
    s_ij = np.where(allowed_ij, s_ij, -np.inf)  # Line 12: mask.
    # Line 13: P_ij = diag(l_i)^-1 exp(S_ij - m_i), recomputed from the saved statistics
    # instead of stored.
    p_ij = np.exp(s_ij - shift_i[:, None]) * inv_l_i[:, None]
    dv_j += p_ij.T @ do_i  # Line 16: dV~_j += P_ij^T dO_i.
    dp_ij = do_i @ v_j.T  # Line 17: dP_ij = dO_i V_j^T.
    # Line 19: D_i = rowsum(dO_i * O_i) -- taken from row_dot.
    ds_ij = p_ij * (dp_ij - row_dot_i[:, None])  # Line 20.
    dq_i += scale * (ds_ij @ k_j)  # Line 21: dQ_i += tau dS_ij K_j.
    dk_j += scale * (ds_ij.T @ q_i)  # Line 22: dK~_j += tau dS_ij^T Q_i.


def flash_backward_tiled(
    do,
    q,
    k,
    v,
    o,
    l,
    m,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    block_cols: int = DEFAULT_BLOCK_COLS,
    mask=None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashAttention backward (paper Algorithm 4, no dropout) in float64.

    do, o: (*batch, Nq, dv); l, m: (*batch, Nq) -- the forward's statistics
    (from :func:`flash_forward_tiled` or :func:`standard_attention`).
    Returns (dq, dk, dv) shaped like q, k, v, equal to
    :func:`standard_attention_backward` up to float64 rounding.
    """
    def tiling(index, allowed):  # every tile, masked by the head's allowed (Nq, Nk)
        every_row_block = range(-(-allowed.shape[0] // block_rows))
        return block_rows, block_cols, (lambda j: every_row_block), (lambda rows, cols: allowed[rows, cols])

    return _backward_per_head(do, q, k, v, o, l, m, causal, scale, mask, tiling)


def _backward_per_head(do, q, k, v, o, l, m, causal, scale, mask, tiling):
    """Broadcast the backward's operands, run _flash_backward_head on every head, sum back.

    tiling(index, allowed) gives head ``index``'s (block_rows, block_cols, row_blocks_of,
    tile_allowed) for _flash_backward_head; allowed is that head's (Nq, Nk) element mask.
    """
    q_in, k_in, v_in = np.asarray(q), np.asarray(k), np.asarray(v)
    q_x, k_x, v_x, allowed, scale, plan = _prepare(q_in, k_in, v_in, causal, scale, mask)
    batch_shape = plan.batch_shape
    nq, dv_dim = q_x.shape[-2], v_x.shape[-1]
    do = np.broadcast_to(np.asarray(do).astype(np.float64), batch_shape + (nq, dv_dim))
    o = np.broadcast_to(np.asarray(o).astype(np.float64), batch_shape + (nq, dv_dim))
    l = np.broadcast_to(np.asarray(l).astype(np.float64), batch_shape + (nq,))
    m = np.broadcast_to(np.asarray(m).astype(np.float64), batch_shape + (nq,))

    dq_x = np.empty(q_x.shape)
    dk_x = np.empty(k_x.shape)
    dv_x = np.empty(v_x.shape)
    for index in np.ndindex(*batch_shape):
        dq_x[index], dk_x[index], dv_x[index] = _flash_backward_head(
            do[index], q_x[index], k_x[index], v_x[index], o[index], l[index], m[index],
            scale, *tiling(index, allowed[index]),
        )
    dq = _sum_to_shape(dq_x, q_in.shape)
    dk = _reduce_kv_grad(dk_x, k_in.shape, plan)
    dv = _reduce_kv_grad(dv_x, v_in.shape, plan)
    return dq, dk, dv


# --------------------------------------------------------------------------
# Block-sparse FlashAttention (paper Algorithm 5) and sliding windows
# --------------------------------------------------------------------------


def element_mask(nq: int, nk: int, *, block_mask: Optional[BlockMask] = None, window=None, batch_shape=None) -> np.ndarray:
    """The element mask (True = allowed) that a block mask and a window stand for.

    ``block_mask.to_elements(nq, nk) & sliding_window(nq, nk, *window)``, each
    part left out when None.  This is the definition the block-sparse kernels
    are tested against: ``standard_attention(q, k, v, causal=causal,
    mask=element_mask(...))`` is their oracle (causal is applied by
    standard_attention, on top, as usual).

    The result has shape ``(*batch, nq, nk)`` and may be a read-only
    broadcast view.  batch_shape None means the block mask's own leading
    shape (``()`` without a block mask); otherwise the block mask's leading
    dimensions must broadcast to batch_shape (ValueError quoting both).
    """
    window = _window_pair(window)
    allowed = np.ones((nq, nk), dtype=bool)
    if window is not None:
        allowed = sliding_window(nq, nk, *window)
    lead: Tuple[int, ...] = ()
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a cuflash.masks.BlockMask, got {type(block_mask).__name__}")
        if batch_shape is not None:
            block_mask.check(nq, nk, batch_shape=tuple(batch_shape))
        allowed = allowed & block_mask.to_elements(nq, nk)
        lead = block_mask.batch_shape
    target = (lead if batch_shape is None else tuple(batch_shape)) + (nq, nk)
    return np.broadcast_to(allowed, target)


def _tile_allowed(rows: slice, cols: slice, shift: int, causal: bool, window) -> np.ndarray:
    """Element mask of one tile from the row/column indices: causal and window only."""
    i = np.arange(rows.start, rows.stop)[:, None]
    j = np.arange(cols.start, cols.stop)[None, :]
    allowed = np.ones((i.shape[0], j.shape[1]), dtype=bool)
    if causal:
        allowed &= j <= i + shift
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i + shift - left
        if right >= 0:
            allowed &= j <= i + shift + right
    return allowed


def _block_sparse_forward_head(q, k, v, q_num_blocks, q_indices, scale, block_size, causal, window, on_tile):
    """Algorithm 5 for one head: q (Nq, d), k (Nk, d), v (Nk, dv).

    q_num_blocks (Tk,) and q_indices (Tk, W) are this head's per-key-block
    lists of present query blocks: column j of the block-sparsity matrix M has
    M_ij != 0 exactly for i in q_indices[j, :q_num_blocks[j]].  on_tile(i, j),
    if given, is called for every tile processed.
    """
    nq, nk = q.shape[0], k.shape[0]
    shift = nk - nq
    # Line 1: initialise the dropout RNG -- not needed, cuflash has no dropout.
    # Line 2: block sizes Br x Bc -- the block mask's tiles (its entries M_ij
    #         describe exactly these tiles).
    block_rows, block_cols = block_size
    # Line 3: initialise O = 0, l = 0, m = -inf in HBM.
    o = np.zeros((nq, v.shape[1]))
    l = np.zeros(nq)
    m = np.full(nq, -np.inf)
    # Lines 4-5: split Q, O, l, m into Tr row blocks of Br rows and K, V into
    # Tc column blocks of Bc rows (the last block of each may be short).
    row_blocks = _blocks(nq, block_rows)
    col_blocks = _blocks(nk, block_cols)

    for j, cols in enumerate(col_blocks):  # Line 6: for 1 <= j <= Tc
        count = int(q_num_blocks[j])
        if count == 0:
            # No present tile in this column: the paper would still load
            # K_j, V_j (line 7) and then skip every i; we skip the load too.
            continue
        k_j, v_j = k[cols], v[cols]  # Line 7: load K_j, V_j to SRAM.
        # Lines 8-9: for 1 <= i <= Tr, if M_ij != 0 -- i.e. the present row
        # blocks of column j, in increasing order.  Absent tiles are never
        # touched: no load of Q_i, O_i, l_i, m_i and no arithmetic.
        for i in q_indices[j, :count]:
            rows = row_blocks[i]
            if on_tile is not None:
                on_tile(int(i), j)
            # Line 10: load Q_i, O_i, l_i, m_i to SRAM.
            q_i, o_i, l_i, m_i = q[rows], o[rows], l[rows], m[rows]

            # Line 11: S_ij = tau Q_i K_j^T.
            s_ij = scale * (q_i @ k_j.T)
            # Line 12: S_ij^masked = MASK(S_ij): the element masks that apply
            # inside a present tile (causal, window).  Ragged ends need no
            # mask: the short last blocks simply have fewer rows / columns.
            s_ij = np.where(_tile_allowed(rows, cols, shift, causal, window), s_ij, -np.inf)

            # Lines 13-16: m~_ij = rowmax(S), P~_ij = exp(S - m~_ij), l~_ij =
            # rowsum(P~_ij); m_new, l_new; (line 15, dropout: not applicable); the
            # rescaled O_i written back. The same step as Algorithm 1's lines 10-12.
            o[rows], l_new, m_new = _online_softmax_step(s_ij, v_j, o_i, l_i, m_i)

            # Line 17: write l_i <- l_new, m_i <- m_new to HBM.
            l[rows] = l_new
            m[rows] = m_new
        # Line 18: end if.  Line 19: end for (rows).
    # Line 20: end for (columns).  Line 21: return O, l, m.
    # Rows whose every tile is absent (or fully masked) keep O = 0, l = 0,
    # m = -inf from line 3.
    return o, l, m


def block_sparse_forward_tiled(
    q,
    k,
    v,
    block_mask: BlockMask,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window=None,
    on_tile=None,
) -> ReferenceOutput:
    """Block-sparse FlashAttention forward (paper Algorithm 5) in float64.

    q, k, v and the result as in :func:`standard_attention`.  block_mask: a
    :class:`cuflash.masks.BlockMask` with ``Tq = ceil(Nq / bq)``,
    ``Tk = ceil(Nk / bk)`` and leading dimensions that broadcast to the
    attention batch shape; its block size is the tile size.  Tiles whose
    block is absent are skipped without any load or arithmetic; inside a
    present tile ``causal`` and ``window = (left, right)`` (see
    :func:`cuflash.masks.sliding_window`; -1 = unbounded side) mask elements.

    Equal, up to float64 rounding, to::

        standard_attention(q, k, v, causal=causal, scale=scale,
                           mask=element_mask(Nq, Nk, block_mask=block_mask, window=window))

    on_tile: optional callable ``on_tile(batch_index, i, j)``, called once for
    every tile processed (batch_index is the tuple index into the batch
    shape); tests use it to check that exactly the present tiles are visited.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuflash.masks.BlockMask, got {type(block_mask).__name__}")
    window = _window_pair(window)
    q, k, v, _, scale, plan = _prepare(q, k, v, False, scale, None)
    batch_shape = plan.batch_shape
    nq, nk = q.shape[-2], k.shape[-2]
    block_mask.check(nq, nk, batch_shape=batch_shape)
    tk = block_mask.shape[-1]
    q_num_blocks = np.broadcast_to(block_mask.q_num_blocks, batch_shape + (tk,))
    q_indices = np.broadcast_to(block_mask.q_indices, batch_shape + block_mask.q_indices.shape[-2:])

    o = np.empty(batch_shape + (nq, v.shape[-1]))
    l = np.empty(batch_shape + (nq,))
    m = np.empty(batch_shape + (nq,))
    for index in np.ndindex(*batch_shape):
        visit = None if on_tile is None else (lambda i, j, index=index: on_tile(index, i, j))
        o[index], l[index], m[index] = _block_sparse_forward_head(
            q[index], k[index], v[index], q_num_blocks[index], q_indices[index],
            scale, block_mask.block_size, causal, window, visit,
        )
    return ReferenceOutput(o, l, m)


def block_sparse_backward_tiled(
    do,
    q,
    k,
    v,
    o,
    l,
    m,
    block_mask: BlockMask,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window=None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block-sparse FlashAttention backward in float64: Algorithm 4 visiting only present tiles.

    The backward of Algorithm 5, as the paper describes it: the loops of Algorithm 4 with
    line 9 restricted to the present row blocks of column j (the mask's ``q_indices``), so an
    absent tile costs nothing and a key block with no present tile gets dK = dV = 0 without
    being loaded.  Inside a present tile ``causal`` and ``window`` mask elements, as in
    :func:`block_sparse_forward_tiled`.  Arguments as in :func:`flash_backward_tiled` (o, l,
    m from the block-sparse forward with the same mask) plus block_mask; returns (dq, dk, dv)
    shaped like q, k, v, equal up to float64 rounding to::

        standard_attention_backward(do, q, k, v, causal=causal, scale=scale,
                                    mask=element_mask(Nq, Nk, block_mask=block_mask, window=window))
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuflash.masks.BlockMask, got {type(block_mask).__name__}")
    window = _window_pair(window)
    batch_shape = broadcast_plan(np.shape(q), np.shape(k), np.shape(v)).batch_shape
    nq, nk = np.shape(q)[-2], np.shape(k)[-2]
    block_mask.check(nq, nk, batch_shape=batch_shape)
    tk = block_mask.shape[-1]
    q_num_blocks = np.broadcast_to(block_mask.q_num_blocks, batch_shape + (tk,))
    q_indices = np.broadcast_to(block_mask.q_indices, batch_shape + block_mask.q_indices.shape[-2:])
    block_rows, block_cols = block_mask.block_size

    def tiling(index, _allowed):  # the present tiles, masked by causal and the window only
        def row_blocks_of(j):
            return q_indices[index][j, : q_num_blocks[index][j]]

        def tile_allowed(rows, cols):
            return _tile_allowed(rows, cols, nk - nq, causal, window)

        return block_rows, block_cols, row_blocks_of, tile_allowed

    return _backward_per_head(do, q, k, v, o, l, m, False, scale, None, tiling)


# --------------------------------------------------------------------------
# Low precision: rounding and "what a framework would compute"
# --------------------------------------------------------------------------

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
