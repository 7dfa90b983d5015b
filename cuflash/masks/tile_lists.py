"""The lists a block mask is read through: its own per-row lists (FlexAttention style) and the
per-tile lists one kernel launch walks (:class:`TileLists`), built on the block grid."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Tuple

import numpy as np

from .._constants import PARTIAL_TILE


def _compact_lists(present: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per-row lists of the present columns of ``present`` (..., T, U).

    Returns ``num`` int32 (..., T) and ``indices`` int32 (..., T, W) with
    ``W = max(1, max(num))``: row r's present columns in increasing order in
    ``indices[..., r, :num[r]]``, the rest padded with the last valid column
    (0 for an empty row), so a kernel may read one entry past the list without
    a bounds check.
    """
    num = present.sum(axis=-1, dtype=np.int64)
    width = max(1, int(num.max(initial=0)))
    n_cols = present.shape[-1]
    if n_cols == 0:
        indices = np.zeros(present.shape[:-1] + (width,), dtype=np.int64)
    else:
        # A stable sort of "absent" puts the present columns first, in order.
        order = np.argsort(~present, axis=-1, kind="stable")[..., :width]
        last = np.take_along_axis(order, np.maximum(num - 1, 0)[..., None], axis=-1)
        padding = np.where(num[..., None] > 0, last, 0)
        indices = np.where(np.arange(width) < num[..., None], order, padding)
    return num.astype(np.int32), indices.astype(np.int32)


def _read_only(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    x.setflags(write=False)
    return x


# PARTIAL_TILE (from _constants, passed to the kernels as kPartialTile) flags a tile-list
# entry whose tile straddles present and absent blocks: the kernel must then look the block of
# every element up.


class TileLists(NamedTuple):
    """The block mask as one kernel launch reads it (see :meth:`BlockMask.tile_lists`).

    counts: int32 (mask_batch, n_outer): how many inner tiles each outer tile visits.
    lists: int32 (mask_batch, n_outer, list_stride): those inner tiles, ascending; an entry
        is the tile's index, OR'ed with :data:`PARTIAL_TILE` when the tile needs the
        element-wise block lookup.  Entries past the count repeat the last one (0 for an
        empty list), so a kernel may prefetch one entry past the end.
    blocks: uint8 (mask_batch, Tq, Tk): the block mask itself (1 = present), for that lookup.

    ``mask_batch`` is the product of the mask's leading dims, flattened C-order.  NumPy
    arrays from :meth:`BlockMask.tile_lists`, CuPy arrays from
    :meth:`BlockMask.device_tile_lists`; all C-contiguous and meant to be read only.
    """

    counts: Any
    lists: Any
    blocks: Any

    @property
    def n_outer(self) -> int:
        return self.counts.shape[1]

    @property
    def list_stride(self) -> int:
        return self.lists.shape[2]


def _tile_spans(n: int, tile: int, block: int):
    """Tiles of ``tile`` elements over [0, n): first and last element, first and last block."""
    first = np.arange(0, n, tile, dtype=np.int64)
    last = np.minimum(first + tile, n) - 1
    return first, last, first // block, last // block


def _range_sums(x: np.ndarray, first: np.ndarray, last: np.ndarray, axis: int) -> np.ndarray:
    """Sums of x over the index ranges [first[t], last[t]] along axis (t replaces that axis)."""
    zero = np.zeros(x.shape[:axis] + (1,) + x.shape[axis + 1 :], dtype=np.int32)
    prefix = np.concatenate([zero, np.cumsum(x, axis=axis, dtype=np.int32)], axis=axis)
    return np.take(prefix, last + 1, axis=axis) - np.take(prefix, first, axis=axis)


def _band_tiles(rows, cols, nq: int, nk: int, causal: bool, window) -> np.ndarray:
    """(row tiles, col tiles) bool: which tiles hold at least one key the causal mask and the
    window allow.  rows / cols are the (first, last) element spans of the tiles.

    Both masks bound the diagonal offset j - i: the window to [shift - left, shift + right],
    causal to <= shift (shift = nk - nq).  Over a tile's rectangle of integer points j - i
    takes every value from c0 - r1 to c1 - r0, so the tile meets the band iff those ranges meet.
    """
    (r0, r1), (c0, c1) = rows, cols
    shift = nk - nq
    left, right = window if window is not None else (-1, -1)
    low = None if left < 0 else shift - left
    high = None if right < 0 else shift + right
    if causal:
        high = shift if high is None else min(high, shift)
    inside = np.ones((len(r0), len(c0)), dtype=bool)
    if low is not None:
        inside &= c1[None, :] - r0[:, None] >= low
    if high is not None:
        inside &= c0[None, :] - r1[:, None] <= high
    return inside


def _pack_tile_lists(listed: np.ndarray, partial: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(counts, lists) of the listed inner tiles (last axis) of every outer tile, in order."""
    counts = listed.sum(axis=-1, dtype=np.int32)
    stride = max(1, int(counts.max(initial=0)))
    entries = np.arange(listed.shape[-1], dtype=np.int32) | np.where(partial, np.int32(PARTIAL_TILE), np.int32(0))
    slot = np.cumsum(listed, axis=-1, dtype=np.int32) - 1  # an entry's place in its list
    lists = np.zeros(listed.shape[:-1] + (stride,), dtype=np.int32)
    where = np.nonzero(listed)
    lists[where[:-1] + (slot[where],)] = entries[where]
    last = np.take_along_axis(lists, np.maximum(counts - 1, 0)[..., None].astype(np.intp), axis=-1)
    lists = np.where(np.arange(stride) < counts[..., None], lists, last)
    return counts, lists


def build_tile_lists(present, block_size, nq, nk, tile_rows, tile_cols, transpose, causal, window) -> TileLists:
    """:meth:`BlockMask.tile_lists` of the block grid ``present`` (..., Tq, Tk), uncached."""
    (bq, bk), grid = block_size, present.shape[-2:]
    present = present.reshape((math.prod(present.shape[:-2]),) + grid)  # (mask_batch, Tq, Tk)
    q_first, q_last, qb_first, qb_last = _tile_spans(nq, tile_rows, bq)
    k_first, k_last, kb_first, kb_last = _tile_spans(nk, tile_cols, bk)
    # Per query tile and block column: how many of the tile's block rows are present;
    # then per key tile: does any / does every overlapped block column have one / all.
    per_column = _range_sums(present, qb_first, qb_last, axis=1)
    rows_spanned = (qb_last - qb_first + 1)[:, None]
    any_present = _range_sums(per_column > 0, kb_first, kb_last, axis=2) > 0
    all_present = _range_sums(per_column == rows_spanned, kb_first, kb_last, axis=2) == kb_last - kb_first + 1
    listed = any_present & _band_tiles((q_first, q_last), (k_first, k_last), nq, nk, causal, window)
    partial = listed & ~all_present
    if transpose:
        listed, partial = np.swapaxes(listed, 1, 2), np.swapaxes(partial, 1, 2)
    counts, lists = _pack_tile_lists(listed, partial)
    blocks = present.astype(np.uint8)
    return TileLists(_read_only(counts), _read_only(lists), _read_only(blocks))
