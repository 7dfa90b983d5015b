"""Forward and backward speed of cuflash against standard attention and PyTorch SDPA: the
speed table of ``cuflash-bench`` with this script's original options and defaults.

    python -m bench.bench_forward                       # bf16, fwd and bwd, seq 1024..16384
    python -m bench.bench_forward --modes bwd --seqlens 4096 --hdims 128
    python -m bench.bench_forward --modes fwd --seqlens 4096 --hdims 128 --causal yes \\
        --tiles 128,64,8,1 --tiles 256,32,8,1,2        # tuning: one column per tile entry

The code lives in cuflash.bench.speed (the harness, backends, timing and tables are described
there); this module keeps the command line that produced the results in bench/results/.
``python -m bench`` runs the whole ``cuflash-bench`` (speed, memory, IO and block-sparse tables).

Importing this module needs neither a GPU nor CuPy's CUDA libraries.
"""

from __future__ import annotations

import argparse
import sys

from cuflash.bench.common import (  # noqa: F401 - re-exported for callers of this module
    DASH, HIDDEN, L2_BYTES, TOKENS, WARMUP, Env, Footnotes, as_cupy, ceilings_line,
    device_info, first_line, is_oom, log, make_inputs, measure_ceilings, num_input_sets,
    problem_shape, random_tensor, setup_env, time_call)
from cuflash.bench.io import BWD_FLOP_FACTOR, flops  # noqa: F401
from cuflash.bench.speed import (  # noqa: F401
    CHECK_WARN, SDPA_BACKENDS, Backend, Measurement, backend_names, causal_modes,
    cuflash_backend, cuflash_backward_backend, cuflash_failures, format_tables, header_lines,
    max_abs_diff, max_rel_diff, parse_tiles, peer_backend, ratio_cell, run_all, run_backend,
    run_config, run_peer, sdpa_backend, sdpa_backward_backend, standard_backend,
    standard_backward_backend, standard_convert, standard_parts, tile_label, time_cells,
    write_json)

REPEATS = 30
DEFAULT_SEQLENS = (1024, 2048, 4096, 8192, 16384)
DEFAULT_HDIMS = (64, 128)
MODES = ("fwd", "bwd")
MODE_NAMES = {"fwd": "forward", "bwd": "backward"}
PEERS = ("standard", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
DEFAULT_PEERS = ("standard", "sdpa_flash", "sdpa_cudnn")
SDPA_PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_forward",
        description="Forward and backward speed of cuflash against standard attention (CuPy) "
                    "and PyTorch SDPA (flash, cuDNN), in the FlashAttention papers' harness: "
                    f"{TOKENS} tokens per batch, hidden {HIDDEN}, layout (batch, heads, seq, hdim).",
    )
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS),
                        metavar="N", help="sequence lengths (default: %(default)s)")
    parser.add_argument("--hdims", type=int, nargs="+", default=list(DEFAULT_HDIMS),
                        metavar="D", help="head dims (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="fwd: forward pass; bwd: backward pass alone (default: both)")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both",
                        help="causal masking (default: %(default)s)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                        help="input dtype (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="timed calls per measurement; the median is reported "
                             "(default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help="untimed calls first; compilation happens here (default: %(default)s)")
    parser.add_argument("--tiles", type=parse_tiles, action="append", default=[],
                        metavar="BR,BC,MB",
                        help="tuning mode: add a column cuflash[BR,BC,MB] run with these forward "
                             "tiles for the head-dim bucket under test (repeatable; forward "
                             "tables only)")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(DEFAULT_PEERS),
                        help="peer backends to run (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers to FILE")
    parser.add_argument("--tablefmt", default="github",
                        help="tabulate table format (default: %(default)s)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("seqlens", "hdims"):
        bad = [x for x in getattr(args, name) if x <= 0]
        if bad:
            parser.error(f"--{name} must be positive, got {bad}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (compilation must not be timed)")
    args.causal_modes = causal_modes(args.causal)
    args.modes = [m for m in MODES if m in args.modes]  # canonical order, no repeats
    args.dtypes = [args.dtype]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = setup_env(args.dtype, prog="python -m bench.bench_forward")
    notes = Footnotes()
    with env.stream():
        info = device_info(env)
        print("\n".join(header_lines(info, args)), flush=True)
        log("measuring ceilings (matmul, copy)")
        ceilings = measure_ceilings(env, args.repeats)
        print(ceilings_line(ceilings) + "\n", flush=True)
        records = run_all(env, args)
    print(format_tables(records, args, ceilings, env, notes), flush=True)
    if args.json:
        write_json(args.json, info, ceilings, records, args, env, notes)
        log(f"raw numbers written to {args.json}")
    failed = cuflash_failures(records)
    if failed:
        log(f"cuflash failed in {len(failed)} measurement(s); the first: {failed[0][0]}: "
            f"{failed[0][1]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
