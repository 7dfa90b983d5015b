"""Sorts a racecheck log's race reports into writes of asynchronous copies, which racecheck cannot
order, and every other race.

    python scripts/racecheck_hazards.py --cubins DIR LOG [LOG ...]

racecheck orders shared-memory accesses by the barriers it tracks (__syncthreads, named barriers,
__syncwarp, mbarrier arrive / wait) and cp.async's commit / wait groups. The wgmma key pass fills
its ring of Q, dO and the row statistics with copies that complete on an mbarrier (TMA: bulk
copies counted by its transaction bytes; cp.async: `cp.async.mbarrier.arrive.noinc`), which
racecheck does not order against the consumers' reads: the reads of the statistics (LDS) are
reported against the copies' writes (bench/NOTES.md, Tools: Sanitizer, for the instructions, the
protocol that orders them and compute-sanitizer's own notes).

A report ("Race reported between Write access at KERNEL+0xW and Read access at KERNEL+0xR [n
hazards] ...") names a dispatcher variant (cuflash._config.all_variants); its cubin as it ran,
DIR/<key>.cubin (what scripts/sanitize_cases.py --cubins writes from CuPy's kernel cache), is
disassembled and each offset looked up:

  async copy   every write offset is a copy into shared memory (ASYNC_COPIES), or next to one
               (the instruction before or after it) and no memory access itself, and every
               read offset is a thread's memory access;
  other        anything else, also a report whose kernel is no dispatcher variant or has no
               cubin, and one whose offsets are no memory accesses in it.

Prints one line per report and the counts last. Exits 1 when a report is 'other', when a
racecheck process did not display every hazard (its --print-limit) or stopped recording them
(its hazard limit: later launches went unchecked), since what a log does not show cannot be
sorted; 0 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(SCRIPTS.parent), str(SCRIPTS)]  # cuflash, and the disassembly scripts beside this one

import sass_loops  # noqa: E402  (after the path set-up)
from sass_loops import sass_diff  # noqa: E402

from cuflash import _config  # noqa: E402

# "========= Error: Race reported between Write access at void k<...>(...)+0xf680" and the lines
# after it, "=========     and Read access at void k<...>(...)+0x31a0 [64 hazards]" (a source
# location " in file.cu:12" may follow the offset where the build has line information).
_FIRST = re.compile(r"(?:Error|Warning): Race reported between (Write|Read) access at (.+)\+0x([0-9a-f]+)")
_MORE = re.compile(r"^=+\s+and (Write|Read) access at (.+)\+0x([0-9a-f]+)(?: in \S+)? \[(\d+) hazards?\]")
_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
HAZARD_LIMIT = "Maximum number of hazards reached"

# Copies into shared memory that a thread issues and that complete later: cp.async (LDGSTS),
# cp.async.bulk from global (UBLKCP.S.G) and cp.async.bulk.tensor (UTMALDG).
ASYNC_COPIES = ("LDGSTS", "UBLKCP.S", "UTMALDG")
# A thread's own loads, stores and atomics, shared (LDS...) or generic (LD, ST, ATOM).
MEMORY_ACCESSES = ("LDS", "LDSM", "STS", "STSM", "ATOMS", "LD.", "ST.", "ATOM.", "LD ", "ST ")
INSTRUCTION_BYTES = 16


class Access(NamedTuple):
    kind: str  # "Write" or "Read"
    kernel: str  # as racecheck prints it (demangled)
    offset: int
    hazards: int  # 0 on a report's first line, which has no count


class Log(NamedTuple):
    reports: list  # [[Access, ...]], one list a report
    displayed: int  # hazards the processes displayed (their SUMMARY lines) ...
    total: int  # ... of the errors and warnings they counted
    hazard_limit: int  # processes that stopped recording hazards


def parse_log(text: str) -> Log:
    reports, displayed, total, limit = [], 0, 0, 0
    for line in text.splitlines():
        if m := _FIRST.search(line):
            reports.append([Access(m.group(1), m.group(2).strip(), int(m.group(3), 16), 0)])
        elif (m := _MORE.search(line)) and reports:
            reports[-1].append(Access(m.group(1), m.group(2).strip(), int(m.group(3), 16), int(m.group(4))))
        elif m := _SUMMARY.search(line):
            displayed += int(m.group(1))
            total += int(m.group(2)) + int(m.group(3))
        elif HAZARD_LIMIT in line:
            limit += 1
    return Log(reports, displayed, total, limit)


def name_expression(kernel: str) -> str:
    """A kernel as racecheck prints it ('void cuflash::k<cuflash::T<cuflash::bf16, (int)128,
    (bool)1>>(cuflash::FwdParams)') or a variant's name expression ('cuflash::k<cuflash::T<
    /*dtype*/ cuflash::bf16, /*head_dim*/ 128, /*causal*/ true>>') in one form, comments and
    spaces dropped ('cuflash::k<cuflash::T<cuflash::bf16,128,true>>')."""
    name = kernel[len("void "):] if kernel.startswith("void ") else kernel
    name = re.sub(r"/\*.*?\*/", "", name)
    name = name[:name.rindex(">(") + 1] if ">(" in name else name
    name = name.replace("(bool)1", "true").replace("(bool)0", "false")
    name = re.sub(r"\((?:unsigned )?(?:int|long|long long|short|char)\)", "", name)
    return name.replace(" ", "")


def variant_names() -> dict:
    """{name expression as name_expression() gives it: variant key} of every variant of every
    kind of GPU."""
    kinds = ((True, True), (True, False), (False, False))  # (hopper, wgmma)
    return {name_expression(v.name_expression): v.key for h, w in kinds for v in _config.all_variants(h, w)}


def kernel_sass(cubin: Path, workdir: Path) -> dict:
    """{address: instruction} of the one kernel in ``cubin``, or an error line."""
    functions = sass_loops.parse_functions(sass_diff.disassemble(sass_diff.find_cuobjdump(), cubin.read_bytes(),
                                                                 workdir, cubin.stem))
    if len(functions) != 1:
        return f"{len(functions)} functions in {cubin.name}"
    return dict(next(iter(functions.values())))


def _is(instruction, prefixes) -> bool:
    return instruction is not None and sass_loops.opcode(instruction).startswith(prefixes)


def classify(report, sass) -> tuple:
    """('async copy' or 'other', why) of one report, ``sass`` {address: instruction} of its
    kernel's build (or an error line)."""
    if isinstance(sass, str):
        return "other", sass
    why = []
    for access in report:
        at = sass.get(access.offset)
        if access.kind == "Read":
            if not _is(at, MEMORY_ACCESSES):
                return "other", f"read at {access.offset:#x} is no memory access ({at}): not the run's build?"
            why.append(sass_loops.opcode(at))
            continue
        around = [sass.get(access.offset + step) for step in (-INSTRUCTION_BYTES, 0, INSTRUCTION_BYTES)]
        copies = [sass_loops.opcode(i) for i in around if _is(i, ASYNC_COPIES)]
        if _is(at, MEMORY_ACCESSES) or not copies:
            return "other", f"write at {access.offset:#x}: {at}"
        why.append(f"write {'/'.join(copies)}")
    counts = collections.Counter(why)
    return "async copy", ", ".join(f"{n} x {op}" if n > 1 else op for op, n in counts.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--cubins", type=Path, required=True, help="the variants' cubins as they ran, <key>.cubin")
    args = parser.parse_args(argv)
    log = Log([], 0, 0, 0)
    for path in args.logs:
        part = parse_log(path.read_text(errors="replace"))
        log = Log(log.reports + part.reports, log.displayed + part.displayed, log.total + part.total,
                  log.hazard_limit + part.hazard_limit)

    keys = variant_names()
    sass = {}
    verdicts, hazards, variants = collections.Counter(), collections.Counter(), collections.defaultdict(set)
    with tempfile.TemporaryDirectory() as tmp:
        for report in log.reports:
            names = {name_expression(a.kernel) for a in report}
            key = keys.get(next(iter(names))) if len(names) == 1 else None
            cubin = args.cubins / f"{key}.cubin"
            if key is None:
                verdict, why, key = "other", "no one dispatcher variant of this name", report[0].kernel
            elif not cubin.exists():
                verdict, why = "other", f"no cubin {cubin}"
            else:
                if key not in sass:
                    sass[key] = kernel_sass(cubin, Path(tmp))
                verdict, why = classify(report, sass[key])
            verdicts[verdict] += 1
            hazards[verdict] += sum(a.hazards for a in report)
            variants[verdict].add(key)
            print(f"{verdict}: {key} +{report[0].offset:#x}: {why}")
    unseen = log.total - log.displayed
    problems = ([f"{verdicts['other']} other races"] if verdicts["other"] else []) + (
        [f"{unseen} hazards not displayed (--print-limit)"] if unseen else []) + (
        [f"{log.hazard_limit} processes reached racecheck's hazard limit (what ran after it is unchecked)"]
        if log.hazard_limit else [])
    print(f"race reports {len(log.reports)}: {verdicts['async copy']} of async-copy writes racecheck cannot order "
          f"({hazards['async copy']} hazards, {len(variants['async copy'])} variants), {verdicts['other']} other "
          f"({hazards['other']} hazards)" + (f"; FAILED: {'; '.join(problems)}" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
