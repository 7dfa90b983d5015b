"""The token-exact sliding window: its element mask and the tiles it touches."""

from __future__ import annotations

import numpy as np

from ._block_mask import BlockMask
from ._checks import DEFAULT_BLOCK_SIZE, BlockSize, _as_int, _block_pair, _ceil_div, _check_window_side

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
