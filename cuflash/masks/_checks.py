"""Argument checks shared by the masks: integers, block sizes, block grids, windows."""

from __future__ import annotations

import operator
from typing import Optional, Tuple, Union

import numpy as np

DEFAULT_BLOCK_SIZE = 128

BlockSize = Union[int, Tuple[int, int]]


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
