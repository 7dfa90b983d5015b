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

Where things are: :mod:`._block_mask` (the BlockMask, its checks, text and PNG pictures),
:mod:`.patterns`, :mod:`.window` (the token-exact sliding window), :mod:`.tile_lists` (the
mask's per-row lists and the per-tile lists of a kernel launch), :mod:`._device_cache` (those
lists cached on the mask and uploaded to a GPU once), :mod:`._png` (the PNG writer) and
:mod:`._checks` (argument checks).
"""

from ._block_mask import BlockMask
from ._checks import DEFAULT_BLOCK_SIZE, BlockSize, window_option
from .patterns import butterfly, causal, dense, fixed, global_tokens, local, random, strided
from .tile_lists import PARTIAL_TILE, TileLists
from .window import sliding_window, window_block_mask

# Private names other cuflash modules and the tests use.
from ._checks import _block_pair, _window_pair  # cuflash._api, cuflash.reference
from ._device_cache import _MAX_CACHED_LISTS  # tests/test_masks.py

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

# doctest.testmod(cuflash.masks) reads only what this file defines and what __test__ lists: the
# patterns' docstrings draw each pattern, and those pictures are checked as examples.
__test__ = {fn.__name__: fn for fn in (butterfly, fixed, strided, local, causal, global_tokens, random, dense)}
