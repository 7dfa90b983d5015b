"""Compare the machine code of kernel variants between two versions of kernels/.

    python scripts/sass_diff.py BASE [HEAD] [--arch sm_80 sm_90a] [--source flash_fwd_sm90.cu ...]
                                [--jobs N]

BASE and HEAD are git revisions; HEAD defaults to the working tree. A kernel edit that leaves
a variant's SASS unchanged cannot change what that variant does on a GPU, so this shows on a
machine without one which variants an edit touched: a new switch whose default forms must stay
as they were, a parameter appended to FwdParams, a refactor. Both versions are compiled by the
same NVRTC for each architecture, disassembled with cuobjdump (``pip install
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``, or both on PATH) and compared function by
function, with instruction addresses, encodings and operand-reuse hints left out and the two
sources of float adds and multiplies in sorted order.

Identical machine code is proof; code that differs needs the GPU tests, even where only the
register allocation moved (seen here: a loop folded into a helper reallocated the forward's
accumulators). The base is built twice, because ptxas is not deterministic for every variant
(seen here: some of flash_bwd_kernel's, two builds of one source in one process, a few
registers apart); such a variant is reported 'unstable', with no verdict. The variants compared are the dispatcher's (cuflash._config of the checkout
running this), so a switch that is off by default can be shown to leave every default form as
it was. Exits 0 when every variant compared is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import difflib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cuflash import _config, _loader  # noqa: E402  (after the path set-up)

# "/*0a70*/  HMMA.16816.F32.BF16 R24, R4.reuse, R28, R24 ;  /* 0x... */": the instruction only.
_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENCODING = re.compile(r"/\* 0x[0-9a-f]+ \*/")
_FUNCTION = re.compile(r"Function : (\S+)")
_REUSE = re.compile(r"\.reuse\b")  # an operand-cache hint to the scheduler, not semantics
# "@P0 FADD.FTZ R1, -R2, R3 ;": float add and multiply commute exactly, so their two sources
# are compared in sorted order (ptxas swaps them between otherwise equal builds).
_COMMUTATIVE = re.compile(r"^((?:@!?U?P\w+ )?F(?:ADD|MUL)(?:\.\w+)* )(\S+), ([^,]+), ([^,;]+) ;$")


def normalized(instruction: str) -> str:
    """One disassembled instruction in the form the comparison uses."""
    instruction = _REUSE.sub("", instruction)
    if m := _COMMUTATIVE.match(instruction):
        op, dst, a, b = m.groups()
        a, b = sorted((a, b))
        instruction = f"{op}{dst}, {a}, {b} ;"
    return instruction


def find_cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(base).glob("*/bin/cuobjdump")):
            return str(candidate)
    raise FileNotFoundError("no cuobjdump: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def export_kernels(rev: str, into: Path) -> Path:
    """kernels/ of a git revision, written under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels"],
                             check=True, capture_output=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    path = into / "kernels.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into / "kernels"


def compile_cubin(kernel_dir: str, source: str, expressions, arch: str):
    """(cubin, {lowered name: expression}) for variants of one source, or (None, NVRTC's log)."""
    # The source hash only keys CuPy's disk cache; one value keeps the two builds alike.
    options = ["-std=c++17", f"-I{kernel_dir}", "-DCUFLASH_SRC_HASH=0", f"-arch={arch}"]
    try:
        _, lowered, cubin = _loader.nvrtc_build((Path(kernel_dir) / source).read_text(), source, expressions,
                                                options, want_cubin=True)
    except RuntimeError as exc:
        return None, str(exc)
    return cubin, lowered


def sass_by_function(cuobjdump: str, cubin: bytes, workdir: Path, tag: str) -> dict:
    """{function name: [normalized instruction]} of a cubin."""
    path = workdir / f"{tag}.cubin"
    path.write_bytes(cubin)
    # cuobjdump runs nvdisasm, which the wheels put beside it.
    env = dict(os.environ, PATH=os.pathsep.join((str(Path(cuobjdump).parent), os.environ.get("PATH", ""))))
    listing = subprocess.run([cuobjdump, "-sass", str(path)], check=True, capture_output=True, text=True,
                             env=env).stdout
    functions, current = {}, None
    for line in listing.splitlines():
        if m := _FUNCTION.search(line):
            current = functions.setdefault(m.group(1), [])
        elif current is not None:
            instruction = _ENCODING.sub("", _ADDRESS.sub("", line)).strip()
            if instruction:
                current.append(normalized(instruction))
    return functions


def _compare_chunk(task):
    """[(expression, status, detail lines)] for one chunk of one source on one architecture."""
    base_dir, head_dir, source, expressions, arch, cuobjdump = task
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        # The base twice: ptxas does not always allocate registers alike for one source, and a
        # variant whose own two builds differ proves nothing either way.
        for tag, kernel_dir in (("base", base_dir), ("again", base_dir), ("head", head_dir)):
            cubin, lowered = compile_cubin(kernel_dir, source, expressions, arch)
            if cubin is None:
                side = "base" if tag == "again" else tag
                return [(expr, f"{side} does not build", lowered.strip().splitlines()[-1:]) for expr in expressions]
            sass = sass_by_function(cuobjdump, cubin, Path(tmp), tag)
            sides[tag] = {expr: sass.get(name) for name, expr in lowered.items()}
    rows = []
    for expr in expressions:
        base, head = sides["base"][expr], sides["head"][expr]
        if base is None or head is None:
            rows.append((expr, "missing", ["no SASS for it on one side"]))
        elif base != sides["again"][expr]:
            rows.append((expr, "unstable", ["two builds of the base differ: no verdict"]))
        elif base == head:
            rows.append((expr, "identical", [f"{len(head)} instructions"]))
        else:
            diff = [line for line in difflib.unified_diff(base, head, n=0, lineterm="")
                    if line[:1] in "+-" and line[:3] not in ("---", "+++")]
            rows.append((expr, "differs", [f"{len(base)} -> {len(head)} instructions, {len(diff)} lines differ"]
                         + diff[:6]))
    return rows


def compare(base_dir, head_dir, variants_by_arch: dict, jobs: int = 1, chunk: int = 1):
    """[(arch, expression, status, detail lines)] for {arch: [variant]}, base against head;
    status is 'identical', 'differs', 'unstable' (the base's own two builds differ), 'missing'
    or '<side> does not build'.

    chunk: variants compiled in one NVRTC program. cuflash builds one a module, and so does
    this by default: kernels of one module share its internal subroutines (the 64-bit
    division, say), whose code and placement then depend on the other kernels, so a sparse
    variant's edit showed as a change in dense ones built beside it."""
    cuobjdump = find_cuobjdump()
    tasks = []
    for arch, variants in variants_by_arch.items():
        by_source = collections.defaultdict(dict)
        for variant in variants:
            by_source[variant.source][variant.name_expression] = None
        for source, exprs in sorted(by_source.items()):
            exprs = list(exprs)
            tasks += [(str(base_dir), str(head_dir), source, exprs[i:i + chunk], arch, cuobjdump)
                      for i in range(0, len(exprs), chunk)]
    if jobs > 1 and len(tasks) > 1:
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(tasks))) as pool:
            results = list(pool.map(_compare_chunk, tasks))
    else:
        results = [_compare_chunk(task) for task in tasks]
    return [(task[4], *row) for task, rows in zip(tasks, results) for row in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="git revision of the kernels to compare against")
    parser.add_argument("head", nargs="?", default=None, help="git revision (default: the working tree)")
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90a"])
    parser.add_argument("--source", nargs="+", default=None, help="only these kernels/*.cu files")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--chunk", type=int, default=1,
                        help="variants a program (1, as cuflash builds them; more is faster but couples them)")
    args = parser.parse_args(argv)
    variants = {arch: [v for v in _config.variants_for(arch) if args.source is None or v.source in args.source]
                for arch in args.arch}
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = export_kernels(args.base, Path(tmp) / "base")
        head_dir = ROOT / "kernels" if args.head is None else export_kernels(args.head, Path(tmp) / "head")
        rows = compare(base_dir, head_dir, variants, jobs=args.jobs, chunk=args.chunk)
    counts = collections.Counter(status for _, _, status, _ in rows)
    for arch, expr, status, detail in rows:
        if status != "identical":
            print(f"{status.upper()}: {arch} {expr}: " + "\n    ".join(detail))
    print(f"{len(rows)} variant builds, {args.base} against {args.head or 'the working tree'}: "
          + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    return 0 if rows and counts["identical"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
