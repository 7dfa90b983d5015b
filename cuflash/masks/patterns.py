"""Common block-sparsity patterns, each a :class:`BlockMask` (combine them with ``|`` and ``&``)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._block_mask import BlockMask
from ._checks import DEFAULT_BLOCK_SIZE, BlockSize, _as_int, _grid

def _from_rule(rule, tq: int, tk: int, block_size) -> BlockMask:
    """BlockMask of shape (tq, tk) where rule(i, j) (broadcast index grids) is True."""
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    return BlockMask.from_dense(np.broadcast_to(rule(i, j), (tq, tk)), block_size)


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
