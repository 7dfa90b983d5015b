"""FLOP and device-memory (HBM) byte counts of attention, and the IO table.

The IO table is the FlashAttention paper's Fig. 2 for GPT-2 medium attention (seq 1024, head
dim 64, 16 heads, batch 64, forward + backward): GFLOPs, bytes read + written in device memory,
and runtime, standard attention against cuflash; then the paper's sweep of bytes moved and
runtime against the tile size. Bytes are counted here (no GPU needed) and, with ``--io`` when
``ncu`` and a GPU are present, measured by Nsight Compute (``dram__bytes_read.sum`` +
``dram__bytes_write.sum`` of every kernel of one call); the table says which.

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

import csv
import io as _stdio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple, Optional

from .. import _constants, _tiles
from . import common

MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
BWD_FLOP_FACTOR = MODE_FLOP_FACTOR["bwd"]
STANDARD_MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.0, "fwdbwd": 3.0}
STAT_BYTES = 4  # l, m, lse, D: float32
STATS_ROW_MULTIPLE = _constants.STATS_ROW_MULTIPLE  # cuflash pads lse / D rows to this
SPLIT_BACKWARD_ABOVE = _tiles.SPLIT_BACKWARD_ABOVE  # head dims above this run the key pass twice

# The FlashAttention paper's Fig. 2: GPT-2 medium attention, forward + backward.
GPT2_MEDIUM = {"seq": 1024, "hdim": 64, "heads": 16, "batch": 64}
PAPER_FIG2 = ("FlashAttention paper, Fig. 2 (A100, fp16, its own counting): standard 66.6 "
              "GFLOPs, 40.3 GB HBM R/W, 41.7 ms; FlashAttention 75.2 GFLOPs, 4.4 GB, 7.3 ms")
# The tile-size sweep: forward tiles (Br, Bc, warps, min_blocks[, qk_unroll]) for head dim 64.
# In FlashAttention-2's loop order K and V are read once per query tile, so Br sets the traffic.
SWEEP_TILES = ((32, 64, 2, 1), (64, 64, 4, 1), (128, 64, 4, 1, 4), (256, 64, 8, 1, 4))
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
GB = 1e9


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


# ---- ncu ---------------------------------------------------------------------------------

_UNITS = {"byte": 1, "bytes": 1, "b": 1, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6,
          "gbyte": 1e9, "gb": 1e9, "tbyte": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "": 1}


def _number(text: str) -> float:
    return float(str(text).replace(",", "").strip())


def _unit_factor(unit: str) -> float:
    key = str(unit).strip().lower()
    if key not in _UNITS:
        raise ValueError(f"unknown ncu unit {unit!r}")
    return _UNITS[key]


def parse_ncu_csv(text: str) -> dict:
    """Sum dram__bytes_read.sum and dram__bytes_write.sum over every kernel of ncu's CSV.

    Takes the "details" layout (one row per kernel and metric: "ID", ..., "Metric Name",
    "Metric Unit", "Metric Value") or the "raw" layout (one row per kernel, one column per
    metric, a row of units under the header). Lines before the header (==PROF== messages,
    the program's own output) are skipped. Returns {"read", "write", "kernels"} in bytes.
    Raises ValueError when no kernel row is found."""
    lines = text.splitlines()
    start = None
    for i, line in enumerate(lines):
        if line.startswith('"') and ("Metric Name" in line or NCU_METRICS[0] in line):
            start = i
            break
    if start is None:
        raise ValueError("no ncu CSV header in the output (no kernel profiled?)")
    rows = list(csv.reader(_stdio.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    totals = {name: 0.0 for name in NCU_METRICS}
    kernels = set()
    if "Metric Name" in header:
        col = {name: header.index(name) for name in ("Metric Name", "Metric Value")}
        unit_col = header.index("Metric Unit") if "Metric Unit" in header else None
        id_col = header.index("ID") if "ID" in header else None
        for k, row in enumerate(rows[1:]):
            if len(row) != len(header):
                continue
            name = row[col["Metric Name"]]
            if name not in totals:
                continue
            unit = row[unit_col] if unit_col is not None else "byte"
            totals[name] += _number(row[col["Metric Value"]]) * _unit_factor(unit)
            kernels.add(row[id_col] if id_col is not None else k)
    else:
        cols = {name: header.index(name) for name in NCU_METRICS if name in header}
        if len(cols) != len(NCU_METRICS):
            raise ValueError(f"ncu CSV lacks {', '.join(set(NCU_METRICS) - set(cols))}")
        body = [r for r in rows[1:] if len(r) == len(header)]
        units = {name: "byte" for name in NCU_METRICS}
        if body and not body[0][0].strip():  # a units row: its ID field is empty
            units = {name: body[0][c] for name, c in cols.items()}
            body = body[1:]
        for k, row in enumerate(body):
            for name, c in cols.items():
                totals[name] += _number(row[c]) * _unit_factor(units[name])
            kernels.add(k)
    if not kernels:
        raise ValueError("ncu CSV has no rows of dram__bytes_read.sum / dram__bytes_write.sum")
    return {"read": int(round(totals[NCU_METRICS[0]])), "write": int(round(totals[NCU_METRICS[1]])),
            "kernels": len(kernels)}


def ncu_available() -> Optional[str]:
    """Path of ncu, or None."""
    return shutil.which("ncu")


def ncu_command(ncu: str, log_file: str, spec: dict) -> list:
    """ncu around a child that runs one call of `spec` between cudaProfilerStart/Stop."""
    return [ncu, "--metrics", ",".join(NCU_METRICS), "--csv", "--print-units", "base",
            "--profile-from-start", "off", "--target-processes", "all", "--log-file", log_file,
            sys.executable, "-m", "cuflash.bench.io", "--probe", json.dumps(spec)]


def run_ncu(spec: dict, ncu: str, timeout: float = 600.0) -> dict:
    """Device-memory bytes of one call of `spec` measured by ncu; never raises."""
    with tempfile.TemporaryDirectory(prefix="cuflash-ncu-") as tmp:
        log_file = os.path.join(tmp, "ncu.csv")
        try:
            done = subprocess.run(ncu_command(ncu, log_file, spec), capture_output=True,
                                  text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            return {"status": "error", "error": f"ncu did not run: {common.first_line(exc)}"}
        text = open(log_file).read() if os.path.exists(log_file) else ""
        if done.returncode != 0:
            tail = (done.stderr.strip() or text.strip() or done.stdout.strip()).splitlines()
            why = tail[-1] if tail else f"exit status {done.returncode}"
            if "ERR_NVGPUCTRPERM" in (done.stderr + text + done.stdout):
                why = "ERR_NVGPUCTRPERM: no permission to read the GPU performance counters"
            return {"status": "error", "error": f"ncu failed: {why}"}
        try:
            result = parse_ncu_csv(text or done.stdout)
        except ValueError as exc:
            return {"status": "error", "error": f"ncu output not understood: {exc}"}
        return dict(result, status="ok", error=None)


# ---- the measured cases ------------------------------------------------------------------


def gpt2_shape() -> tuple:
    g = GPT2_MEDIUM
    return (g["batch"], g["heads"], g["seq"], g["hdim"])


def case_fn(env, method: str, mode: str, causal: bool, shape: tuple):
    """fn(*input_set) of one case: ("standard" | "cuflash") x ("fwd" | "fwdbwd").
    Input sets are (q, k, v) for fwd, (q, k, v, dO) for fwdbwd; the standard path takes them
    through :func:`case_inputs` first (CuPy arrays in the dtype cupy.matmul takes)."""
    seq, hdim = shape[-2], shape[-1]
    if method == "standard":
        from .speed import standard_parts

        forward, backward = standard_parts(env, causal, seq, seq, hdim)

        def run(q, k, v, do=None):
            o, p = forward(q, k, v)
            if mode == "fwd":
                return o
            return backward(q, k, v, do, o, p)

        return run
    if method != "cuflash":
        raise ValueError(f"method must be 'standard' or 'cuflash', got {method!r}")
    import cuflash

    def run(q, k, v, do=None):
        o, l, m = cuflash.attention(q, k, v, causal=causal)
        if mode == "fwd":
            return o
        return tuple(cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal))

    return run


def case_inputs(env, method: str, sets: list) -> list:
    """The input sets as the method takes them (converted outside any timing)."""
    if method != "standard":
        return sets
    from .speed import standard_convert

    convert = standard_convert(env)
    return [tuple(convert(x) for x in s) for s in sets]


def tiles_context(tiles: Optional[tuple], hdim: int):
    import contextlib

    if tiles is None:
        return contextlib.nullcontext()
    from cuflash import _config

    return _config.forward_tiles_override({_config.head_dim_bucket(hdim): tuple(tiles)})


def probe_main(spec: dict) -> int:
    """The ncu child: warm up, then one call of the case between cudaProfilerStart/Stop."""
    env = common.setup_env(spec["dtype"], use_torch=False)
    cupy = env.cupy
    shape = tuple(spec["shape"])
    tensors = 3 if spec["mode"] == "fwd" else 4
    (inputs,) = case_inputs(env, spec["method"], common.make_inputs(env, shape, 1, tensors))
    fn = case_fn(env, spec["method"], spec["mode"], bool(spec.get("causal")), shape)
    with tiles_context(spec.get("tiles"), shape[-1]):
        for _ in range(2):
            out = fn(*inputs)
        del out
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.profiler.start()
        out = fn(*inputs)
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.profiler.stop()
    del out
    return 0


# ---- the IO tables -----------------------------------------------------------------------


def analytical_case(method: str, mode: str, shape: tuple, dtype: str, causal: bool = False,
                    tiles: Optional[dict] = None) -> dict:
    batch, heads, n, d = shape
    s = common.ITEMSIZE[dtype]
    if method == "standard":
        traffic = standard_traffic(n, d, heads, batch, mode=mode, itemsize=s)
        gflop = standard_flops(n, d, heads, batch, causal, mode) / 1e9
    else:
        tiles = tiles or cuflash_tiles(dtype, d, causal)
        traffic = flash_traffic(n, d, heads, batch, mode=mode, fwd_tiles=tiles["fwd"],
                                bwd_tiles=tiles["bwd"], causal=causal, itemsize=s)
        gflop = flops(n, d, heads, batch, causal, mode) / 1e9
    return {"method": method, "mode": mode, "gflop": gflop,
            "analytical": {"read": traffic.read, "write": traffic.write},
            "compulsory": compulsory_traffic(n, d, heads, batch, mode=mode, itemsize=s)._asdict(),
            "tiles": tiles, "ncu": None, "ms": None, "status": "not run", "error": None}


def analytical_io(dtype: str = "bfloat16") -> dict:
    """The IO tables' records without a GPU: counts only."""
    shape = gpt2_shape()
    d = shape[-1]
    result = {"shape": dict(GPT2_MEDIUM), "dtype": dtype, "mode": "fwdbwd", "causal": False,
              "bytes_source": "analytical", "ncu_error": None,
              "methods": {m: analytical_case(m, "fwdbwd", shape, dtype)
                          for m in ("standard", "cuflash")},
              "sweep": []}
    s = common.ITEMSIZE[dtype]
    for tiles in SWEEP_TILES:
        br, bc = tiles[0], tiles[1]
        traffic = flash_forward_traffic(shape[2], d, shape[1], shape[0], br=br, bc=bc,
                                        itemsize=s)
        result["sweep"].append({
            "tiles": list(tiles), "br": br, "bc": bc, "warps": tiles[2],
            "kv_passes": _ceil_div(shape[2], br),
            "gflop": flops(shape[2], d, shape[1], shape[0], False, "fwd") / 1e9,
            "analytical": {"read": traffic.read, "write": traffic.write},
            "ncu": None, "ms": None, "status": "not run", "error": None})
    return result


def count_steps(args) -> int:
    steps = 2 + len(SWEEP_TILES)
    if getattr(args, "io", False) and ncu_available():
        steps *= 2
    return steps


def _time_case(env, fn, sets, args, context=None):
    """(ms, error) of fn over the input sets; never raises."""
    import statistics

    try:
        with context if context is not None else _null():
            times, out = common.time_call(env.cupy, fn, sets, args.warmup, args.repeats)
        del out
        return statistics.median(times), None
    except Exception as exc:
        status = "oom" if common.is_oom(env, exc) else "error"
        return None, (status, common.first_line(exc))


def _null():
    import contextlib

    return contextlib.nullcontext()


def run_io(env, args, progress=None) -> dict:
    """The IO tables on the GPU: runtimes, and with args.io ncu's bytes."""
    progress = common.as_progress(progress)
    result = analytical_io(env.dtype_name)
    shape = gpt2_shape()
    use_ncu = bool(getattr(args, "io", False))
    ncu = ncu_available() if use_ncu else None
    if use_ncu and ncu is None:
        result["ncu_error"] = "ncu not found on PATH"
    sets = common.make_inputs(env, shape, common.num_input_sets(
        4 * math.prod(shape) * common.ITEMSIZE[env.dtype_name], env.l2_bytes), 4)
    for method, entry in result["methods"].items():
        progress.start(f"io: {method} forward + backward, GPT-2 medium")
        fn = case_fn(env, method, "fwdbwd", False, shape)
        ms, err = _time_case(env, fn, case_inputs(env, method, sets), args)
        entry["ms"], entry["status"] = ms, "ok" if ms is not None else err[0]
        entry["error"] = None if err is None else err[1]
        if method == "cuflash" and err is not None:
            entry["cuflash_failed"] = True
        progress.advance()
        progress.note(f"io {method:>8}: " + (f"{ms:.3f} ms" if ms is not None else
                                               f"{err[0]}: {err[1]}"))
        env.free_memory()
    fwd_sets = [s[:3] for s in sets]
    for row in result["sweep"]:
        tiles = tuple(row["tiles"])
        progress.start(f"io: cuflash forward, tiles {tiles}")
        fn = case_fn(env, "cuflash", "fwd", False, shape)
        ms, err = _time_case(env, fn, fwd_sets, args, tiles_context(tiles, shape[-1]))
        row["ms"], row["status"] = ms, "ok" if ms is not None else err[0]
        row["error"] = None if err is None else err[1]
        progress.advance()
        progress.note(f"io tiles {tiles}: " + (f"{ms:.3f} ms" if ms is not None else
                                                 f"{err[0]}: {err[1]}"))
    del sets, fwd_sets
    env.free_memory()
    if ncu is not None:
        result["bytes_source"] = "ncu"
        cases = [(entry, {"method": m, "mode": "fwdbwd", "tiles": None})
                 for m, entry in result["methods"].items()]
        cases += [(row, {"method": "cuflash", "mode": "fwd", "tiles": row["tiles"]})
                  for row in result["sweep"]]
        for entry, spec in cases:
            spec.update(shape=list(shape), dtype=env.dtype_name, causal=False)
            progress.start(f"io: ncu {spec['method']} {spec['mode']} tiles {spec['tiles']}")
            entry["ncu"] = run_ncu(spec, ncu)
            progress.advance()
            got = entry["ncu"]
            progress.note(f"ncu {spec['method']} {spec['mode']} {spec['tiles'] or ''}: " + (
                f"read {got['read'] / GB:.2f} GB, write {got['write'] / GB:.2f} GB"
                if got["status"] == "ok" else got["error"]))
    return result


def _gb(nbytes) -> str:
    return common.DASH if nbytes is None else f"{nbytes / GB:.2f}"


def _ms_cell(entry: dict, notes: common.Footnotes, no_gpu_reason: Optional[str]) -> str:
    if entry.get("ms") is not None:
        return f"{entry['ms']:.2f}"
    if no_gpu_reason:
        return f"{common.DASH} {notes.mark(no_gpu_reason)}"
    if entry.get("status") == "oom":
        return "OOM"
    return f"{common.DASH} {notes.mark(str(entry.get('error') or entry.get('status')))}"


def _ncu_cell(entry: dict, notes: common.Footnotes, key: str) -> str:
    got = entry.get("ncu")
    if got is None:
        return common.DASH
    if got.get("status") != "ok":
        return f"{common.DASH} {notes.mark(str(got.get('error')))}"
    value = got["read"] + got["write"] if key == "total" else got[key]
    return _gb(value)


def format_io(result: dict, notes: common.Footnotes, tablefmt: str = "github",
              no_gpu_reason: Optional[str] = None) -> str:
    """Both IO tables from run_io's (or analytical_io's) result."""

    g = result["shape"]
    methods = result["methods"]
    names = ["standard", "cuflash"]
    measured = any(m.get("ncu") is not None for m in methods.values())
    if measured:
        source = ("bytes: measured by ncu (dram__bytes_read.sum + dram__bytes_write.sum over "
                  "every kernel of one call), with the analytical count alongside")
    else:
        source = "bytes: analytical count (tile model of cuflash.bench.io; no ncu measurement)"
        if result.get("ncu_error"):
            source += f" {notes.mark('--io: ' + result['ncu_error'])}"

    def row(label, fn):
        return [label] + [fn(methods[n]) for n in names]

    rows = [row("GFLOP", lambda e: f"{e['gflop']:.1f}")]
    if measured:
        rows.append(row("device memory read GB (ncu)", lambda e: _ncu_cell(e, notes, "read")))
        rows.append(row("device memory write GB (ncu)", lambda e: _ncu_cell(e, notes, "write")))
        rows.append(row("read + write GB (ncu)", lambda e: _ncu_cell(e, notes, "total")))
    rows.append(row("read GB (analytical)", lambda e: _gb(e["analytical"]["read"])))
    rows.append(row("write GB (analytical)", lambda e: _gb(e["analytical"]["write"])))
    rows.append(row("read + write GB (analytical)",
                    lambda e: _gb(e["analytical"]["read"] + e["analytical"]["write"])))
    rows.append(row("lower bound GB (each tensor once)",
                    lambda e: _gb(e["compulsory"]["read"] + e["compulsory"]["write"])))
    rows.append(row("runtime ms", lambda e: _ms_cell(e, notes, no_gpu_reason)))
    a_std = methods["standard"]["analytical"]
    a_fl = methods["cuflash"]["analytical"]
    ratio = (a_std["read"] + a_std["write"]) / max(1, a_fl["read"] + a_fl["write"])
    title = (f"IO: GPT-2 medium attention, forward + backward (seq {g['seq']}, head dim "
             f"{g['hdim']}, {g['heads']} heads, batch {g['batch']}, {result['dtype']}, "
             f"not causal); {source}")
    table = common.table(rows, ["", "standard", "cuflash"], tablefmt,
                     colalign=("left", "right", "right"))
    tiles = methods["cuflash"].get("tiles") or {}
    lines = [common.wrap(title), "", table, "", common.wrap(
             f"analytical: standard moves {ratio:.1f}x the bytes of cuflash. GFLOP: 2 per "
             "multiply-add in the matmuls; standard keeps P (backward = 2x forward), cuflash "
             "recomputes it (backward = 2.5x forward). Standard: the paper's Algorithms 0 and "
             "3, S, P, dP, dS each written and read in device memory (11 N^2 + 12 N d elements). "
             f"cuflash: bytes its kernels request tile by tile (forward tiles Br x Bc = "
             f"{' x '.join(map(str, tiles.get('fwd', ())))}, backward "
             f"{' x '.join(map(str, tiles.get('bwd', ())))}), L2 reuse not credited; the lower "
             "bound reads every input and writes every output once."),
             common.wrap(f"reference: {PAPER_FIG2}.")]
    lines.append("")
    lines.append(format_sweep(result, notes, tablefmt, no_gpu_reason))
    lines += notes.lines()
    return "\n".join(lines)


def format_sweep(result: dict, notes: common.Footnotes, tablefmt: str = "github",
                 no_gpu_reason: Optional[str] = None) -> str:

    g = result["shape"]
    measured = any(r.get("ncu") is not None for r in result["sweep"])
    headers = ["Br x Bc (warps)", "K/V passes", "read + write GB (analytical)"]
    if measured:
        headers.append("read + write GB (ncu)")
    headers += ["forward ms", "TFLOP/s"]
    rows = []
    for r in result["sweep"]:
        row = [f"{r['br']} x {r['bc']} ({r['warps']})", str(r["kv_passes"]),
               _gb(r["analytical"]["read"] + r["analytical"]["write"])]
        if measured:
            row.append(_ncu_cell(r, notes, "total"))
        row.append(_ms_cell(r, notes, no_gpu_reason))
        row.append(f"{r['gflop'] / r['ms']:.1f}" if r.get("ms") else common.DASH)
        rows.append(row)
    title = (f"IO: bytes moved and runtime against the tile size, cuflash forward (seq "
             f"{g['seq']}, head dim {g['hdim']}, {g['heads']} heads, batch {g['batch']}, "
             f"{result['dtype']})")
    table = common.table(rows, headers, tablefmt,
                         colalign=("left",) + ("right",) * (len(headers) - 1))
    note = ("FlashAttention-2 loop order: each CTA keeps a tile of Br queries and walks all of "
            "K and V, so K and V are read ceil(N / Br) times and the bytes fall as Br grows; "
            "Theorem 2 of the paper: Theta(N^2 d^2 / M) with tiles sized to the on-chip memory "
            "M. Runtime also depends on occupancy and registers, so it need not follow.")
    return "\n".join([common.wrap(title), "", table, "", common.wrap(note)])


def main(argv=None) -> int:
    """``python -m cuflash.bench.io --probe SPEC``: the child ncu profiles."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cuflash.bench.io",
                                     description="one profiled call for the IO table (ncu's child)")
    parser.add_argument("--probe", required=True, help="JSON: method, mode, shape, dtype, tiles")
    args = parser.parse_args(argv)
    return probe_main(json.loads(args.probe))


if __name__ == "__main__":
    sys.exit(main())
