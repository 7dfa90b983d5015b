"""Block-sparse FlashAttention (paper Algorithm 5) and its backward, and the element mask a
block mask and a sliding window stand for (the oracle of both)."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ..masks import BlockMask, _window_pair, sliding_window
from .broadcasting import broadcast_plan
from .dense import ReferenceOutput, _prepare
from .tiled import _backward_per_head, _blocks, _online_softmax_step

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
