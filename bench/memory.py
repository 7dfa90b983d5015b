"""Peak extra device memory of attention forward + backward: cuflash, PyTorch SDPA, standard.
The memory table of ``cuflash-bench`` with this script's original options and defaults.

    python -m bench.memory                                   # seq 4096 16384 65536, hdim 128
    python -m bench.memory --seqlens 4096 16384 --hdim 64 --heads 32 --causal yes --json m.json

The code and what is counted are described in cuflash.bench.memory; this module keeps the
command line that produced the results in bench/results/. Importing it needs neither a
GPU nor CuPy.
"""

from __future__ import annotations

import argparse
import sys

from cuflash.bench import common
from cuflash.bench.common import DASH, Footnotes  # noqa: F401 - re-exported
from cuflash.bench.memory import (  # noqa: F401
    LINEAR_MAX, MiB, QUADRATIC_MIN, STANDARD_NOTE, WARMUP_SEQ, LiveBytes, counted_note,
    cuflash_failures, format_table, growth, growth_exponent, growth_kind, measure,
    measure_cuflash, measure_torch, memory_cell, mib, pool_hook, run_all, standard_forward,
    standard_oom_line, standard_score_bytes, tensor_bytes, write_json)

DEFAULT_SEQLENS = (4096, 16384, 65536)
PEERS = ("cuflash_torch", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "standard")
DEFAULT_PEERS = ("cuflash_torch", "sdpa_flash", "sdpa_cudnn", "standard")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory",
        description="Peak device memory of one attention forward + backward above its inputs: "
                    "cuflash (CuPy, memory hook) against PyTorch SDPA flash / cuDNN and "
                    "standard attention (torch allocator peak).")
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS),
                        metavar="N", help="sequence lengths (default: %(default)s)")
    parser.add_argument("--hdim", type=int, default=128, help="head dim (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=16, help="heads (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="batch (default: %(default)s)")
    parser.add_argument("--causal", choices=("no", "yes"), default="no",
                        help="causal masking (default: %(default)s)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                        help="input dtype (default: %(default)s)")
    parser.add_argument("--deterministic", action="store_true",
                        help="run cuflash.attention_backward with deterministic=True (and "
                             "cuflash_torch under torch.use_deterministic_algorithms)")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(DEFAULT_PEERS),
                        help="peer backends to run (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers to FILE")
    parser.add_argument("--tablefmt", default="github",
                        help="tabulate table format (default: %(default)s)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [x for x in args.seqlens if x <= 0]
    if bad:
        parser.error(f"--seqlens must be positive, got {bad}")
    for name in ("hdim", "heads", "batch"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    args.seqlens = sorted(set(args.seqlens))
    args.is_causal = args.causal == "yes"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = common.setup_env(args.dtype, prog="python -m bench.memory")
    notes = Footnotes()
    with env.stream():
        info = common.device_info(env)
        print(f"GPU: {info['gpu']}, CUDA runtime {info['cuda_runtime']}, driver "
              f"{info['cuda_driver']}; cuflash commit {info['commit']}, cupy {info['cupy']}, "
              f"torch {info['torch'] or DASH + ' (' + str(info['torch_reason']) + ')'}\n",
              flush=True)
        records = run_all(env, args)
    print(format_table(records, args, notes, info.get("memory_bytes")), flush=True)
    if args.json:
        write_json(args.json, info, records, args, notes)
        common.log(f"raw numbers written to {args.json}")
    failed = cuflash_failures(records)
    if failed:
        common.log(f"cuflash failed in {len(failed)} measurement(s); the first: "
                   f"{failed[0][0]}: {failed[0][1]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
