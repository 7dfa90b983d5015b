"""cuflash-bench: cuflash and its peers side by side, in one process, on the GPU at hand.

    cuflash-bench                                  # the default sweep: every table
    cuflash-bench --tables speed --modes fwd --seqlens 4096 16384 --hdims 128
    cuflash-bench --tables io                      # the IO table; counts need no GPU
    cuflash-bench --tables io --io                 # bytes measured by ncu
    cuflash-bench --json out.json --csv out.csv --plot tflops.png

(``python -m cuflash.bench`` and, in the repository, ``python -m bench`` do the same.)

Tables, in this order (TABLES), on stdout as each is done; a progress bar on stderr meanwhile:

1. speed: forward, backward and forward + backward, ms and TFLOP/s per sequence length,
   head dim, causal setting and dtype (16k tokens per batch, hidden 2048), cuflash against
   standard attention (CuPy) and torch SDPA's flash, cuDNN and efficient backends; cuflash's
   ratio to each peer and its share of the matmul ceiling measured at the start
   (cuflash.bench.speed).
2. memory: peak extra device memory of forward + backward against the sequence length, and
   where standard attention runs out of memory (cuflash.bench.memory).
3. io: the FlashAttention paper's Fig. 2 for GPT-2 medium attention, and bytes and runtime
   against the tile size (cuflash.bench.io).
4. sparse: block-sparse patterns, density, ms and speedup over dense, with torch
   FlexAttention on the same block mask (cuflash.bench.sparse).
5. decode: one query token per sequence against dense and paged KV caches, GQA and MQA,
   against SDPA on the dense cache and the device copy ceiling, in GB/s of K and V read,
   eager calls and the same calls replayed from a CUDA graph (cuflash.bench.decode).
6. varlen: 64 sequences of mixed lengths (128-8192), causal, forward and forward + backward,
   packed through cuflash's variable-length call against the same batch padded to its longest
   (cuflash's dense path, SDPA flash and cuDNN) and SDPA on jagged nested tensors; equal
   lengths packed against the dense path; useful TFLOP/s, padding shares, each row's target
   ratio and whether it is met (cuflash.bench.varlen).
7. host: CPU microseconds per call of each API (CuPy, torch, JAX) at a tiny shape, against
   SDPA and JAX's cuDNN path, with each cuflash row's target (a bound in microseconds, or one
   over its peer's time) and whether it is met (cuflash.bench.host).
8. e2e: forward + backward through the torch and JAX adapters at model shapes, host time
   included, against SDPA (default, flash, cuDNN) and JAX (cuDNN, XLA) (cuflash.bench.e2e).
   host and e2e run last: JAX, once imported, keeps the device memory it has used.

The tables fit CAPTION_WIDTH (120) columns; --wide adds every peer's own columns. A peer that
fails or is missing shows as a dash with the reason in a footnote. A cuflash failure shows as
FAILED with its reason, and the exit status is then 1. Without a usable GPU (no CuPy, no
driver, no device): the io table's analytical counts are printed (when io is asked for, without
--io), then one line on stderr naming the tables that were not run and why; the exit status is
0 when every table asked for was printed, else 2, so that a script asking for measurements
never takes their absence for success (``cuflash-bench --tables io`` runs anywhere). Bad
arguments: argparse's message and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

from .. import _requirements
from . import common, decode, e2e, host, io, memory, sparse, speed, varlen
from .outputs import (  # noqa: F401 - also reached as cuflash.bench.cli.<name>
    CSV_FIELDS, JSON_EXPANDED_DEPTH, compact_json, csv_rows, plot_speed, settings, without_call_times,
    write_csv, write_json)

TABLES = ("speed", "memory", "io", "sparse", "decode", "varlen", "host", "e2e")
ALL_PEERS = ("standard", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "cuflash_torch")
DEFAULT_PEERS = ("standard", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")
NO_GPU_RUNTIME = "runtime not measured: it needs a CUDA GPU"


# ---- arguments ---------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def head_dim(text: str) -> int:
    from cuflash import _constants

    value = positive_int(text)
    step, top = _constants.HEAD_DIM_MULTIPLE, _constants.MAX_HEAD_DIM
    if value % step or value > top:
        raise argparse.ArgumentTypeError(
            f"head dims are multiples of {step} from {step} to {top}, got {value}")
    return value


def sparse_seqlen(text: str) -> int:
    value = positive_int(text)
    blocks = value // 128
    if value % 128 or blocks & (blocks - 1):
        raise argparse.ArgumentTypeError(
            f"the block-sparse length must be 128 times a power of two (128 x 128 blocks; the "
            f"butterfly pattern needs a power-of-two block count), got {value}")
    return value


def build_parser(prog: str = common.PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="cuflash and its peers side by side on the GPU at hand: speed, memory, "
                    "IO (the FlashAttention paper's Fig. 2), block-sparse, decode, "
                    "variable-length (packed against padded), host-time and end-to-end tables.",
        epilog="Tables go to stdout, progress to stderr. Without a GPU only the io table's "
               "counts are made (--tables io). Exit status: 0 done, 1 a cuflash measurement "
               "failed, 2 bad arguments or a table asked for needs a GPU and there is none.")
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES),
                        help="tables to make (default: all)")
    parser.add_argument("--seqlens", type=positive_int, nargs="+",
                        default=list(speed.DEFAULT_SEQLENS), metavar="N",
                        help="speed: sequence lengths (default: %(default)s)")
    parser.add_argument("--hdims", type=head_dim, nargs="+", default=list(speed.DEFAULT_HDIMS),
                        metavar="D", help="speed: head dims; memory takes the largest, sparse "
                                          "the first (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", choices=common.DTYPES, default=["bfloat16"],
                        help="input dtypes; memory and sparse take the first, io the first "
                             "16-bit one (else bfloat16) (default: %(default)s)")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both",
                        help="speed: causal masking; memory: causal only with 'yes' "
                             "(default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=speed.MODES, default=list(speed.MODES),
                        help="speed and sparse: fwd (forward), bwd (backward alone), fwdbwd "
                             "(both in one call) (default: all)")
    parser.add_argument("--peers", nargs="*", choices=ALL_PEERS, default=list(DEFAULT_PEERS),
                        help="peer backends: standard and sdpa_* (speed, memory), flex (sparse), "
                             "cuflash_torch (memory: cuflash through its torch adapter) "
                             "(default: %(default)s; none: --peers with no name)")
    parser.add_argument("--io", action="store_true",
                        help="io: measure the bytes with ncu (Nsight Compute) instead of "
                             "counting them only")
    parser.add_argument("--memory-seqlens", type=positive_int, nargs="+",
                        default=list(memory.DEFAULT_SEQLENS), metavar="N",
                        help="memory: sequence lengths, batch 1 (default: %(default)s)")
    parser.add_argument("--sparse-seqlen", type=sparse_seqlen, nargs="+", default=[sparse.DEFAULT_SEQLEN],
                        metavar="N", help="sparse: sequence lengths, a table each (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed calls per measurement, the median reported (default: "
                             f"adaptive, {common.AUTO_MIN_REPEATS} to {common.AUTO_MAX_REPEATS}"
                             f", about {common.AUTO_TARGET_MS:.0f} ms of work)")
    parser.add_argument("--warmup", type=positive_int, default=common.WARMUP,
                        help="untimed calls first; compilation happens here "
                             "(default: %(default)s)")
    parser.add_argument("--tiles", type=speed.parse_tiles, action="append", default=[],
                        metavar="BR,BC,W,MB[,U]",
                        help="speed, tuning: add a forward column cuflash[...] run with these "
                             "tiles for the head-dim bucket under test (repeatable)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers to FILE")
    parser.add_argument("--csv", metavar="FILE", help="write the raw numbers to FILE, one row "
                                                      "per measurement")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw TFLOP/s against sequence length per backend (speed table; "
                             "needs matplotlib: pip install 'cuflash[plot]')")
    parser.add_argument("--tablefmt", default="github",
                        help="tabulate table format (default: %(default)s)")
    parser.add_argument("--wide", action="store_true",
                        help="speed and e2e: every peer's own ms, TFLOP/s and host columns, not "
                             "only cuflash's ratio to it (wider than 120 columns)")
    return parser


def _unique(values) -> list:
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def matplotlib_missing() -> Optional[str]:
    try:
        import matplotlib  # noqa: F401
    except Exception as exc:
        return common.first_line(exc)
    return None


def parse_args(argv=None, prog: str = common.PROG) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.tables = [t for t in TABLES if t in args.tables]
    args.modes = [m for m in speed.MODES if m in args.modes]
    args.peers = [p for p in ALL_PEERS if p in args.peers]
    args.seqlens = sorted(set(args.seqlens))
    args.memory_seqlens = sorted(set(args.memory_seqlens))
    args.hdims = _unique(args.hdims)
    args.dtypes = _unique(args.dtypes)
    args.causal_modes = speed.causal_modes(args.causal)
    if args.io and "io" not in args.tables:
        parser.error("--io measures the io table's bytes with ncu; add io to --tables")
    if args.plot:
        if "speed" not in args.tables:
            parser.error("--plot draws the speed table; add speed to --tables")
        missing = matplotlib_missing()
        if missing:
            parser.error(f"--plot needs matplotlib ({missing}); pip install 'cuflash[plot]'")
    for option in ("json", "csv", "plot"):
        path = getattr(args, option)
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                parser.error(f"--{option} {path}: folder {folder} does not exist")
    return args


# ---- running -----------------------------------------------------------------------------


def count_steps(args) -> int:
    steps = 1  # the ceilings
    if "speed" in args.tables:
        steps += speed.count_steps(args)
    if "memory" in args.tables:
        steps += memory.count_steps(memory_args(args))
    if "io" in args.tables:
        steps += io.count_steps(args)
    if "sparse" in args.tables:
        steps += sparse.count_steps(args)
    if "decode" in args.tables:
        steps += decode.count_steps()
    if "varlen" in args.tables:
        steps += varlen.count_steps()
    if "host" in args.tables:
        steps += host.count_steps(args)
    if "e2e" in args.tables:
        steps += e2e.count_steps(args)
    return steps


def io_dtype(args) -> str:
    """The IO table's dtype: the first 16-bit one of --dtypes, else bfloat16 (its byte model
    is that of the tensor-core kernels)."""
    return next((d for d in args.dtypes if d in ("bfloat16", "float16")), "bfloat16")


def forward_forms(dtype: str, hdim: int, causal: bool, *, sparse: bool = False, wgmma: bool = False) -> list:
    """The forward variants of one shape at short and long query lengths (the wgmma forward
    is persistent for short ones)."""
    from cuflash import _config

    forms = (_config.forward_config(dtype, hdim, hdim, causal, sparse=sparse, wgmma=wgmma, nq=n) for n in (1, 2**30))
    return list({v.key: v for v in forms}.values())


def kernel_variants(args) -> list:
    """Every cuflash kernel variant the selected tables will launch (16-bit and float32
    forward and backward per dtype, head dim and causal setting, the IO table's tile sweep,
    --tiles columns)."""
    from cuflash import _config

    shapes = set()  # (dtype, head dim, causal)
    wgmma = common.device_has_wgmma()
    if "speed" in args.tables:
        shapes |= {(t, h, c) for t in args.dtypes for h in args.hdims for c in args.causal_modes}
    if "memory" in args.tables:
        shapes.add((args.dtypes[0], max(args.hdims), args.causal == "yes"))
    if "io" in args.tables:
        shapes.add((io_dtype(args), io.GPT2_MEDIUM["hdim"], False))
    if "sparse" in args.tables:
        shapes.add((args.dtypes[0], args.hdims[0], False))
    if "host" in args.tables:
        shapes.add(("bfloat16", host.HOST_SHAPE[3], host.CAUSAL))
    if "e2e" in args.tables:
        shapes |= e2e.variant_shapes()
    if "varlen" in args.tables:  # its dense rows (the packed call's kernels are its own)
        shapes |= varlen.variant_shapes()
    variants = []
    for dtype, hdim, causal in sorted(shapes):
        variants += forward_forms(dtype, hdim, causal, wgmma=wgmma)
        plan = _config.backward_plan(dtype, hdim, hdim, causal, False, wgmma=wgmma)
        variants += [k for k in (plan.preprocess, *plan.key_passes, plan.dq) if k is not None]
        if "speed" in args.tables and dtype != "float32":
            variants += [_config.forward_config(dtype, hdim, hdim, causal, tiles=t)
                         for t in args.tiles]
    if "io" in args.tables:
        d = io.GPT2_MEDIUM["hdim"]
        variants += [_config.forward_config(io_dtype(args), d, d, False, tiles=t)
                     for t in io.SWEEP_TILES]
    if "sparse" in args.tables:  # the block-sparse kernels are variants of their own
        dtype, d = args.dtypes[0], args.hdims[0]
        plan = _config.backward_plan(dtype, d, d, False, False, sparse=True, wgmma=wgmma)
        variants += [*forward_forms(dtype, d, False, sparse=True, wgmma=wgmma), *plan.key_passes]
    return list({v.key: v for v in variants}.values())


def memory_args(args, tablefmt: Optional[str] = None):
    return memory.memory_args(args.memory_seqlens, max(args.hdims), args.dtypes[0],
                              causal=args.causal == "yes", peers=args.peers,
                              tablefmt=tablefmt or args.tablefmt)


def emit(text: str, progress=None) -> None:
    if progress is not None:
        progress.clear()
    print(text, flush=True)


def io_failures(result: dict) -> list:
    failed = []
    cuflash = result["methods"]["cuflash"]
    if cuflash.get("status") in ("error", "oom"):
        failed.append(("io: cuflash forward + backward", cuflash.get("error")))
    for row in result["sweep"]:
        if row.get("status") in ("error", "oom"):
            failed.append((f"io: cuflash forward, tiles {row['tiles']}", row.get("error")))
    return failed


def run_analytical_io(args, reason: str) -> None:
    """The io table without a GPU (``reason`` says why there is none): the counts, runtime
    marked as not measured."""
    notes = common.Footnotes()
    result = io.analytical_io(io_dtype(args))
    print(io.format_io(result, notes, args.tablefmt, no_gpu_reason=NO_GPU_RUNTIME), flush=True)
    results = {"info": {"gpu": None, "reason": reason, "commit": common.git_commit()},
               "settings": settings(args), "io": {"result": result, "footnotes": notes.texts}}
    write_outputs(args, results)


def run_without_gpu(args, reason: str, prog: str = common.PROG) -> int:
    """What can run without a GPU (``reason`` says why there is none): the io table's
    analytical counts, then one line on stderr naming the tables not run. Exit status 0 when
    every table asked for was printed, else 2."""
    counts_only = "io" in args.tables and not args.io
    if counts_only:
        run_analytical_io(args, reason)
    not_run = ["io --io" if t == "io" else t for t in args.tables if not (t == "io" and counts_only)]
    if not not_run:
        return 0
    print(f"{prog}: {', '.join(not_run)}: not run, they need a CUDA GPU ({reason}). "
          f"{prog} --tables io runs without one.", file=sys.stderr)
    return 2


def write_outputs(args, results: dict) -> None:
    if args.json:
        write_json(args.json, results)
        common.log(f"raw numbers written to {args.json}")
    if args.csv:
        write_csv(args.csv, results)
        common.log(f"rows written to {args.csv}")


def run(args) -> int:
    dtypes = args.dtypes + ([io_dtype(args)] if "io" in args.tables else [])
    dtypes += ["bfloat16"] if {"host", "e2e", "decode", "varlen"} & set(args.tables) else []  # their inputs
    envs = {dtype: common.setup_env(dtype) for dtype in _unique(dtypes)}
    env = envs[args.dtypes[0]]
    results: dict = {"settings": settings(args)}
    failures: list = []
    progress = common.Progress(count_steps(args))
    started = time.perf_counter()
    try:
        with env.stream():
            info = common.device_info(env)
            results["info"] = info
            emit(common.wrap("\n".join(speed.header_lines(info, args))), progress)
            variants = kernel_variants(args)
            progress.start(f"compiling {len(variants)} kernel variants in parallel")
            try:
                common.prebuild(variants)
            except Exception as exc:  # the warm-up calls compile (or fail) on their own
                progress.note(f"parallel compilation skipped: {common.first_line(exc)}")
            progress.start("ceilings: matmul and device copy")
            ceilings = common.measure_ceilings(env, args.repeats)
            results["ceilings"] = ceilings
            progress.advance()
            emit(common.ceilings_line(ceilings) + "\n", progress)

            if "speed" in args.tables:
                records = []
                for dtype in args.dtypes:
                    records += speed.run_all(envs[dtype], args, progress)
                notes = common.Footnotes()
                emit(speed.format_tables(records, args, ceilings, envs, notes) + "\n", progress)
                results["speed"] = {"settings": speed.json_settings(args, envs),
                                    "records": records, "footnotes": notes.texts}
                failures += speed.cuflash_failures(records)
                if args.plot:
                    plot_speed(args.plot, records, args)
                    progress.note(f"plot written to {args.plot}")

            if "memory" in args.tables:
                margs = memory_args(args)
                records = memory.run_all(env, margs, progress)
                notes = common.Footnotes()
                emit(memory.format_table(records, margs, notes, info.get("memory_bytes")) + "\n",
                     progress)
                results["memory"] = {"settings": memory.json_settings(margs), "records": records,
                                     "growth": memory.growth_all(records, margs),
                                     "footnotes": notes.texts}
                failures += memory.cuflash_failures(records)

            if "io" in args.tables:
                result = io.run_io(envs[io_dtype(args)], args, progress)
                notes = common.Footnotes()
                emit(io.format_io(result, notes, args.tablefmt) + "\n", progress)
                results["io"] = {"result": result, "footnotes": notes.texts}
                failures += io_failures(result)

            if "sparse" in args.tables:
                records = sparse.run_sparse(env, args, progress)
                notes = common.Footnotes()
                emit(sparse.format_sparse(records, args, notes) + "\n", progress)
                results["sparse"] = {"records": records, "footnotes": notes.texts}
                failures += sparse.cuflash_failures(records)

            if "decode" in args.tables:
                records = decode.decode_table(envs["bfloat16"], args, progress)
                notes = common.Footnotes()
                emit(decode.format_decode(records, args, ceilings, notes) + "\n", progress)
                results["decode"] = {"settings": decode.json_settings(), "records": records,
                                     "footnotes": notes.texts}
                failures += decode.cuflash_failures(records)

            if "varlen" in args.tables:
                records = varlen.varlen_table(envs["bfloat16"], args, progress)
                notes = common.Footnotes()
                emit(varlen.format_varlen(records, notes, args.tablefmt) + "\n", progress)
                results["varlen"] = {"settings": varlen.json_settings(), "records": records,
                                     "footnotes": notes.texts}
                failures += varlen.cuflash_failures(records)

            if "host" in args.tables:
                measured = host.run_host(envs["bfloat16"], args, progress)
                notes = common.Footnotes()
                emit(host.format_host(measured, notes, args.tablefmt) + "\n", progress)
                results["host"] = {"results": measured, "footnotes": notes.texts}
                failures += host.cuflash_failures(measured)

            if "e2e" in args.tables:
                records = e2e.run_e2e(envs["bfloat16"], args, progress)
                notes = common.Footnotes()
                emit(e2e.format_e2e(records, notes, args.tablefmt, args.wide) + "\n", progress)
                results["e2e"] = {"records": records, "footnotes": notes.texts}
                failures += e2e.cuflash_failures(records)
    finally:
        progress.close()
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    emit(f"the whole run took {results['wall_seconds']:.0f} s, kernel compilation included")
    write_outputs(args, results)
    if failures:
        label, error = failures[0]
        common.log(f"{common.PROG}: cuflash failed in {len(failures)} measurement(s); the "
                   f"first: {label}: {error}")
        return 1
    return 0


def main(argv=None, prog: str = common.PROG) -> int:
    args = parse_args(argv, prog)
    reason = _requirements.gpu_unavailable()
    if reason:
        return run_without_gpu(args, reason, prog)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
