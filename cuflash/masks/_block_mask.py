"""The BlockMask: which tiles of the attention matrix are computed, its checks and pictures."""

from __future__ import annotations

import itertools
import os
import weakref
from typing import Optional, Tuple

import numpy as np

from ._checks import DEFAULT_BLOCK_SIZE, BlockSize, _as_int, _block_pair, _ceil_div, window_option
from . import _device_cache  # used through the module: tests replace its upload
from ._png import _png_bytes
from .tile_lists import TileLists, _compact_lists, _read_only, build_tile_lists

# Every BlockMask gets a process-unique token; masks alive now, by token (see BlockMask.token).
_tokens = itertools.count(1)
_live_masks: "weakref.WeakValueDictionary[int, BlockMask]" = weakref.WeakValueDictionary()


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
            built = build_tile_lists(self._present, self.block_size, *key)
            cached = _device_cache._remember(self._host_lists, key, built)
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
            host = self._host_lists.get(key) or build_tile_lists(self._present, self.block_size, *key)
            blocks = self._device_blocks.get(device_id)
            if blocks is None:
                (blocks,) = _device_cache._upload((host.blocks,), device_id)
                blocks = _device_cache._remember(self._device_blocks, device_id, blocks, bounded=False)
            counts, lists = _device_cache._upload((host.counts, host.lists), device_id)
            cached = _device_cache._remember(self._device_lists, (device_id, key), TileLists(counts, lists, blocks),
                                             bounded=False)
        return cached

    def _lists_key(self, nq, nk, tile_rows, tile_cols, transpose, causal, window):
        self.check(nq, nk)
        return (
            _as_int(nq, "nq", 0), _as_int(nk, "nk", 0),
            _as_int(tile_rows, "tile_rows", 1), _as_int(tile_cols, "tile_cols", 1),
            bool(transpose), bool(causal), window_option(window),
        )

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
