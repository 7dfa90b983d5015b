"""The speed table: cuflash against standard attention and PyTorch SDPA, forward, backward and
forward + backward.

The harness of the FlashAttention papers: 16k tokens per batch (batch = 16384 // seqlen), hidden
size 2048 (heads = 2048 // head_dim), layout (batch, heads, seqlen, head_dim), random normal
inputs; FLOPs as in :func:`cuflash.bench.counts.flops` (forward 4 * seqlen^2 * head_dim * heads *
batch, halved when causal; backward 2.5x, forward + backward 3.5x).

Modes:

- ``fwd``: the forward alone. cuflash.attention; SDPA; standard (CuPy: S = q k^T, float32
  softmax, P cast back, P v).
- ``bwd``: the backward alone, from the same q, k, v and a fixed random dO: the forward whose
  results it needs runs once per input set before the timing. cuflash.attention_backward(do, q,
  k, v, o, l, m); SDPA torch.autograd.grad(out, (q, k, v), dO, retain_graph=True) on a graph
  recorded once; standard: an explicit CuPy backward from the P its forward kept.
- ``fwdbwd``: forward and backward in one timed call: cuflash.attention then
  cuflash.attention_backward; SDPA out = sdpa(q, k, v) then torch.autograd.grad(out, (q, k, v),
  dO) (the graph is recorded inside the timing, as in training); standard forward then backward.

Peers: ``standard``, ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient`` (SDPA pinned to one
backend with torch.nn.attention.sdpa_kernel). A peer that fails or is missing becomes a dash
with its reason in a footnote; a cuflash failure is shown as FAILED with its reason and makes
the command exit non-zero.

Every call is timed on the GPU with its own pair of CUDA events, on PyTorch's current stream
when PyTorch is present (so that cuflash, which launches on CuPy's current stream, and SDPA are
ordered the same way), after warm-up calls that absorb every compilation; consecutive calls
rotate among input sets whose total size exceeds twice the L2 cache (cuflash.bench.common).

Importing this module needs neither a GPU nor CuPy's CUDA libraries.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from typing import Callable, Optional

from . import common
from .backends import (  # noqa: F401 - every backend, also reached as cuflash.bench.speed.<name>
    SDPA_BACKENDS, Backend, cuflash_backend, cuflash_backward_backend, cuflash_fwdbwd_backend,
    peer_backend, sdpa_backend, sdpa_backward_backend, sdpa_fwdbwd_backend, standard_backend,
    standard_backward_backend, standard_convert, standard_fwdbwd_backend, standard_parts,
    tile_label)
from .common import DASH, HIDDEN, TOKENS, Env, Footnotes, as_cupy, problem_shape, time_call
from .counts import BWD_FLOP_FACTOR, MODE_FLOP_FACTOR, flops

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HDIMS = (64, 128)
MODES = ("fwd", "bwd", "fwdbwd")
MODE_NAMES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}
PEERS = ("standard", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
SDPA_PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
CHECK_WARN = 0.05  # max |o - o_peer| above which the progress line flags the check

__all__ = ["flops", "problem_shape", "time_call", "Footnotes", "BWD_FLOP_FACTOR"]


# ---- pure helpers (no GPU) ---------------------------------------------------------------


def parse_tiles(text: str) -> tuple:
    """'BR,BC,W,MB[,U]' -> a tile-table entry of cuflash._tiles (block_rows, block_cols,
    warps, min_blocks[, qk_unroll]), checked against the kernel's rules."""
    try:
        tiles = tuple(int(p) for p in text.replace(" ", "").split(","))
    except ValueError:
        tiles = ()
    if len(tiles) not in (4, 5):
        raise argparse.ArgumentTypeError(
            f"tiles must be 4 or 5 integers 'BR,BC,W,MB[,U]', got {text!r}")
    br, bc, warps, mb = tiles[:4]
    if warps < 1 or br % (16 * warps):
        raise argparse.ArgumentTypeError(
            f"block_rows must be a multiple of 16 * warps, got {br} rows, {warps} warps")
    if bc <= 0 or bc % 16:
        raise argparse.ArgumentTypeError(
            f"block_cols must be a positive multiple of 16, got {bc} in {text!r}")
    if mb < 1:
        raise argparse.ArgumentTypeError(f"min_blocks must be at least 1, got {mb} in {text!r}")
    return tiles


def causal_modes(choice: str) -> list:
    return {"no": [False], "yes": [True], "both": [False, True]}[choice]


def speed_peers(args) -> list:
    """The peers of args.peers that the speed table runs, in PEERS order."""
    return [p for p in PEERS if p in args.peers]


def backend_names(args, mode: str) -> list:
    """Columns of one mode: the tile-override columns tune forward tiles, so fwd only."""
    tiles = [tile_label(t) for t in getattr(args, "tiles", [])] if mode == "fwd" else []
    return ["cuflash"] + tiles + speed_peers(args)


def arg_dtypes(args) -> list:
    return list(getattr(args, "dtypes", None) or [getattr(args, "dtype", "bfloat16")])


def count_steps(args) -> int:
    """Measurements the speed sweep makes (one per backend and configuration)."""
    per_shape = sum(len(backend_names(args, mode)) for mode in args.modes)
    return (len(arg_dtypes(args)) * len(args.hdims) * len(args.seqlens)
            * len(args.causal_modes) * per_shape)


# ---- measurements ------------------------------------------------------------------------


@dataclasses.dataclass
class Measurement:
    times_ms: list = dataclasses.field(default_factory=list)
    status: str = "ok"  # ok | oom | error | unavailable
    error: Optional[str] = None
    dtype: Optional[str] = None

    @property
    def ms(self) -> Optional[float]:
        return statistics.median(self.times_ms) if self.times_ms else None


def run_backend(env: Env, backend: Backend, input_sets: list, warmup: int,
                repeats: Optional[int]):
    """Time one backend on the input sets; returns (Measurement, first output)."""
    sets = input_sets[:backend.max_sets] if backend.max_sets else input_sets
    if backend.convert is not None:
        sets = [tuple(backend.convert(x) for x in s) for s in sets]
    dtype = str(getattr(sets[0][0], "dtype", "")).replace("torch.", "")
    with backend.context():
        if backend.prepare is not None:
            sets = [backend.prepare(*s) for s in sets]
            env.cupy.cuda.get_current_stream().synchronize()
        times, first = time_call(env.cupy, backend.fn, sets, warmup, repeats)
    return Measurement(times, dtype=dtype), first


def _failed(env: Env, exc: BaseException) -> Measurement:
    return Measurement(status="oom" if common.is_oom(env, exc) else "error",
                       error=common.first_line(exc))


def run_peer(env: Env, name: str, causal: bool, shape: tuple, input_sets, warmup, repeats,
             mode: str = "fwd"):
    """A peer never stops the benchmark: its failure becomes an OOM or error Measurement."""
    if name in SDPA_PEERS and env.torch is None:
        return Measurement(status="unavailable", error=env.torch_reason), None
    try:
        backend = peer_backend(env, name, causal, shape, mode)
        return run_backend(env, backend, input_sets, warmup, repeats)
    except Exception as exc:
        failed = _failed(env, exc)
    env.free_memory()  # after the except block, whose traceback held the failed call's arrays
    return failed, None


def run_cuflash(env: Env, make_backend: Callable, input_sets, warmup, repeats):
    """cuflash's measurement. A failure is recorded (status error / oom, shown as FAILED in
    the table, exit status 1 at the end), never dropped."""
    try:
        return run_backend(env, make_backend(), input_sets, warmup, repeats)
    except Exception as exc:
        failed = _failed(env, exc)
    env.free_memory()
    return failed, None


def max_abs_diff(env: Env, a, b) -> Optional[float]:
    try:
        cupy = env.cupy
        x = as_cupy(env, a).astype(cupy.float32)
        y = as_cupy(env, b).astype(cupy.float32)
        return float(cupy.abs(x - y).max())
    except Exception as exc:
        common.log(f"  check failed: {common.first_line(exc)}")
        return None


def max_rel_diff(env: Env, reference: tuple, other: tuple) -> Optional[float]:
    """max over the gradients (dq, dk, dv) of max|other - reference| / max|reference|."""
    try:
        cupy = env.cupy
        worst = 0.0
        for a, b in zip(reference, other):
            x = as_cupy(env, a).astype(cupy.float32)
            y = as_cupy(env, b).astype(cupy.float32)
            worst = max(worst, float(cupy.abs(x - y).max()) / max(float(cupy.abs(x).max()), 1e-30))
        return worst
    except Exception as exc:
        common.log(f"  check failed: {common.first_line(exc)}")
        return None


def _cuflash_factory(name: str, mode: str, causal: bool, hdim: int, tiles: Optional[tuple]):
    if mode == "fwd":
        return lambda: cuflash_backend(causal, hdim, tiles)
    if mode == "bwd":
        return lambda: cuflash_backward_backend(causal)
    return lambda: cuflash_fwdbwd_backend(causal)


def config_label(mode: str, dtype: str, hdim: int, seq: int, causal: bool) -> str:
    return f"speed {mode} {dtype} hdim {hdim} seq {seq} causal {'yes' if causal else 'no'}"


def run_config(env: Env, args, hdim: int, seq: int, causal: bool, input_sets, progress,
               mode: str = "fwd") -> dict:
    """Every backend on one (mode, hdim, seq, causal); returns the JSON record.

    input_sets: (q, k, v) tuples for fwd, (q, k, v, dO) for bwd and fwdbwd. progress: a
    common.Progress, or a string that prefixes plain log lines."""
    progress = common.as_progress(progress)
    shape = problem_shape(seq, hdim)
    batch, heads = shape[0], shape[1]
    record = {"mode": mode, "seqlen": seq, "hdim": hdim, "causal": causal, "batch": batch,
              "heads": heads, "dtype": env.dtype_name,
              "flops": flops(seq, hdim, heads, batch, causal, mode), "backends": {}}
    check_key = "max_abs_diff_vs_cuflash" if mode == "fwd" else "max_rel_grad_diff_vs_cuflash"
    record[check_key] = {}
    reference = None
    tiles_by_name = {tile_label(t): t for t in getattr(args, "tiles", [])}
    label = config_label(mode, env.dtype_name, hdim, seq, causal)
    for name in backend_names(args, mode):
        progress.start(f"{label}: {name}")
        if name == "cuflash" or name in tiles_by_name:
            factory = _cuflash_factory(name, mode, causal, hdim, tiles_by_name.get(name))
            result, out = run_cuflash(env, factory, input_sets, args.warmup, args.repeats)
        else:
            result, out = run_peer(env, name, causal, shape, input_sets, args.warmup,
                                   args.repeats, mode)
        entry = {"status": result.status, "error": result.error, "dtype": result.dtype,
                 "ms": result.ms, "times_ms": result.times_ms,
                 "tflops": record["flops"] / (result.ms * 1e-3) / 1e12 if result.ms else None}
        record["backends"][name] = entry
        note = ""
        if reference is None:
            reference = out
        elif out is not None:
            if mode == "fwd":
                diff = max_abs_diff(env, reference, out)
                what = "max|o - o_cuflash|"
            else:
                diff = max_rel_diff(env, reference, out)
                what = "max|d - d_cuflash| / max|d_cuflash| over dq, dk, dv"
            record[check_key][name] = diff
            if diff is not None:
                note = f", {what} = {diff:.2e}" + (" (LARGE)" if diff > CHECK_WARN else "")
        del out
        progress.advance()
        if result.ms is not None:
            progress.note(f"{label} {name:>16}: {result.ms:8.3f} ms "
                          f"{entry['tflops']:7.1f} TFLOP/s{note}")
        else:
            progress.note(f"{label} {name:>16}: {result.status}: {result.error}")
        env.free_memory()
    del reference
    return record


def run_all(env: Env, args, progress=None) -> list:
    """The sweep of one dtype (env's): every mode, head dim, length and causal setting."""
    records = []
    needs_do = any(m in ("bwd", "fwdbwd") for m in args.modes)
    for hdim in args.hdims:
        for seq in args.seqlens:
            shape = problem_shape(seq, hdim)
            set_bytes = 3 * math.prod(shape) * common.ITEMSIZE.get(env.dtype_name, 2)
            count = common.num_input_sets(set_bytes, env.l2_bytes)
            # a fixed dO per input set, the same for every backend
            input_sets = common.make_inputs(env, shape, count, 4 if needs_do else 3)
            for mode in args.modes:
                sets = [s[:3] for s in input_sets] if mode == "fwd" else input_sets
                for causal in args.causal_modes:
                    records.append(run_config(env, args, hdim, seq, causal, sets,
                                              progress if progress is not None else
                                              config_label(mode, env.dtype_name, hdim, seq,
                                                           causal), mode))
                del sets
            del input_sets
            env.free_memory()
    return records


def cuflash_failures(records: list) -> list:
    """(label, error) of every cuflash measurement that did not succeed."""
    failed = []
    for r in records:
        for name, entry in r.get("backends", {}).items():
            if name.startswith("cuflash") and entry.get("status") not in ("ok", None):
                failed.append((config_label(r.get("mode", "fwd"), r.get("dtype", "?"), r["hdim"],
                                            r["seqlen"], r["causal"]) + f": {name}",
                               entry.get("error") or entry.get("status")))
    return failed


# ---- report ------------------------------------------------------------------------------


def header_lines(info: dict, args) -> list:
    torch = info["torch"] or f"{DASH} ({info['torch_reason']})"
    repeats = (f"median of {args.repeats} calls" if args.repeats else
               f"median of {common.AUTO_MIN_REPEATS}-{common.AUTO_MAX_REPEATS} calls "
               f"(about {common.AUTO_TARGET_MS:.0f} ms of work; {common.SLOW_REPEATS} for calls over "
               f"{common.SLOW_CALL_MS:.0f} ms)")
    return [
        f"GPU: {info['gpu']} ({info['sms']} SMs, L2 {info['l2_mb']:.0f} MB), CUDA runtime "
        f"{info['cuda_runtime']}, driver {info['cuda_driver']}",
        f"cuflash commit {info['commit']}, cupy {info['cupy']}, torch {torch}",
        f"{' and '.join(MODE_NAMES[m] for m in getattr(args, 'modes', ['fwd']))}, "
        f"{', '.join(arg_dtypes(args))}, {TOKENS} tokens per batch, hidden {HIDDEN}, layout "
        f"(batch, heads, seq, hdim), inputs from {info['inputs']}; {repeats} after "
        f"{args.warmup} warm-up",
    ]


def time_cells(entry: Optional[dict], notes: Footnotes, name: str) -> list:
    """[ms, TFLOP/s] cells of one backend."""
    if entry is None:
        return [DASH, DASH]
    if name.startswith("cuflash") and entry["ms"] is None:
        what = "OOM" if entry["status"] == "oom" else "FAILED"
        return [f"{what} {notes.mark(name + ': ' + str(entry['error']))}", DASH]
    if entry["status"] == "oom":
        return ["OOM", "OOM"]
    if entry["status"] == "unavailable":
        return [f"{DASH} {notes.mark('PyTorch SDPA columns: ' + str(entry['error']))}", DASH]
    if entry["ms"] is None:
        return [f"{DASH} {notes.mark(name + ': ' + str(entry['error']))}", DASH]
    return [f"{entry['ms']:.3f}", f"{entry['tflops']:.1f}"]


def ratio_cell(entries: dict, peer: str, notes: Optional[Footnotes] = None) -> str:
    """peer time / cuflash time; with notes, a failed peer shows as its time cell would."""
    mine, theirs = entries.get("cuflash"), entries.get(peer)
    if notes is not None and theirs and theirs["ms"] is None:
        return time_cells(theirs, notes, peer)[0]
    if not mine or not theirs or mine["ms"] is None or theirs["ms"] is None:
        return DASH
    return f"{theirs['ms'] / mine['ms']:.2f}x"


def _standard_reason(env, dtype: str) -> Optional[str]:
    if isinstance(env, dict):
        env = env.get(dtype)
    return getattr(env, "standard_reason", None)


def format_tables(records: list, args, ceilings: dict, env, notes: Footnotes) -> str:
    """The speed tables, one per (dtype, mode, causal, head dim). env: an Env, a dict of them
    by dtype name, or anything with a ``standard_reason`` attribute (or None)."""

    modes = getattr(args, "modes", ["fwd"])
    dtypes = arg_dtypes(args)
    peers = speed_peers(args)
    all_names = ["cuflash"] + [tile_label(t) for t in getattr(args, "tiles", [])] + peers
    blocks = []
    for dtype in dtypes:
        labels = dict(zip(all_names, all_names))
        reason = _standard_reason(env, dtype)
        if "standard" in all_names and reason:
            labels["standard"] = "standard (fp16)"
            notes.mark(f"standard runs in float16: {reason}")
        wide = getattr(args, "wide", False)
        for mode in modes:
            names = backend_names(args, mode)
            shown = names if wide else [n for n in names if n not in peers]  # time columns
            headers = ["seqlen", "batch x heads"]
            for name in shown:
                headers += [f"{labels[name]} ms", f"{labels[name]} TFLOP/s" if wide or name != "cuflash"
                            else "TFLOP/s"]
            headers.append("cuflash % of matmul peak" if wide else "% of peak")
            headers += [f"cuflash / {p}" if wide else f"vs {common.SHORT_NAMES.get(p, p)}" for p in peers]
            for causal in args.causal_modes:
                for hdim in args.hdims:
                    rows = []
                    for r in records:
                        if (r.get("mode", "fwd") != mode or r["causal"] != causal
                                or r["hdim"] != hdim or r.get("dtype", dtypes[0]) != dtype):
                            continue
                        row = [r["seqlen"], f"{r['batch']} x {r['heads']}"]
                        for name in shown:
                            row += time_cells(r["backends"].get(name), notes, name)
                        tf = (r["backends"].get("cuflash") or {}).get("tflops")
                        peak = ceilings.get("matmul_tflops") if ceilings else None
                        row.append(f"{100 * tf / peak:.1f}%" if tf and peak else DASH)
                        row += [ratio_cell(r["backends"], p, None if wide else notes) for p in peers]
                        rows.append(row)
                    if not rows:
                        continue
                    title = (f"{MODE_NAMES[mode]}, causal={'yes' if causal else 'no'}, "
                             f"head dim {hdim}, {dtype}")
                    table = common.table(rows, headers, tablefmt=getattr(args, "tablefmt", "github"),
                                     colalign=("right",) * len(headers))
                    blocks.append(title + "\n\n" + table)
    text = ("ms: median time of one call; TFLOP/s: forward 4 * seqlen^2 * hdim * heads * "
             "batch (halved when causal) / time")
    if "bwd" in modes:
        text += f", backward {BWD_FLOP_FACTOR:g} x that / time"
    if "fwdbwd" in modes:
        text += f", forward + backward {MODE_FLOP_FACTOR['fwdbwd']:g} x that / time"
    text += ("; % of (matmul) peak: cuflash TFLOP/s / the matmul ceiling measured at the "
             "start; cuflash / peer, vs peer: peer time / cuflash time (cuflash's speed as a "
             "multiple of the peer's); flash, cudnn, efficient: SDPA pinned to that backend.")
    if not getattr(args, "wide", False):
        text += " --wide adds each peer's ms and TFLOP/s."
    if "bwd" in modes:
        text += ("\nbackward: the backward pass alone, with a fixed random dO, after a forward "
                 "run untimed: cuflash.attention_backward(do, q, k, v, o, l, m); SDPA "
                 "torch.autograd.grad(out, (q, k, v), dO, retain_graph=True)")
        if "standard" in peers:
            text += ("; standard: an explicit CuPy backward from the P the standard forward "
                     "kept (dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)) in float32 "
                     "cast back, dQ = scale dS K, dK = scale dS^T Q), one input set")
        if getattr(args, "tiles", []):
            text += "; the cuflash[...] tile columns tune forward tiles and appear in forward tables only"
        text += "."
    if "fwdbwd" in modes:
        text += ("\nforward + backward: one timed call runs the forward and the backward: "
                 "cuflash.attention then cuflash.attention_backward; SDPA out = sdpa(q, k, v) "
                 "then torch.autograd.grad(out, (q, k, v), dO), the graph recorded inside the "
                 "timing; standard: its forward then its backward.")
    text = "\n\n".join(blocks) + "\n\n" + common.wrap(text)
    if notes.texts:
        text += "\n" + "\n".join(notes.lines())
    return text


def json_settings(args, envs) -> dict:
    if not isinstance(envs, dict):
        envs = {getattr(envs, "dtype_name", arg_dtypes(args)[0]): envs}
    standard = {}
    for name, env in envs.items():
        try:
            dtype = str(env.cupy.dtype(env.standard_dtype))
        except Exception:
            dtype = str(getattr(env, "standard_dtype", None))
        standard[name] = {"dtype": dtype, "reason": getattr(env, "standard_reason", None)}
    return {"modes": list(args.modes), "dtypes": arg_dtypes(args), "seqlens": list(args.seqlens),
            "hdims": list(args.hdims), "causal": list(args.causal_modes), "tokens": TOKENS,
            "hidden": HIDDEN, "flop_factors": dict(MODE_FLOP_FACTOR), "warmup": args.warmup,
            "repeats": args.repeats or "auto", "tiles": [list(t) for t in getattr(args, "tiles", [])],
            "peers": speed_peers(args), "standard": standard}
