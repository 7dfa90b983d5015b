"""Compare the machine code of kernel variants between two versions of kernels/.

    python scripts/sass_diff.py BASE [HEAD] [--arch sm_80 sm_90a] [--source flash_fwd_sm90.cu ...]
                                [--sample N] [--jobs N]

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
accumulators). The base is built twice, because the build is not deterministic for every
variant: some of flash_bwd_kernel's come out a few registers apart from two builds of one
source in one process, and already their PTX differs (795-1869 lines of it, with NVRTC's
per-build internal-name hash set aside); such a variant is reported 'unstable', with no
verdict, and one whose two base builds happened to agree can still show as 'differs'.

The variants compared are the dispatcher's, HEAD's ``cuflash._config``, each built from its own
side's name expression and compile options (``_loader.base_options()``, the defines Python
passes to the kernels included). A HEAD variant is paired with the BASE variant of the same
class and the same values of the fields both sides have; a field only one side has must be at
its default there: a deleted switch compares as off, and a new switch's default forms compare
with the variants they replace (its other forms are 'new', no verdict). So keys, name expressions and template parameters may change,
and a deleted switch can be shown to leave every default form as it was. Exits 0 when every
variant compared is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import difflib
import json
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

from cuflash import _loader  # noqa: E402  (after the path set-up)

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


def export_tree(rev: str, into: Path) -> Path:
    """kernels/ and cuflash/ of a git revision, written under ``into`` (returned)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels", "cuflash"],
                             check=True, capture_output=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    path = into / "tree.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into


# Run in a fresh interpreter inside a tree (its cuflash, not this checkout's): its compile
# options and, per architecture, every variant as (class, fields, defaults of the fields,
# source, name expression).
_DESCRIBE = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from cuflash import _config, _loader
def describe(v):
    fields = dataclasses.fields(v)
    return {"cls": type(v).__name__, "fields": {f.name: getattr(v, f.name) for f in fields},
            "defaults": {f.name: f.default for f in fields if f.default is not dataclasses.MISSING},
            "source": v.source, "expr": v.name_expression}
json.dump({"options": list(_loader.base_options()),
           "variants": {arch: [describe(v) for v in _config.variants_for(arch)] for arch in sys.argv[2:]}},
          sys.stdout)
"""


def describe_tree(tree: Path, archs) -> dict:
    """{'options': [...], 'variants': {arch: [description]}} of the cuflash inside ``tree``."""
    out = subprocess.run([sys.executable, "-c", _DESCRIBE, str(tree), *archs], cwd=tree, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def pair_variants(base: list, head: list) -> list:
    """[(source, base expression or None, head expression)] for descriptions of the variants of
    one architecture on both sides (see the module docstring for the pairing)."""
    def identity(d, names):
        return d["cls"], tuple((name, d["fields"][name]) for name in sorted(names))

    base_fields = {b["cls"]: set(b["fields"]) for b in base}
    head_fields = {h["cls"]: set(h["fields"]) for h in head}
    common = {cls: fields & head_fields[cls] for cls, fields in base_fields.items() if cls in head_fields}
    index = {}
    for b in base:
        if b["cls"] in common:
            dropped = base_fields[b["cls"]] - common[b["cls"]]
            if all(name in b["defaults"] and b["fields"][name] == b["defaults"][name] for name in dropped):
                index[identity(b, common[b["cls"]])] = b["expr"]
    pairs = []
    for h in head:
        shared = common.get(h["cls"])
        added = head_fields[h["cls"]] - (shared or set())
        at_default = all(name in h["defaults"] and h["fields"][name] == h["defaults"][name] for name in added)
        paired = index.get(identity(h, shared)) if shared is not None and at_default else None
        pairs.append((h["source"], paired, h["expr"]))
    return pairs


def sample(pairs: list, most) -> list:
    """At most ``most`` of each kernel template's pairs (all for None), evenly spaced over its
    list, so that a sample keeps its first forms and some of every switch after them."""
    if most is None:
        return pairs
    by_kernel = collections.defaultdict(list)
    for pair in pairs:
        by_kernel[pair[2].split("<")[0]].append(pair)
    kept = set()
    for group in by_kernel.values():
        step = max(1.0, len(group) / most)
        kept.update(id(group[int(i * step)]) for i in range(min(most, len(group))))
    return [pair for pair in pairs if id(pair) in kept]


def build_options(options, kernel_dir) -> list:
    """A side's compile options for these builds: its include path pointed at ``kernel_dir``,
    and the source hash (it only keys CuPy's disk cache) one value on both sides."""
    out = []
    for option in options:
        if option.startswith("-DCUFLASH_SRC_HASH="):
            option = "-DCUFLASH_SRC_HASH=0"
        elif option.startswith("-I"):
            option = f"-I{kernel_dir}"
        out.append(option)
    return out


def compile_cubin(kernel_dir: str, source: str, expressions, arch: str, options=None):
    """(cubin, {lowered name: expression}) for variants of one source, or (None, NVRTC's log);
    ``options`` default to this checkout's."""
    options = build_options(_loader.base_options() if options is None else options, kernel_dir)
    options.append(f"-arch={arch}")
    try:
        _, lowered, cubin = _loader.nvrtc_build((Path(kernel_dir) / source).read_text(), source, expressions,
                                                options, want_cubin=True)
    except RuntimeError as exc:
        return None, str(exc)
    return cubin, lowered


def disassemble(cuobjdump: str, cubin: bytes, workdir: Path, tag: str) -> str:
    """cuobjdump -sass's listing of a cubin (written to ``workdir`` as ``tag``.cubin)."""
    path = workdir / f"{tag}.cubin"
    path.write_bytes(cubin)
    # cuobjdump runs nvdisasm, which the wheels put beside it.
    env = dict(os.environ, PATH=os.pathsep.join((str(Path(cuobjdump).parent), os.environ.get("PATH", ""))))
    return subprocess.run([cuobjdump, "-sass", str(path)], check=True, capture_output=True, text=True,
                          env=env).stdout


def split_functions(listing: str, parse) -> dict:
    """{function name: [parse(line), ...]} of a cuobjdump -sass listing: each function's lines
    after its header, those that ``parse`` maps to None left out."""
    functions, current = {}, None
    for line in listing.splitlines():
        if m := _FUNCTION.search(line):
            current = functions.setdefault(m.group(1), [])
        elif current is not None and (item := parse(line)) is not None:
            current.append(item)
    return functions


def _normalized_line(line: str):
    instruction = _ENCODING.sub("", _ADDRESS.sub("", line)).strip()
    return normalized(instruction) if instruction else None


def sass_by_function(cuobjdump: str, cubin: bytes, workdir: Path, tag: str) -> dict:
    """{function name: [normalized instruction]} of a cubin."""
    return split_functions(disassemble(cuobjdump, cubin, workdir, tag), _normalized_line)


def _compare_chunk(task):
    """[(head expression, status, detail lines)] for one chunk of (base expression, head
    expression) pairs of one source on one architecture."""
    base_dir, head_dir, source, pairs, arch, cuobjdump, base_options, head_options = task
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        # The base twice: ptxas does not always allocate registers alike for one source, and a
        # variant whose own two builds differ proves nothing either way.
        for tag, kernel_dir, options, side in (("base", base_dir, base_options, 0), ("again", base_dir, base_options, 0),
                                               ("head", head_dir, head_options, 1)):
            expressions = [pair[side] for pair in pairs]
            cubin, lowered = compile_cubin(kernel_dir, source, expressions, arch, options)
            if cubin is None:
                side = "base" if tag == "again" else tag
                return [(head, f"{side} does not build", lowered.strip().splitlines()[-1:]) for _, head in pairs]
            sass = sass_by_function(cuobjdump, cubin, Path(tmp), tag)
            sides[tag] = {expr: sass.get(name) for name, expr in lowered.items()}
    rows = []
    for base_expr, expr in pairs:
        base, head = sides["base"][base_expr], sides["head"][expr]
        if base is None or head is None:
            rows.append((expr, "missing", ["no SASS for it on one side"]))
        elif base != sides["again"][base_expr]:
            rows.append((expr, "unstable", ["two builds of the base differ: no verdict"]))
        elif base == head:
            rows.append((expr, "identical", [f"{len(head)} instructions"]))
        else:
            diff = [line for line in difflib.unified_diff(base, head, n=0, lineterm="")
                    if line[:1] in "+-" and line[:3] not in ("---", "+++")]
            rows.append((expr, "differs", [f"{len(base)} -> {len(head)} instructions, {len(diff)} lines differ"]
                         + diff[:6]))
    return rows


def compare(base_dir, head_dir, pairs_by_arch: dict, jobs: int = 1, chunk: int = 1, base_options=None,
            head_options=None):
    """[(arch, head expression, status, detail lines)] for {arch: [(source, base expression,
    head expression)]}, base against head, each side with its compile options (default: this
    checkout's); status is 'identical', 'differs', 'unstable' (the base's own two builds
    differ), 'new' (no base expression: no verdict), 'missing' or '<side> does not build'.

    chunk: variants compiled in one NVRTC program. cuflash builds one a module, and so does
    this by default: kernels of one module share its internal subroutines (the 64-bit
    division, say), whose code and placement then depend on the other kernels, so a sparse
    variant's edit showed as a change in dense ones built beside it."""
    cuobjdump = find_cuobjdump()
    tasks, unpaired = [], []
    for arch, pairs in pairs_by_arch.items():
        by_source = collections.defaultdict(dict)
        for source, base_expr, head_expr in pairs:
            if base_expr is None:
                unpaired.append((arch, head_expr, "new", ["no base variant with these fields: no verdict"]))
            else:
                by_source[source][(base_expr, head_expr)] = None
        for source, source_pairs in sorted(by_source.items()):
            source_pairs = list(source_pairs)
            tasks += [(str(base_dir), str(head_dir), source, source_pairs[i:i + chunk], arch, cuobjdump,
                       base_options, head_options)
                      for i in range(0, len(source_pairs), chunk)]
    if jobs > 1 and len(tasks) > 1:
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(tasks))) as pool:
            results = list(pool.map(_compare_chunk, tasks))
    else:
        results = [_compare_chunk(task) for task in tasks]
    return [(task[4], *row) for task, rows in zip(tasks, results) for row in rows] + unpaired


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="git revision of the kernels to compare against")
    parser.add_argument("head", nargs="?", default=None, help="git revision (default: the working tree)")
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90a"])
    parser.add_argument("--source", nargs="+", default=None, help="only these kernels/*.cu files")
    parser.add_argument("--sample", type=int, default=None,
                        help="at most N variants of each source and architecture, spread over its list")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--chunk", type=int, default=1,
                        help="variants a program (1, as cuflash builds them; more is faster but couples them)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = export_tree(args.base, Path(tmp) / "base")
        head_tree = ROOT if args.head is None else export_tree(args.head, Path(tmp) / "head")
        base, head = describe_tree(base_tree, args.arch), describe_tree(head_tree, args.arch)
        pairs = {arch: sample([pair for pair in pair_variants(base["variants"][arch], head["variants"][arch])
                               if args.source is None or pair[0] in args.source], args.sample)
                 for arch in args.arch}
        rows = compare(base_tree / "kernels", head_tree / "kernels", pairs, jobs=args.jobs, chunk=args.chunk,
                       base_options=base["options"], head_options=head["options"])
    counts = collections.Counter(status for _, _, status, _ in rows)
    for arch, expr, status, detail in rows:
        if status != "identical":
            print(f"{status.upper()}: {arch} {expr}: " + "\n    ".join(detail))
    print(f"{len(rows)} variant builds, {args.base} against {args.head or 'the working tree'}: "
          + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    return 0 if rows and counts["identical"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
