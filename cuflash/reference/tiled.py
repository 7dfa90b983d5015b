"""FlashAttention, tiled exactly as in the paper (Dao et al., "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness", 2022): Algorithm 1 forward, Algorithm 4
backward, line by line, in float64."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from .broadcasting import _reduce_kv_grad, _sum_to_shape
from .dense import ReferenceOutput, _prepare, _safe_divisor, _shift_of

DEFAULT_BLOCK_ROWS = 32
DEFAULT_BLOCK_COLS = 32


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
