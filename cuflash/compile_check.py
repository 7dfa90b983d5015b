"""Compile every kernel variant the dispatcher can pick, for sm_80 and sm_90a, without a GPU.

    python -m cuflash.compile_check [--arch sm_80 sm_90a] [--allow-spills]

Prints registers, stack frame and spills per variant and architecture; exits non-zero on a
compile error or (unless --allow-spills) on any spill, since every listed variant is one the
dispatcher runs.
"""

from __future__ import annotations

import argparse
import collections
import sys

from . import _config, _loader

DEFAULT_ARCHS = ("sm_80", "sm_90a")


def check(archs=DEFAULT_ARCHS, variants=None):
    """[(variant, arch, report)] for every variant; raises RuntimeError on a compile error."""
    variants = list(variants if variants is not None else _config.all_forward_variants())
    by_source = collections.defaultdict(list)
    for variant in variants:
        by_source[variant.source].append(variant)
    rows = []
    for arch in archs:
        for source, group in by_source.items():
            report = _loader.compile_offline(source, [v.name_expression for v in group], arch)
            rows.extend((v, arch, report[v.name_expression]) for v in group)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS))
    parser.add_argument("--allow-spills", action="store_true")
    args = parser.parse_args(argv)
    from tabulate import tabulate

    try:
        rows = check(args.arch)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    table = [
        (v.key, arch, r["registers"], r["stack"], r["spill_stores"], r["spill_loads"])
        for v, arch, r in rows
    ]
    print(tabulate(table, headers=("variant", "arch", "regs", "stack B", "spill st B", "spill ld B")))
    spilled = [row for row in table if row[4] or row[5]]
    print(f"\n{len(table)} variant builds, {len(spilled)} with spills")
    if spilled and not args.allow_spills:
        for row in spilled:
            print(f"SPILL: {row[0]} on {row[1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
