"""FLOP and device-memory (HBM) byte counts of attention: the model behind the IO table
(cuflash.bench.io) and the speed tables' TFLOP/s, all arithmetic, no GPU needed.

Counting model
--------------
All counts are per (batch, head) pair and multiplied by ``heads * batch``. N is the sequence
length (queries = keys), d the head dim (d = dv), ``s`` the element size of q, k, v, o, dO and
the gradients, ``ss`` that of the N x N matrices of standard attention, and the softmax
statistics (l, m, lse, D) are 4-byte floats.

FLOPs: two per multiply-add in the matmuls; softmax, scaling and masking are not counted.
The forward does S = QK^T and O = PV: 4 N^2 d. The harness convention of the FlashAttention
papers (:func:`flops`) charges the backward 2.5x the forward (five matmuls: S recomputed, dV,
dP, dQ, dK) and halves every count when causal. Standard attention keeps P, so its backward is
four matmuls, 2x the forward (:func:`standard_flops`).

Standard attention (:func:`standard_traffic`) is the paper's Algorithm 0 (forward) and
Algorithm 3 (backward), every matrix passing through device memory:

    forward   read Q, K, write S;  read S, write P;  read P, V, write O
              -> read 3Nd s + 2N^2 ss, write Nd s + 2N^2 ss
    backward  read P, dO, write dV;  read dO, V, write dP;  read P, dP, write dS;
              read dS, K, write dQ;  read dS, Q, write dK
              -> read 5N^2 ss + 5Nd s, write 2N^2 ss + 3Nd s

so 11 N^2 ss + 12 Nd s for forward + backward: the N^2 terms dominate. Causal masking does not
change it (the masked scores are still written). This is the algorithm's traffic; the CuPy
implementation the speed table times makes a few more elementwise passes over the N^2 float32
scores (scale, max, exp, sum, divide), which ncu measures.

FlashAttention, as cuflash runs it (:func:`flash_forward_traffic`,
:func:`flash_backward_traffic`): bytes that the kernels request from device memory, tile by
tile, with no reuse across tiles (on-chip memory holds one tile set, as in the paper's
analysis; in reality L2 serves part of the re-reads, so DRAM traffic lies between this and
:func:`compulsory_traffic`, the bytes of every input read once and every output written once).

    forward (FlashAttention-2 loop order: one CTA per tile of Br queries walks all K, V tiles)
        read Q once (Nd s), K and V once per query tile: ceil(N/Br) passes of 2 N d s
        (causal: only the key tiles up to the diagonal), write O (Nd s) and l, m (2N x 4).
    backward (one CTA per tile of Bc keys walks the query tiles of Br rows)
        zero the float32 dQ accumulator (write 4Nd); preprocess: read dO, O (2Nd s), l, m
        (8N), write (m, log2 l) and D (12 N_pad, N rounded up to 128); key pass: read K, V
        once (2Nd s), and per key tile the Q, dO tiles (2 d s per query row), their (m, log2 l)
        and D (12 per row), the float32 dQ atomics (read + write, 4d each per row); write dK, dV
        (2Nd s); cast dQ: read 4Nd, write Nd s. Causal: a key tile visits only the query tiles
        at and below the diagonal. Head dims above 128 run the key pass twice (dV then dK).

With Br = Theta(M/d) for on-chip memory M, the K/V re-reads are Theta(N^2 d^2 / M): the
paper's Theorem 2. The paper states it for its Algorithm 1 (FlashAttention-1 loop order: the
outer loop over K/V tiles, so Q, O, l, m are read and O, l, m written once per K/V tile);
:func:`algorithm1_traffic` counts that order and :func:`theorem2_tiles` picks the paper's tile
sizes Bc = ceil(M / 4d), Br = min(Bc, d) from M.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .. import _constants, _tiles
from . import common

MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
BWD_FLOP_FACTOR = MODE_FLOP_FACTOR["bwd"]
STANDARD_MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.0, "fwdbwd": 3.0}
STAT_BYTES = 4  # l, m, lse, D: float32
STATS_ROW_MULTIPLE = _constants.STATS_ROW_MULTIPLE  # cuflash pads lse / D rows to this
SPLIT_BACKWARD_ABOVE = _tiles.SPLIT_BACKWARD_ABOVE  # head dims above this run the key pass twice


# ---- FLOPs -------------------------------------------------------------------------------


def _check_mode(mode: str, table: dict) -> float:
    if mode not in table:
        raise ValueError(f"mode must be one of {', '.join(map(repr, table))}, got {mode!r}")
    return table[mode]


def flops(seq: int, hdim: int, heads: int, batch: int, causal: bool, mode: str = "fwd") -> float:
    """FLOPs of attention in the papers' convention. Forward: two matmuls of 2 * seq^2 * hdim
    each per head and batch, halved when causal. "bwd": 2.5x the forward's; "fwdbwd": 3.5x."""
    factor = _check_mode(mode, MODE_FLOP_FACTOR)
    total = 4 * seq * seq * hdim * heads * batch
    total = total / 2 if causal else float(total)
    return factor * total


def standard_flops(seq: int, hdim: int, heads: int, batch: int, causal: bool = False,
                   mode: str = "fwdbwd") -> float:
    """FLOPs of standard attention, which keeps P: backward = four matmuls = 2x the forward
    (no recomputation); halved when causal by the same convention as :func:`flops`."""
    factor = _check_mode(mode, STANDARD_MODE_FLOP_FACTOR)
    return factor * flops(seq, hdim, heads, batch, causal, "fwd")


# ---- bytes -------------------------------------------------------------------------------


class Traffic(NamedTuple):
    """Bytes read and written in device memory."""

    read: int
    write: int

    @property
    def total(self) -> int:
        return self.read + self.write

    def __add__(self, other):  # noqa: D105 - elementwise, not tuple concatenation
        return Traffic(self.read + other.read, self.write + other.write)

    def scaled(self, factor: int) -> "Traffic":
        return Traffic(self.read * factor, self.write * factor)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _positive(**values) -> None:
    for name, value in values.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def standard_traffic(n: int, d: int, heads: int = 1, batch: int = 1, *, mode: str = "fwdbwd",
                     itemsize: int = 2, score_itemsize: Optional[int] = None) -> Traffic:
    """Device-memory bytes of standard attention: the paper's Algorithms 0 and 3 (module
    docstring). ``score_itemsize`` (default ``itemsize``) is the size of S, P, dP, dS."""
    _check_mode(mode, MODE_FLOP_FACTOR)
    _positive(n=n, d=d, heads=heads, batch=batch)
    s, ss = itemsize, score_itemsize or itemsize
    nd, nn = n * d, n * n
    fwd = Traffic(read=3 * nd * s + 2 * nn * ss, write=nd * s + 2 * nn * ss)
    bwd = Traffic(read=5 * nn * ss + 5 * nd * s, write=2 * nn * ss + 3 * nd * s)
    per_head = {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]
    return per_head.scaled(heads * batch)


def _forward_keys(n: int, br: int, bc: int, causal: bool) -> list:
    """Keys each query tile loads: all n, or (causal) the key tiles up to the diagonal."""
    keys = []
    for i in range(_ceil_div(n, br)):
        if not causal:
            keys.append(n)
            continue
        last_row = min((i + 1) * br, n) - 1
        keys.append(min(n, (last_row // bc + 1) * bc))
    return keys


def _backward_rows(n: int, br: int, bc: int, causal: bool) -> list:
    """Query rows each key tile visits: all n, or (causal) those from its diagonal down."""
    rows = []
    for j in range(_ceil_div(n, bc)):
        first_tile = (j * bc) // br if causal else 0
        rows.append(n - first_tile * br)
    return rows


def flash_forward_traffic(n: int, d: int, heads: int = 1, batch: int = 1, *, br: int, bc: int,
                          causal: bool = False, itemsize: int = 2) -> Traffic:
    """Bytes cuflash's forward requests (FlashAttention-2 order; module docstring): Q once,
    K and V once per query tile of br rows, O, l, m written once."""
    _positive(n=n, d=d, heads=heads, batch=batch, br=br, bc=bc)
    s = itemsize
    kv = sum(_forward_keys(n, br, bc, causal))  # key rows loaded, over all query tiles
    read = n * d * s + 2 * kv * d * s
    write = n * d * s + 2 * n * STAT_BYTES
    return Traffic(read, write).scaled(heads * batch)


def flash_backward_traffic(n: int, d: int, heads: int = 1, batch: int = 1, *, br: int, bc: int,
                           causal: bool = False, itemsize: int = 2,
                           key_passes: Optional[int] = None) -> Traffic:
    """Bytes cuflash's backward requests (atomic dQ; module docstring). br: query rows per
    tile, bc: keys per CTA. key_passes defaults to 2 above head dim 128, else 1."""
    _positive(n=n, d=d, heads=heads, batch=batch, br=br, bc=bc)
    s = itemsize
    passes = key_passes or (2 if d > SPLIT_BACKWARD_ABOVE else 1)
    n_pad = _ceil_div(n, STATS_ROW_MULTIPLE) * STATS_ROW_MULTIPLE
    rows = sum(_backward_rows(n, br, bc, causal))  # query rows visited, over all key tiles
    read = write = 0
    write += 4 * n * d  # zero the float32 dQ accumulator
    read += 2 * n * d * s + 2 * n * STAT_BYTES  # preprocess: dO, O, l, m
    write += 3 * n_pad * STAT_BYTES  # (m, log2 l), D
    for p in range(passes):
        read += 2 * n * d * s  # K and V, once per key tile
        read += rows * (2 * d * s + 3 * STAT_BYTES)  # Q, dO, (m, log2 l), D of the visited rows
        if p == 0:  # dQ atomics ride on the first (or only) pass
            read += rows * 4 * d
            write += rows * 4 * d
    write += 2 * n * d * s  # dK, dV (written final in the input dtype)
    read += 4 * n * d  # cast dQ
    write += n * d * s
    return Traffic(read, write).scaled(heads * batch)


def flash_traffic(n: int, d: int, heads: int = 1, batch: int = 1, *, mode: str = "fwdbwd",
                  fwd_tiles: tuple, bwd_tiles: tuple, causal: bool = False,
                  itemsize: int = 2) -> Traffic:
    """Forward, backward or both; tiles are (br, bc) pairs (:func:`cuflash_tiles`)."""
    _check_mode(mode, MODE_FLOP_FACTOR)
    total = Traffic(0, 0)
    if mode in ("fwd", "fwdbwd"):
        total = total + flash_forward_traffic(n, d, heads, batch, br=fwd_tiles[0],
                                              bc=fwd_tiles[1], causal=causal, itemsize=itemsize)
    if mode in ("bwd", "fwdbwd"):
        total = total + flash_backward_traffic(n, d, heads, batch, br=bwd_tiles[0],
                                               bc=bwd_tiles[1], causal=causal,
                                               itemsize=itemsize)
    return total


def compulsory_traffic(n: int, d: int, heads: int = 1, batch: int = 1, *, mode: str = "fwdbwd",
                       itemsize: int = 2) -> Traffic:
    """Lower bound: every input read once, every output written once. Forward: q, k, v in,
    o, l, m out. Backward: q, k, v, o, dO, l, m in, dq, dk, dv out. Both: the sum (o, l, m
    are written by the forward and read back by the backward)."""
    _check_mode(mode, MODE_FLOP_FACTOR)
    _positive(n=n, d=d, heads=heads, batch=batch)
    nds, stats = n * d * itemsize, 2 * n * STAT_BYTES
    fwd = Traffic(3 * nds, nds + stats)
    bwd = Traffic(5 * nds + stats, 3 * nds)
    per_head = {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]
    return per_head.scaled(heads * batch)


def algorithm1_traffic(n: int, d: int, heads: int = 1, batch: int = 1, *, br: int, bc: int,
                       itemsize: int = 2) -> Traffic:
    """The paper's Algorithm 1 forward (outer loop over K/V tiles of bc keys, inner over query
    tiles of br rows): K, V read once; Q, O, l, m read and O, l, m written once per K/V tile.
    (O and l, m are read on the first pass too, as the algorithm initialises them in HBM.)
    br only shapes the inner loop: the traffic depends on bc."""
    _positive(n=n, d=d, heads=heads, batch=batch, br=br, bc=bc)
    s = itemsize
    tc = _ceil_div(n, bc)
    read = 2 * n * d * s + tc * (2 * n * d * s + 2 * n * STAT_BYTES)
    write = tc * (n * d * s + 2 * n * STAT_BYTES)
    return Traffic(read, write).scaled(heads * batch)


def theorem2_tiles(d: int, sram_elements: int) -> tuple:
    """(Br, Bc) of the paper's Algorithm 1 line 1 for on-chip memory of M elements:
    Bc = ceil(M / 4d), Br = min(Bc, d). With them Algorithm 1 moves Theta(N^2 d^2 / M)."""
    _positive(d=d, sram_elements=sram_elements)
    bc = _ceil_div(sram_elements, 4 * d)
    return min(bc, d), bc


def cuflash_tiles(dtype: str = "bfloat16", d: int = 64, causal: bool = False,
                  wgmma: Optional[bool] = None) -> dict:
    """The tiles cuflash dispatches for this dtype and head dim (read from cuflash._config):
    {"fwd": (br, bc), "bwd": (query rows per tile, keys per CTA)}. wgmma: whether the forward
    and backward run on the Hopper kernels; None asks the GPU at hand (none: False)."""
    from cuflash import _config

    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"the byte model is that of the 16-bit tensor-core kernels, not {dtype}")
    wgmma = common.device_has_wgmma() if wgmma is None else wgmma
    fwd = _config.forward_config(dtype, d, d, causal, wgmma=wgmma)
    key_pass = _config.backward_plan(dtype, d, d, causal, False, wgmma=wgmma).key_passes[0]
    return {"fwd": (fwd.block_rows, fwd.block_cols),
            "bwd": (key_pass.block_rows, key_pass.block_cols)}
