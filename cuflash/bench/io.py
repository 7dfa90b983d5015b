"""The IO table: the FlashAttention paper's Fig. 2 for GPT-2 medium attention (seq 1024, head
dim 64, 16 heads, batch 64, forward + backward): GFLOPs, bytes read + written in device memory,
and runtime, standard attention against cuflash; then the paper's sweep of bytes moved and
runtime against the tile size. Bytes are counted by cuflash.bench.counts (no GPU needed;
its docstring is the counting model) and, with ``--io`` when ``ncu`` and a GPU are present,
measured by Nsight Compute (``dram__bytes_read.sum`` + ``dram__bytes_write.sum`` of every
kernel of one call); the table says which.

The counts (flops, Traffic, standard_traffic, flash_*_traffic, cuflash_tiles, ...) are
imported here too, so that cuflash.bench.io.<name> keeps naming them.
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
from typing import Optional

from . import common
from .backends import standard_convert, standard_parts
from .counts import (  # noqa: F401 - every count, also reached as cuflash.bench.io.<name>
    BWD_FLOP_FACTOR, MODE_FLOP_FACTOR, SPLIT_BACKWARD_ABOVE, STANDARD_MODE_FLOP_FACTOR, STAT_BYTES,
    STATS_ROW_MULTIPLE, Traffic, _ceil_div, algorithm1_traffic, compulsory_traffic, cuflash_tiles,
    flash_backward_traffic, flash_forward_traffic, flash_traffic, flops, standard_flops,
    standard_traffic, theorem2_tiles)

# The FlashAttention paper's Fig. 2: GPT-2 medium attention, forward + backward.
GPT2_MEDIUM = {"seq": 1024, "hdim": 64, "heads": 16, "batch": 64}
PAPER_FIG2 = ("FlashAttention paper, Fig. 2 (A100, fp16, its own counting): standard 66.6 "
              "GFLOPs, 40.3 GB HBM R/W, 41.7 ms; FlashAttention 75.2 GFLOPs, 4.4 GB, 7.3 ms")
# The tile-size sweep: forward tiles (Br, Bc, warps, min_blocks[, qk_unroll]) for head dim 64.
# In FlashAttention-2's loop order K and V are read once per query tile, so Br sets the traffic.
SWEEP_TILES = ((32, 64, 2, 1), (64, 64, 4, 1), (128, 64, 4, 1, 4), (256, 64, 8, 1, 4))
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
GB = 1e9


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
