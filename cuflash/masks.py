"""Block-sparse attention masks: the :class:`BlockMask` object and common sparsity patterns.

Plain NumPy; importing this module needs neither a GPU nor CuPy.

Block sparsity (FlashAttention paper, Algorithm 5) splits the score matrix
``S`` (Nq x Nk) into tiles of ``bq`` query rows by ``bk`` key columns and
marks each tile present or absent.  An absent tile is skipped entirely -- its
K/V (and Q) blocks are not loaded and no scores are computed -- so every
element in it is masked.  Inside a present tile, the other masks still apply
element by element::

    key j is allowed for query i  iff  block (i // bq, j // bk) is present
                                   and (not causal or j <= i + (Nk - Nq))
                                   and (i, j) is inside the window, if any

The patterns below are plain block masks and know nothing about causality:
``causal=True`` in attention combines with them by AND at the element level,
with the usual bottom-right alignment.  The last tile of a ragged sequence
covers only ``nq - (Tq - 1) * bq`` rows (or ``nk - (Tk - 1) * bk`` keys).

A :class:`BlockMask` is built once and reused.  It stores, like PyTorch
FlexAttention's BlockMask, compact per-query-block lists for the forward
pass (``kv_num_blocks``, ``kv_indices``) and the transposed per-key-block
lists for the backward pass (``q_num_blocks``, ``q_indices``).  The kernels
work in tiles of their own size, which need not be the mask's block size:
:meth:`BlockMask.tile_lists` translates the mask into per-tile lists for one
kernel launch, and caches them (and their GPU copies) on the mask.

Patterns (each returns a BlockMask; combine them with ``|`` and ``&``):
:func:`butterfly`, :func:`fixed`, :func:`strided`, :func:`local`,
:func:`causal`, :func:`global_tokens`, :func:`random`, :func:`dense`, and the
token-exact sliding window: :func:`sliding_window` (element mask) with
:func:`window_block_mask` (the tiles it touches).
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import struct
import threading
import weakref
import zlib
from typing import Any, NamedTuple, Optional, Tuple, Union

import numpy as np

from ._config import PARTIAL_TILE

__all__ = [
    "BlockMask",
    "TileLists",
    "PARTIAL_TILE",
    "butterfly",
    "fixed",
    "strided",
    "local",
    "causal",
    "global_tokens",
    "random",
    "dense",
    "sliding_window",
    "window_block_mask",
]

DEFAULT_BLOCK_SIZE = 128

BlockSize = Union[int, Tuple[int, int]]


# --------------------------------------------------------------------------
# Argument checking
# --------------------------------------------------------------------------


def _as_int(value, name: str, minimum: int) -> int:
    """value as a Python int >= minimum, else TypeError / ValueError naming it."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def _block_pair(block_size) -> Tuple[int, int]:
    """An int or a (bq, bk) pair -> (bq, bk), both >= 1."""
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a (bq, bk) pair, got {block_size!r}")
        return (_as_int(block_size[0], "block_size[0] (bq)", 1), _as_int(block_size[1], "block_size[1] (bk)", 1))
    size = _as_int(block_size, "block_size", 1)
    return (size, size)


def _grid(n_blocks, n_k_blocks) -> Tuple[int, int]:
    tq = _as_int(n_blocks, "n_blocks", 1)
    tk = tq if n_k_blocks is None else _as_int(n_k_blocks, "n_k_blocks", 1)
    return tq, tk


def _check_window_side(value, name: str) -> int:
    """A window extent: an int >= 0, or -1 for unbounded."""
    return _as_int(value, name, -1)


def _window_pair(window) -> Optional[Tuple[int, int]]:
    """None, or window = (left, right) with each side an int >= 0 or -1 (unbounded)."""
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a (left, right) pair, got {window!r}") from None
    return _check_window_side(left, "window left"), _check_window_side(right, "window right")


def window_option(window) -> Optional[Tuple[int, int]]:
    """window= as (left, right), or None for no window (which (-1, -1) also is)."""
    window = _window_pair(window)
    return None if window == (-1, -1) else window


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------
# Compact lists
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Per-tile lists for the kernels
# --------------------------------------------------------------------------

# PARTIAL_TILE (from _config, which passes it to the kernels as kPartialTile) flags a tile-list
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


_MAX_CACHED_LISTS = 32  # per mask; a mask is normally used at a handful of (length, tile) sizes


_CACHE_LOCK = threading.Lock()  # masks are shared between threads that launch at once


def _remember(cache: dict, key, value, *, bounded: bool = True):
    """cache[key] = value, dropping the oldest entry past _MAX_CACHED_LISTS when bounded.

    Device lists are not bounded: dropping one could free memory a kernel queued on another
    stream is still reading, and they are a few bytes per tile.
    """
    with _CACHE_LOCK:
        if bounded and len(cache) >= _MAX_CACHED_LISTS:
            cache.pop(next(iter(cache)), None)
        return cache.setdefault(key, value)


def _upload(arrays, device_id: int):
    """CuPy copies of NumPy arrays on a device, complete when this returns.

    The copies live as long as the mask, so they come from CuPy's default pool rather than
    whatever allocator the current call installed (torch's, under cuflash.torch); the
    stream is synchronised once so that later launches on any stream see finished copies.
    """
    import cupy

    with cupy.cuda.Device(device_id):
        with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            copies = tuple(cupy.asarray(a) for a in arrays)
        cupy.cuda.get_current_stream().synchronize()
    return copies


# Every BlockMask gets a process-unique token; masks alive now, by token (see BlockMask.token).
_tokens = itertools.count(1)
_live_masks: "weakref.WeakValueDictionary[int, BlockMask]" = weakref.WeakValueDictionary()


# --------------------------------------------------------------------------
# PNG (greyscale, 8 bit) -- a minimal writer, no imaging library needed
# --------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _png_bytes(pixels: np.ndarray) -> bytes:
    """Encode a uint8 (height, width) greyscale image as PNG bytes."""
    height, width = pixels.shape
    if height == 0 or width == 0:
        raise ValueError(f"a PNG image needs at least one pixel, got {height} x {width}")
    # IHDR: width, height, bit depth 8, colour type 0 (greyscale), deflate,
    # adaptive filtering (method 0), no interlace.
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    # Every scanline starts with its filter type; 0 = None (raw bytes).
    raw = np.concatenate([np.zeros((height, 1), np.uint8), pixels.astype(np.uint8)], axis=1)
    return (
        PNG_SIGNATURE
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
        + _png_chunk(b"IEND", b"")
    )


# --------------------------------------------------------------------------
# BlockMask
# --------------------------------------------------------------------------

_PRESENT_PIXEL = 0  # black
_ABSENT_PIXEL = 255  # white
_SEPARATOR_PIXEL = 160  # grey line between the heads of a batched mask


class BlockMask:
    """Which (bq x bk) tiles of the attention matrix are computed.

    Build it with :meth:`from_dense` (or a pattern function) once and reuse
    it.  ``shape`` is ``(..., Tq, Tk)``: the leading dimensions broadcast
    against q's batch/head dimensions (after grouped-query expansion, so a
    per-head mask has Hq heads or 1), ``Tq = ceil(Nq / bq)`` query blocks and
    ``Tk = ceil(Nk / bk)`` key blocks.

    Stored lists (int32, read-only):

    * ``kv_num_blocks`` (..., Tq): number of present key blocks per query block.
    * ``kv_indices`` (..., Tq, max_kv): those key blocks in increasing order,
      padded with the last valid index (0 for an empty row).
    * ``q_num_blocks`` (..., Tk) and ``q_indices`` (..., Tk, max_q): the same
      per key block (the transposed lists, for the backward pass).

    ``max_kv`` and ``max_q`` are at least 1, so the index arrays are never
    empty.  ``a | b`` and ``a & b`` combine two masks with the same block size
    and block grid (leading dimensions broadcast).

    ``token`` is a process-unique int naming the mask; :meth:`from_token`
    gives the mask back while it is alive.  (cuflash.torch passes masks to its
    custom operators this way: operator arguments can only be tensors and numbers.)
    """

    __slots__ = (
        "_present", "_block_size", "kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices",
        "token", "_host_lists", "_device_lists", "_device_blocks", "__weakref__",
    )

    def __init__(self, kv_num_blocks, kv_indices, n_k_blocks: int, block_size: BlockSize = DEFAULT_BLOCK_SIZE):
        """Build from compact lists (FlexAttention style).

        kv_num_blocks (..., Tq) and kv_indices (..., Tq, W) are integer arrays:
        query block r has key blocks ``kv_indices[..., r, :kv_num_blocks[..., r]]``,
        which must be strictly increasing and in [0, n_k_blocks); entries past
        the count are ignored.  The stored lists are re-derived, so their padding
        is always canonical.  Most callers want :meth:`from_dense` instead.
        """
        n_k_blocks = _as_int(n_k_blocks, "n_k_blocks", 0)
        num = np.asarray(kv_num_blocks)
        idx = np.asarray(kv_indices)
        for name, arr in (("kv_num_blocks", num), ("kv_indices", idx)):
            if arr.dtype.kind not in "iu":
                raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
        if idx.ndim < 2 or idx.shape[:-1] != num.shape:
            raise ValueError(
                f"kv_indices must have shape kv_num_blocks.shape + (W,): "
                f"kv_num_blocks.shape={num.shape}, kv_indices.shape={idx.shape}"
            )
        width = idx.shape[-1]
        if num.size and (num.min() < 0 or num.max() > min(width, n_k_blocks)):
            raise ValueError(
                f"kv_num_blocks must lie in [0, min(W={width}, n_k_blocks={n_k_blocks})], "
                f"got values in [{num.min()}, {num.max()}]"
            )
        valid = np.arange(width) < num[..., None]
        if np.any(valid & ((idx < 0) | (idx >= n_k_blocks))):
            raise ValueError(f"kv_indices must lie in [0, n_k_blocks={n_k_blocks}) where valid")
        if width > 1 and np.any(valid[..., 1:] & (np.diff(idx.astype(np.int64), axis=-1) <= 0)):
            raise ValueError("kv_indices must be strictly increasing within each row's valid prefix")
        present = np.zeros(num.shape + (n_k_blocks,), dtype=bool)
        rows = np.nonzero(valid)
        present[rows[:-1] + (idx[rows],)] = True
        self._set(present, _block_pair(block_size))

    def _set(self, present: np.ndarray, block_size: Tuple[int, int]) -> None:
        self._present = _read_only(present)
        self._block_size = block_size
        kv_num, kv_idx = _compact_lists(self._present)
        q_num, q_idx = _compact_lists(np.swapaxes(self._present, -1, -2))
        self.kv_num_blocks = _read_only(kv_num)
        self.kv_indices = _read_only(kv_idx)
        self.q_num_blocks = _read_only(q_num)
        self.q_indices = _read_only(q_idx)
        self._host_lists: dict = {}
        self._device_lists: dict = {}
        self._device_blocks: dict = {}  # device id -> the block bytes, shared by all lists
        self.token = next(_tokens)
        _live_masks[self.token] = self

    @staticmethod
    def from_token(token: int) -> "BlockMask":
        """The live mask whose :attr:`token` this is; LookupError when it has been freed."""
        mask = _live_masks.get(int(token))
        if mask is None:
            raise LookupError(
                f"no BlockMask with token {token} is alive: it was garbage-collected; keep a "
                f"reference to the mask until every call that uses it (backward too) has run"
            )
        return mask

    @classmethod
    def from_dense(cls, blocks, block_size: BlockSize = DEFAULT_BLOCK_SIZE) -> "BlockMask":
        """BlockMask from a boolean array ``blocks`` (..., Tq, Tk), True = tile present.

        block_size: an int (square tiles) or a pair (bq, bk).  Integer arrays of
        0s and 1s are accepted too.
        """
        present = np.asarray(blocks)
        if present.dtype != np.bool_:
            if present.dtype.kind not in "iu" or (present.size and not np.isin(present, (0, 1)).all()):
                raise TypeError(
                    f"blocks must be a boolean array (True = tile present), got dtype {present.dtype}"
                )
            present = present.astype(bool)
        if present.ndim < 2:
            raise ValueError(f"blocks must have shape (..., Tq, Tk), got shape {present.shape}")
        mask = cls.__new__(cls)
        mask._set(present.copy(), _block_pair(block_size))
        return mask

    # ---- description -----------------------------------------------------------

    @property
    def shape(self) -> Tuple[int, ...]:
        """(..., Tq, Tk): leading (batch/head) dimensions and the block grid."""
        return self._present.shape

    @property
    def batch_shape(self) -> Tuple[int, ...]:
        """The leading dimensions, ``shape[:-2]``."""
        return self._present.shape[:-2]

    @property
    def block_size(self) -> Tuple[int, int]:
        """(bq, bk): query rows and key columns per tile."""
        return self._block_size

    @property
    def nnz(self) -> int:
        """Number of present blocks, summed over the leading dimensions."""
        return int(self.kv_num_blocks.sum(dtype=np.int64))

    @property
    def density(self) -> float:
        """Fraction of present blocks (0.0 for an empty grid)."""
        size = self._present.size
        return self.nnz / size if size else 0.0

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
            f"density={self.density:.4f} ({self.nnz} of {self._present.size} blocks))"
        )

    # ---- conversions -----------------------------------------------------------

    def to_dense(self) -> np.ndarray:
        """A fresh boolean array (..., Tq, Tk), True = tile present."""
        return self._present.copy()

    def check(self, nq: int, nk: int, batch_shape: Optional[Tuple[int, ...]] = None) -> None:
        """Raise ValueError unless this mask fits Nq = nq queries and Nk = nk keys.

        Needs ``Tq == ceil(nq / bq)`` and ``Tk == ceil(nk / bk)``; with
        ``batch_shape`` the leading dimensions must also broadcast to it
        (without enlarging it).  The message quotes every size involved.
        """
        nq = _as_int(nq, "nq", 0)
        nk = _as_int(nk, "nk", 0)
        (tq, tk), (bq, bk) = self.shape[-2:], self.block_size
        problems = []
        if tq != _ceil_div(nq, bq):
            problems.append(f"Nq={nq} needs ceil({nq}/{bq}) = {_ceil_div(nq, bq)} query blocks, the mask has Tq={tq}")
        if tk != _ceil_div(nk, bk):
            problems.append(f"Nk={nk} needs ceil({nk}/{bk}) = {_ceil_div(nk, bk)} key blocks, the mask has Tk={tk}")
        if problems:
            raise ValueError(
                f"block mask of shape {self.shape} with block_size {self.block_size} does not fit "
                f"Nq={nq}, Nk={nk}: " + "; ".join(problems)
            )
        if batch_shape is not None:
            batch_shape = tuple(batch_shape)
            try:
                fits = np.broadcast_shapes(self.batch_shape, batch_shape) == batch_shape
            except ValueError:
                fits = False
            if not fits:
                raise ValueError(
                    f"block mask leading dimensions {self.batch_shape} (shape {self.shape}) do not "
                    f"broadcast to the attention batch shape {batch_shape}"
                )

    def to_elements(self, nq: int, nk: int) -> np.ndarray:
        """Boolean element mask (..., nq, nk): True where the covering tile is present.

        Block (r, c) covers rows ``r*bq .. min((r+1)*bq, nq) - 1`` and columns
        ``c*bk .. min((c+1)*bk, nk) - 1``.  Raises ValueError (quoting the
        sizes) unless ``Tq == ceil(nq / bq)`` and ``Tk == ceil(nk / bk)``.
        """
        self.check(nq, nk)
        bq, bk = self.block_size
        rows = np.repeat(self._present, bq, axis=-2)[..., :nq, :]
        return np.repeat(rows, bk, axis=-1)[..., :nk]

    # ---- kernel tile lists -----------------------------------------------------

    def tile_lists(
        self, nq: int, nk: int, tile_rows: int, tile_cols: int, *, transpose: bool = False,
        causal: bool = False, window=None,
    ) -> TileLists:
        """This mask as a kernel launch with tiles of tile_rows queries x tile_cols keys reads it.

        Not transposed, the launch walks query tiles ("outer", tile_rows each) and visits key
        tiles ("inner"); transposed (the backward's key passes), the other way round.  An
        (outer, inner) tile pair is listed when the blocks it overlaps inside [0, nq) x [0, nk)
        include a present one, and flagged :data:`PARTIAL_TILE` when they also include an
        absent one.  With ``causal`` / ``window`` (as in :func:`sliding_window`), tiles that
        hold no key those masks allow are left out as well; the kernel still applies both
        masks element-wise inside the tiles it visits, and the flag ignores them.

        Works on the block grid with prefix sums, never on elements: O(mask_batch x outer x
        inner) time and memory.  The result is cached on the mask per argument set.
        Raises ValueError unless the mask fits nq and nk (see :meth:`check`).
        """
        key = self._lists_key(nq, nk, tile_rows, tile_cols, transpose, causal, window)
        cached = self._host_lists.get(key)
        if cached is None:
            cached = _remember(self._host_lists, key, self._build_tile_lists(*key))
        return cached

    def device_tile_lists(
        self, nq: int, nk: int, tile_rows: int, tile_cols: int, *, transpose: bool = False,
        causal: bool = False, window=None, device=None,
    ) -> TileLists:
        """:meth:`tile_lists` as CuPy arrays on ``device`` (a cupy Device or id; None =
        the current one), uploaded once and cached on the mask per device.  The host lists
        they are made from are not kept (unless :meth:`tile_lists` was asked for them)."""
        import cupy

        device_id = device.id if isinstance(device, cupy.cuda.Device) else cupy.cuda.Device(device).id
        key = self._lists_key(nq, nk, tile_rows, tile_cols, transpose, causal, window)
        cached = self._device_lists.get((device_id, key))
        if cached is None:
            host = self._host_lists.get(key) or self._build_tile_lists(*key)
            blocks = self._device_blocks.get(device_id)
            if blocks is None:
                (blocks,) = _upload((host.blocks,), device_id)
                blocks = _remember(self._device_blocks, device_id, blocks, bounded=False)
            counts, lists = _upload((host.counts, host.lists), device_id)
            cached = _remember(self._device_lists, (device_id, key), TileLists(counts, lists, blocks), bounded=False)
        return cached

    def _lists_key(self, nq, nk, tile_rows, tile_cols, transpose, causal, window):
        self.check(nq, nk)
        return (
            _as_int(nq, "nq", 0), _as_int(nk, "nk", 0),
            _as_int(tile_rows, "tile_rows", 1), _as_int(tile_cols, "tile_cols", 1),
            bool(transpose), bool(causal), window_option(window),
        )

    def _build_tile_lists(self, nq, nk, tile_rows, tile_cols, transpose, causal, window) -> TileLists:
        (bq, bk), grid = self.block_size, self.shape[-2:]
        present = self._present.reshape((math.prod(self.batch_shape),) + grid)  # (mask_batch, Tq, Tk)
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

    # ---- combination -----------------------------------------------------------

    def _combine(self, other, op, symbol: str) -> "BlockMask":
        if not isinstance(other, BlockMask):
            return NotImplemented
        if self.block_size != other.block_size:
            raise ValueError(
                f"cannot combine block masks with different block sizes: {self!r} {symbol} {other!r}"
            )
        if self.shape[-2:] != other.shape[-2:]:
            raise ValueError(
                f"cannot combine block masks with different block grids (Tq, Tk): "
                f"{self!r} {symbol} {other!r}"
            )
        try:
            np.broadcast_shapes(self.batch_shape, other.batch_shape)
        except ValueError:
            raise ValueError(
                f"cannot combine block masks whose leading dimensions do not broadcast: "
                f"{self!r} {symbol} {other!r}"
            ) from None
        result = BlockMask.__new__(BlockMask)
        result._set(op(self._present, other._present), self.block_size)
        return result

    def __or__(self, other) -> "BlockMask":
        """Union: a tile is present if it is present in either mask."""
        return self._combine(other, np.logical_or, "|")

    def __and__(self, other) -> "BlockMask":
        """Intersection: a tile is present if it is present in both masks."""
        return self._combine(other, np.logical_and, "&")

    # ---- pictures --------------------------------------------------------------

    def _slices(self):
        """(label, 2-D grid) for every index of the leading dimensions."""
        if not self.batch_shape:
            yield None, self._present
            return
        for index in np.ndindex(*self.batch_shape):
            yield "[" + ", ".join(map(str, index)) + "]", self._present[index]

    def to_text(self, max_blocks: int = 64, *, ascii: bool = False) -> str:
        """Draw the mask, one character per block: '█' present, '·' absent.

        ascii=True uses '#' and '.'.  A grid wider or taller than max_blocks is
        shrunk: each character then stands for a group of blocks and is drawn
        '▒' ('+') when only some of them are present; a first line says how
        many blocks a character covers.  Batched masks draw each leading index
        under a label line such as ``[0, 1]``.
        """
        max_blocks = _as_int(max_blocks, "max_blocks", 1)
        full, part, empty = ("#", "+", ".") if ascii else ("█", "▒", "·")
        tq, tk = self.shape[-2:]
        gq, gk = max(1, _ceil_div(tq, max_blocks)), max(1, _ceil_div(tk, max_blocks))
        lines = []
        if gq > 1 or gk > 1:
            lines.append(f"(each character: {gq} x {gk} blocks)")
        for label, grid in self._slices():
            if label is not None:
                lines.append(label)
            for r in range(0, tq, gq):
                row = []
                for c in range(0, tk, gk):
                    group = grid[r : r + gq, c : c + gk]
                    row.append(full if group.all() else part if group.any() else empty)
                lines.append("".join(row))
        return "\n".join(lines)

    def save_png(self, path, scale: int = 4):
        """Write the mask as a greyscale PNG: each block is scale x scale pixels.

        Present blocks are black, absent ones white.  The heads of a batched
        mask are stacked top to bottom, separated by a one-pixel grey line.
        Written with zlib and struct only.  Returns ``path``.
        """
        scale = _as_int(scale, "scale", 1)
        tq, tk = self.shape[-2:]
        if tq == 0 or tk == 0 or self._present.size == 0:
            raise ValueError(f"cannot draw an empty block mask of shape {self.shape}")
        images = []
        for _, grid in self._slices():
            image = np.where(grid, _PRESENT_PIXEL, _ABSENT_PIXEL).astype(np.uint8)
            images.append(np.repeat(np.repeat(image, scale, axis=0), scale, axis=1))
        separator = np.full((1, tk * scale), _SEPARATOR_PIXEL, dtype=np.uint8)
        parts = []
        for n, image in enumerate(images):
            if n:
                parts.append(separator)
            parts.append(image)
        with open(os.fspath(path), "wb") as f:
            f.write(_png_bytes(np.concatenate(parts, axis=0)))
        return path


def _from_rule(rule, tq: int, tk: int, block_size) -> BlockMask:
    """BlockMask of shape (tq, tk) where rule(i, j) (broadcast index grids) is True."""
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    return BlockMask.from_dense(np.broadcast_to(rule(i, j), (tq, tk)), block_size)


# --------------------------------------------------------------------------
# Patterns
# --------------------------------------------------------------------------


def butterfly(n_blocks: int, *, block_size: BlockSize = DEFAULT_BLOCK_SIZE) -> BlockMask:
    """Flat block butterfly: block (i, j) present iff i == j or i XOR j is a power of two.

    This is the fixed butterfly pattern of the FlashAttention paper's
    block-sparse experiments, after Pixelated Butterfly (Chen, Dao et al.,
    2021): the "flat" butterfly sums all log2(n) butterfly factor matrices of
    an n-point FFT-like transform, and factor k connects i to i XOR 2**k; with
    the identity added this is the rule above.  Each row has 1 + log2(n)
    blocks.  n_blocks must be a power of two (ValueError otherwise).

    >>> print(butterfly(8).to_text(ascii=True))
    ###.#...
    ##.#.#..
    #.##..#.
    .###...#
    #...###.
    .#..##.#
    ..#.#.##
    ...#.###
    """
    n = _as_int(n_blocks, "n_blocks", 1)
    if n & (n - 1):
        raise ValueError(f"butterfly needs n_blocks to be a power of two, got {n}")

    def rule(i, j):
        x = i ^ j
        return (x & (x - 1)) == 0  # 0 (the diagonal) or a single set bit

    return _from_rule(rule, n, n, block_size)


def fixed(n_blocks: int, block: int, c: int, *, block_size: BlockSize = DEFAULT_BLOCK_SIZE) -> BlockMask:
    """Sparse Transformer's "fixed" pattern at block granularity.

    From Child et al., "Generating Long Sequences with Sparse Transformers"
    (2019): the sequence is cut into segments of ``block`` blocks; query block
    i sees every block of its own segment (``i // block == j // block``) plus
    the ``c`` "summary" blocks at the end of every segment
    (``j % block >= block - c``, the paper's modular rule, so a short last
    segment has summaries only where a full one would).  As in the paper the
    rule has no direction; with ``causal=True`` the summaries of later
    segments drop out.  Needs ``block >= 1`` and ``0 <= c <= block``.

    >>> print(fixed(8, 4, 1).to_text(ascii=True))
    ####...#
    ####...#
    ####...#
    ####...#
    ...#####
    ...#####
    ...#####
    ...#####
    """
    n = _as_int(n_blocks, "n_blocks", 1)
    block = _as_int(block, "block", 1)
    c = _as_int(c, "c", 0)
    if c > block:
        raise ValueError(f"fixed needs 0 <= c <= block, got c={c}, block={block}")
    return _from_rule(lambda i, j: (i // block == j // block) | (j % block >= block - c), n, n, block_size)


def strided(n_blocks: int, stride: int, *, block_size: BlockSize = DEFAULT_BLOCK_SIZE) -> BlockMask:
    """Sparse Transformer's "strided" pattern at block granularity.

    From Child et al. (2019): query block i sees its own block and the
    ``stride`` blocks before it (``0 <= i - j <= stride``), plus every block
    a whole number of strides away (``(i - j) % stride == 0``).  These are the
    paper's two index sets verbatim; the paper uses them autoregressively, so
    the strided columns also reach later blocks unless ``causal=True``.
    Needs ``stride >= 1``.

    >>> print(strided(8, 3).to_text(ascii=True))
    #..#..#.
    ##..#..#
    ###..#..
    ####..#.
    .####..#
    ..####..
    #..####.
    .#..####
    """
    n = _as_int(n_blocks, "n_blocks", 1)
    stride = _as_int(stride, "stride", 1)
    return _from_rule(lambda i, j: ((i - j >= 0) & (i - j <= stride)) | ((i - j) % stride == 0), n, n, block_size)


def local(n_blocks: int, window_blocks: int, *, block_size: BlockSize = DEFAULT_BLOCK_SIZE) -> BlockMask:
    """Banded (local) attention: block (i, j) present iff ``|i - j| <= window_blocks``.

    The block version of the sliding window of Longformer (Beltagy et al.,
    2020) and the local heads of Image Transformer / Sparse Transformer.  For
    a token-exact window on ragged lengths use :func:`sliding_window` with
    :func:`window_block_mask`.  Needs ``window_blocks >= 0``.

    >>> print(local(8, 1).to_text(ascii=True))
    ##......
    ###.....
    .###....
    ..###...
    ...###..
    ....###.
    .....###
    ......##
    """
    n = _as_int(n_blocks, "n_blocks", 1)
    w = _as_int(window_blocks, "window_blocks", 0)
    return _from_rule(lambda i, j: np.abs(i - j) <= w, n, n, block_size)


def causal(n_blocks: int, *, block_size: BlockSize = DEFAULT_BLOCK_SIZE) -> BlockMask:
    """Block-lower-triangular mask: block (i, j) present iff j <= i.

    The tiles autoregressive attention visits when Nq == Nk (the usual
    triangle of FlashAttention's causal loop).  For Nq != Nk or ragged
    lengths, ``window_block_mask(nq, nk, -1, 0, block_size)`` gives exactly
    the tiles the bottom-right-aligned causal mask touches.  Like every
    pattern here it is a plain block mask; pass ``causal=True`` as well to
    mask the upper triangle inside the diagonal tiles.

    >>> print(causal(8).to_text(ascii=True))
    #.......
    ##......
    ###.....
    ####....
    #####...
    ######..
    #######.
    ########
    """
    n = _as_int(n_blocks, "n_blocks", 1)
    return _from_rule(lambda i, j: j <= i, n, n, block_size)


def global_tokens(
    n_blocks: int,
    n_global: int,
    *,
    n_k_blocks: Optional[int] = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """Global blocks in the style of BigBird (Zaheer et al., 2020) and Longformer.

    The first ``n_global`` query blocks see everything and the first
    ``n_global`` key blocks are seen by everyone: block (i, j) present iff
    ``i < n_global or j < n_global``.  On its own it is only the global part;
    combine it with others by ``|``, e.g. BigBird's
    ``global_tokens(n, g) | local(n, w) | random(n, p, seed)``.
    n_k_blocks (default n_blocks) allows a rectangular grid.

    >>> print(global_tokens(8, 1).to_text(ascii=True))
    ########
    #.......
    #.......
    #.......
    #.......
    #.......
    #.......
    #.......
    """
    tq, tk = _grid(n_blocks, n_k_blocks)
    g = _as_int(n_global, "n_global", 0)
    return _from_rule(lambda i, j: (i < g) | (j < g), tq, tk, block_size)


def random(
    n_blocks: int,
    density: float,
    seed: int = 0,
    *,
    n_k_blocks: Optional[int] = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """Random blocks, as in BigBird's random attention (Zaheer et al., 2020).

    Each block is present independently with probability ``density`` (drawn
    with ``numpy.random.default_rng(seed)``, so the same seed gives the same
    mask); the diagonal blocks ``(i, i)`` are always present, so the measured
    :attr:`BlockMask.density` is somewhat above ``density``.  n_k_blocks
    (default n_blocks) allows a rectangular grid.

    >>> print(random(8, 0.25, seed=1).to_text(ascii=True))
    #.#.....
    .#......
    #.#.....
    ...##..#
    ....#..#
    .....#..
    #...#.##
    .....#.#
    """
    tq, tk = _grid(n_blocks, n_k_blocks)
    density = float(density)
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must lie in [0, 1], got {density}")
    present = np.random.default_rng(seed).random((tq, tk)) < density
    diagonal = np.arange(min(tq, tk))
    present[diagonal, diagonal] = True
    return BlockMask.from_dense(present, block_size)


def dense(n_blocks: int, *, n_k_blocks: Optional[int] = None, block_size: BlockSize = DEFAULT_BLOCK_SIZE) -> BlockMask:
    """Every block present: plain (dense) attention, as a BlockMask.

    >>> print(dense(8).to_text(ascii=True))
    ########
    ########
    ########
    ########
    ########
    ########
    ########
    ########
    """
    tq, tk = _grid(n_blocks, n_k_blocks)
    return BlockMask.from_dense(np.ones((tq, tk), dtype=bool), block_size)


# --------------------------------------------------------------------------
# Token-exact sliding window
# --------------------------------------------------------------------------


def sliding_window(nq: int, nk: int, left: int, right: int) -> np.ndarray:
    """Element mask (nq, nk) of a sliding window, bottom-right aligned.

    With ``shift = nk - nq`` (the causal convention), key j is allowed for
    query i iff ``(i + shift) - left <= j <= (i + shift) + right``; ``-1`` on
    either side means unbounded there.  So ``(-1, 0)`` is the causal mask,
    ``(w, 0)`` causal with a look-back of w keys, ``(-1, -1)`` everything.
    """
    nq = _as_int(nq, "nq", 0)
    nk = _as_int(nk, "nk", 0)
    left = _check_window_side(left, "left")
    right = _check_window_side(right, "right")
    centre = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    allowed = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        allowed &= j >= centre - left
    if right >= 0:
        allowed &= j <= centre + right
    return allowed


def window_block_mask(
    nq: int, nk: int, left: int, right: int, block_size: BlockSize = DEFAULT_BLOCK_SIZE
) -> BlockMask:
    """BlockMask of every tile that holds at least one key of :func:`sliding_window`.

    Its grid is ``(ceil(nq / bq), ceil(nk / bk))``.  Tiles outside it hold only
    masked scores, so a kernel may skip them; combine with another mask by
    ``&`` to skip those tiles too.  Computed per tile from the band's ends, in
    O(Tq * Tk), without building the element mask.
    """
    nq = _as_int(nq, "nq", 0)
    nk = _as_int(nk, "nk", 0)
    left = _check_window_side(left, "left")
    right = _check_window_side(right, "right")
    bq, bk = _block_pair(block_size)
    tq, tk = _ceil_div(nq, bq), _ceil_div(nk, bk)
    shift = nk - nq
    # Query block r holds rows [r0, r1] and key block c columns [c0, c1].  As i
    # runs over [r0, r1] the windows [i + shift - left, i + shift + right] each
    # hold at least one index and move by one, so together they cover the
    # whole range [r0 + shift - left, r1 + shift + right] (ends unbounded for
    # -1).  The tile touches the band iff that range meets [c0, c1].
    r0 = np.arange(tq, dtype=np.int64)[:, None] * bq
    r1 = np.minimum(r0 + bq, nq) - 1
    c0 = np.arange(tk, dtype=np.int64)[None, :] * bk
    c1 = np.minimum(c0 + bk, nk) - 1
    present = np.ones((tq, tk), dtype=bool)
    if left >= 0:
        present &= c1 >= r0 + shift - left
    if right >= 0:
        present &= c0 <= r1 + shift + right
    return BlockMask.from_dense(present, (bq, bk))
