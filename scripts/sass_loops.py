"""The matrix-multiply loops of kernel variants in their machine code: instructions a pass, by kind.

    python scripts/sass_loops.py [--arch sm_90a] [--match REGEX] [--jobs N]

Each variant of this checkout's dispatcher (``cuflash._config.variants_for(arch)``) whose name
expression matches REGEX is compiled by NVRTC and disassembled with cuobjdump, as
scripts/sass_diff.py does. Every loop (the body of a backward branch) that holds a tensor-core
instruction is listed with its instruction count and the kinds that bound these kernels: the
matrix multiplies, the waits on them, barriers, exponentials, shared-memory and global traffic,
atomics and reductions, mbarrier operations. An edit meant to take instructions, waits or
barriers out of a tile loop shows here on a machine without a GPU; whether the kernel is faster
still needs one.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import sass_diff  # noqa: E402  (after the path set-up)

# "        /*0af0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;  /* 0x... */"
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")

# Kinds counted, by the opcode's start (after any predicate): the first that matches.
KINDS = (
    ("wgmma", ("HGMMA",)),
    ("mma", ("HMMA",)),
    ("wgmma wait", ("WARPGROUP.DEPBAR",)),
    ("barrier", ("BAR.",)),
    ("mbarrier", ("SYNCS.",)),
    ("exp2", ("MUFU.EX2",)),
    ("smem load", ("LDS", "LDSM")),
    ("smem store", ("STS", "STSM")),
    ("global load", ("LDG", "LDGSTS", "UTMALDG", "UBLKCP")),
    ("global store", ("STG", "UTMASTG")),
    ("atomic / reduce", ("RED", "ATOM", "UBLKRED", "UTMAREDG")),
)


class Loop(NamedTuple):
    start: int  # address of the first instruction (the branch's target)
    end: int  # address of the backward branch
    instructions: int
    kinds: dict
    innermost: bool  # no other listed loop lies inside it


def _addressed(line: str):
    m = _LINE.search(line)
    return (int(m.group(1), 16), m.group(2).strip()) if m else None


def parse_functions(listing: str) -> dict:
    """{function name: [(address, instruction without its predicate's spacing)]} of a
    cuobjdump -sass listing."""
    return sass_diff.split_functions(listing, _addressed)


def opcode(instruction: str) -> str:
    """The opcode of an instruction, its predicate ("@!P0 ") dropped."""
    parts = instruction.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def kind_counts(body) -> dict:
    counts = collections.Counter()
    for _, instruction in body:
        op = opcode(instruction)
        for kind, prefixes in KINDS:
            if op.startswith(prefixes):
                counts[kind] += 1
                break
    return {kind: counts[kind] for kind, _ in KINDS if counts[kind]}


def tensor_loops(instructions) -> list:
    """The loops (bodies of backward branches, innermost and outer alike) of one function's
    (address, instruction) list that hold a tensor-core instruction, in address order."""
    at = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, instruction) in enumerate(instructions):
        m = _BRANCH.search(instruction)
        if not m or opcode(instruction).split(".")[0] != "BRA":
            continue
        target = int(m.group(1), 16)
        if target > address or target not in at:
            continue
        body = instructions[at[target]:i + 1]
        kinds = kind_counts(body)
        if kinds.get("wgmma") or kinds.get("mma"):
            loops.append((target, address, len(body), kinds))
    return [Loop(*loop, not any(o is not loop and loop[0] <= o[0] and o[1] <= loop[1] for o in loops))
            for loop in sorted(loops)]


def variant_loops(task) -> tuple:
    """(name expression, {function: [Loop]} or an error line) of one variant on one arch."""
    source, expression, arch, cuobjdump = task
    cubin, lowered = sass_diff.compile_cubin(str(ROOT / "kernels"), source, [expression], arch)
    if cubin is None:
        return expression, f"build failed: {lowered.splitlines()[0] if lowered else ''}"
    with tempfile.TemporaryDirectory() as tmp:
        listing = sass_diff.disassemble(cuobjdump, cubin, Path(tmp), "v")
    return expression, {name: tensor_loops(body) for name, body in parse_functions(listing).items()}


def format_loops(expression: str, functions) -> str:
    if isinstance(functions, str):
        return f"{expression}: {functions}"
    lines = [expression]
    for loops in functions.values():
        for loop in loops:
            kinds = ", ".join(f"{n} {kind}" for kind, n in loop.kinds.items())
            inner = ", innermost" if loop.innermost else ""
            lines.append(f"    loop {loop.start:#x}-{loop.end:#x}{inner}: {loop.instructions} instructions ({kinds})")
    if len(lines) == 1:
        lines.append("    no loop with a tensor-core instruction")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--match", default=".", help="regular expression on the variants' name expressions")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    from cuflash import _config

    pattern = re.compile(args.match)
    variants = [v for v in _config.variants_for(args.arch) if pattern.search(v.name_expression)]
    if not variants:
        print(f"no variant for {args.arch} matches {args.match!r}")
        return 1
    cuobjdump = sass_diff.find_cuobjdump()
    tasks = [(v.source, v.name_expression, args.arch, cuobjdump) for v in variants]
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for expression, functions in pool.map(variant_loops, tasks):
            print(format_loops(expression, functions), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
