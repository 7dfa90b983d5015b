"""Compile every kernel variant the dispatcher can pick, for sm_80 and sm_90a, without a GPU.

    python -m cuflash.compile_check [--arch sm_80 sm_90a] [--spill-budget BYTES]
    python -m cuflash.compile_check --warm [--jobs N]

Prints registers, stack frame and spills per variant and architecture; exits non-zero on a
compile error or on a variant that spills more than SPILL_BUDGET_BYTES (stores), since every
listed variant is one the dispatcher runs. The budget is not zero since the sliding-window band
went into every kernel: the register-bound 16-bit forwards (two 16-row tiles a warp) now spill
8-32 bytes around the mask (bench/NOTES.md, Forward (mma.sync)). It also exits non-zero on a variant whose
wgmma instructions ptxas serializes (notes C7514, C7518, C7520), and lists its other wgmma notes.

--warm compiles every variant for the GPU at hand, in parallel processes, into CuPy's disk
cache, so that first calls (and test runs on a fresh machine) find them built.

Without CuPy (whose NVRTC builds the kernels), or with --warm and no usable GPU, it prints one
line saying so and exits with status 2.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import multiprocessing
import os
import sys

from . import _config, _loader, _requirements

PROG = "cuflash-compile-check"  # the command pyproject.toml installs
DEFAULT_ARCHS = ("sm_80", "sm_90a")
SPILL_BUDGET_BYTES = 48


def spill_budget(variant, default: int = SPILL_BUDGET_BYTES) -> int:
    """The spill budget of one variant: the default, or the variant's own documented allowance
    (``spill_allowance``) where that is larger."""
    return max(default, getattr(variant, "spill_allowance", 0))


def _compile_chunk(task):
    source, exprs, arch = task
    return arch, _loader.compile_offline(source, exprs, arch)


def check(archs=DEFAULT_ARCHS, variants=None, jobs=None, chunk=12):
    """[(variant, arch, report)] for every variant; raises RuntimeError on a compile error.

    Variants are compiled in chunks of one source file, spread over ``jobs`` processes.
    """
    per_arch = {
        arch: list(variants if variants is not None else _config.variants_for(arch))
        for arch in archs
    }
    tasks = []
    for arch, arch_variants in per_arch.items():
        by_source = collections.defaultdict(list)
        for variant in arch_variants:
            by_source[variant.source].append(variant)
        tasks += [
            (source, [v.name_expression for v in group[i:i + chunk]], arch)
            for source, group in by_source.items()
            for i in range(0, len(group), chunk)
        ]
    jobs = jobs or os.cpu_count() or 1
    context = multiprocessing.get_context("spawn")  # the caller may hold threads (JAX, torch)
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=context) as pool:
        results = list(pool.map(_compile_chunk, tasks))
    by_key = {(arch, expr): report for arch, reports in results for expr, report in reports.items()}
    return [(v, arch, by_key[(arch, v.name_expression)]) for arch in archs for v in per_arch[arch]]


def _current_variants():
    import cupy

    return _config.variants_for(cupy.cuda.Device().compute_capability)


def _warm_one(variant):
    _loader.get_kernel(variant)
    return variant.key


def warm(jobs=None, variants=None):
    """Build variants (default: every one the dispatcher can pick on the current GPU) into
    CuPy's disk cache, in parallel processes; returns the count."""
    variants = _current_variants() if variants is None else list(variants)
    jobs = jobs or min(16, os.cpu_count() or 1)
    context = multiprocessing.get_context("spawn")  # no CUDA state crosses a fork
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        return len(list(pool.map(_warm_one, variants)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS))
    parser.add_argument("--spill-budget", type=int, default=SPILL_BUDGET_BYTES,
                        help="fail on a variant that spills more bytes than this (stores)")
    parser.add_argument("--warm", action="store_true", help="build for the GPU at hand into the disk cache")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    if not _requirements.installed("cupy"):
        print(_requirements.missing_cupy(parser.prog), file=sys.stderr)
        return 2
    if args.warm:
        reason = _requirements.gpu_unavailable()
        if reason:
            print(f"{parser.prog}: --warm builds for the GPU at hand: {reason}", file=sys.stderr)
            return 2
        print(f"built {warm(args.jobs)} variants for the current GPU into CuPy's kernel cache")
        return 0
    from tabulate import tabulate

    try:
        rows = check(args.arch)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    table = [
        (v.key, arch, r["registers"], r["stack"], r["spill_stores"], r["spill_loads"], spill_budget(v, args.spill_budget),
         " ".join(r["wgmma_notes"]))
        for v, arch, r in rows
    ]
    print(tabulate(table, headers=("variant", "arch", "regs", "stack B", "spill st B", "spill ld B", "budget B",
                                   "wgmma notes")))
    spilled = [row for row in table if row[4] or row[5]]
    over = [row for row in spilled if row[4] > row[6]]
    serialized = [(v.key, arch, " ".join(r["wgmma_notes"])) for v, arch, r in rows if _loader.serializes_wgmma(r)]
    print(f"\n{len(table)} variant builds, {len(spilled)} with spills, {len(over)} over their budget "
          f"({args.spill_budget} B unless the variant documents more), {len(serialized)} with serialized wgmma")
    for row in spilled:
        print(f"SPILL: {row[0]} on {row[1]}: {row[4]} B stored, {row[5]} B loaded", file=sys.stderr)
    for key, arch, notes in serialized:
        print(f"SERIALIZED WGMMA (ptxas {notes}): {key} on {arch}", file=sys.stderr)
    return 1 if over or serialized else 0


if __name__ == "__main__":
    sys.exit(main())
