"""Packed variable-length batches (varlen): attention over each sequence of a packed batch,
by the dense reference, one sequence at a time.

Shapes: q (Hq, total_q, d), k (Hk, total_k, d), v (Hk, total_k, dv); ``cu_seqlens_q`` and
``cu_seqlens_k`` of length batch + 1. Sequence b owns rows ``[cu_q[b], cu_q[b + 1])`` of q
(and of o, l, m) and ``[cu_k[b], cu_k[b + 1])`` of k and v, each boundary clamped into
``[0, total]`` and an end before its start meaning an empty sequence (the kernels' rule,
kernels/slice.cuh). Causal and the window are aligned at each sequence's bottom right, exactly
as the dense functions align them for that sequence's (Nq, Nk). Heads follow the dense rule
(grouped heads when Hk divides Hq).

Rows that no sequence covers are left as a row without keys (o = 0, l = 0, m = -inf;
gradients 0); cuflash leaves them unwritten, so compare covered rows only (``covered_rows``).
Where sequences overlap (only bad boundaries make them) the result on those rows is not
defined (here the last sequence's forward wins and gradients add up).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np

from .block_sparse import element_mask
from .dense import ReferenceOutput, standard_attention, standard_attention_backward


def sequence_rows(cu_seqlens, total: int) -> List[Tuple[int, int]]:
    """[(start, end)] of every sequence: boundaries clamped into [0, total], end >= start."""
    cu = [min(max(int(c), 0), total) for c in np.asarray(cu_seqlens).reshape(-1)]
    return [(s, max(s, e)) for s, e in zip(cu[:-1], cu[1:])]


def covered_rows(cu_seqlens, total: int) -> np.ndarray:
    """Boolean (total,): True for rows some sequence owns."""
    covered = np.zeros(total, dtype=bool)
    for s, e in sequence_rows(cu_seqlens, total):
        covered[s:e] = True
    return covered


def _window_mask(nq, nk, window):
    return None if window is None else element_mask(nq, nk, window=window)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False, scale: Optional[float] = None,
                     window=None, attention: Callable = standard_attention) -> ReferenceOutput:
    """(o (Hq, total_q, dv), l, m (Hq, total_q)) in float64.

    ``attention(q, k, v, causal=, scale=, mask=)`` computes each sequence (default the float64
    reference; pass e.g. ``functools.partial(lowp_attention, dtype="bfloat16")`` for plain
    attention in low precision). ``scale`` defaults to 1 / sqrt(d).
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    total_q, total_k = q.shape[-2], k.shape[-2]
    hq, dv = q.shape[0], v.shape[-1]
    o = np.zeros((hq, total_q, dv))
    l = np.zeros((hq, total_q))
    m = np.full((hq, total_q), -np.inf)
    rows_q, rows_k = sequence_rows(cu_seqlens_q, total_q), sequence_rows(cu_seqlens_k, total_k)
    if len(rows_q) != len(rows_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k differ in length: {len(rows_q) + 1} and {len(rows_k) + 1}")
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    for (qs, qe), (ks, ke) in zip(rows_q, rows_k):
        if qe == qs:
            continue
        out = attention(q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], causal=causal, scale=scale,
                        mask=_window_mask(qe - qs, ke - ks, window))
        o[:, qs:qe], l[:, qs:qe], m[:, qs:qe] = out.o, out.l, out.m
    return ReferenceOutput(o, l, m)


def varlen_attention_backward(do, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False,
                              scale: Optional[float] = None, window=None,
                              backward: Callable = standard_attention_backward):
    """(dq, dk, dv) with q's, k's and v's shapes, float64; ``backward(do, q, k, v, causal=,
    scale=, mask=)`` computes each sequence (default the float64 reference)."""
    do, q, k, v = (np.asarray(x) for x in (do, q, k, v))
    total_q, total_k = q.shape[-2], k.shape[-2]
    dq, dk, dv = (np.zeros(x.shape) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    for (qs, qe), (ks, ke) in zip(sequence_rows(cu_seqlens_q, total_q), sequence_rows(cu_seqlens_k, total_k)):
        if qe == qs or ke == ks:
            continue
        g = backward(do[:, qs:qe], q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], causal=causal, scale=scale,
                     mask=_window_mask(qe - qs, ke - ks, window))
        dq[:, qs:qe] += g[0]
        dk[:, ks:ke] += g[1]
        dv[:, ks:ke] += g[2]
    return dq, dk, dv
