"""The problem: everything about a call but its data, frozen; what a plan is built from and
cached by.

A front end (the CuPy API, the torch and JAX adapters) turns its arrays into one: shapes,
element strides, the dtype's name, the device, the flags and options, and for a packed
variable-length batch its :class:`Varlen`. The plans (cuflash/_forward.py, _backward.py)
validate it and bind what follows from it; the pointers of a call are never part of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class Varlen:
    """A packed variable-length batch: q (Hq, total_q, d), k / v (Hk, total_k, d / dv) hold
    ``num_seqs`` sequences whose boundaries (cu_seqlens_q / _k) stay on the device; the longest
    lengths size the grids only."""

    num_seqs: int
    max_seqlen_q: int
    max_seqlen_k: int = 0  # the forward's grids do not depend on it


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call's signature.

    direction: 'forward' (operands q, k, v) or 'backward' (do, q, k, v, o; with ``stats``, the
    (shape, element strides, dtype name) of l and m, and ``deterministic``). ``shapes`` and
    ``strides`` (in elements) follow the operands' order; ``dtype`` is q's dtype's name; ``mask``
    a BlockMask or None; ``window`` (left, right) or None; ``scale`` None for 1 / sqrt(d).
    """

    direction: str
    shapes: tuple
    strides: tuple
    dtype: str
    device: int
    causal: bool = False
    scale: Optional[float] = None
    mask: Any = None
    window: Optional[tuple] = None
    varlen: Optional[Varlen] = None
    stats: tuple = ()
    deterministic: bool = False

    @property
    def names(self) -> tuple:
        """The operands' names, in the order of ``shapes``."""
        return ("q", "k", "v") if self.direction == "forward" else ("do", "q", "k", "v", "o")

    @property
    def operands(self) -> tuple:
        """((name, shape, element strides), ...): what errors quote."""
        return tuple(zip(self.names, self.shapes, self.strides))

    @property
    def qkv(self) -> tuple:
        """(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides)."""
        first = 0 if self.direction == "forward" else 1
        return tuple(x for i in range(first, first + 3) for x in (self.shapes[i], self.strides[i]))
