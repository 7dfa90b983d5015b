"""Compilation of the CUDA sources: the one module that owns it.

Sources live in ``kernels/`` (shipped inside the wheel as ``cuflash/kernels``). They are compiled
at run time by NVRTC through ``cupy.RawModule`` with one name expression per template variant,
and memoized per (device, source, variant). CuPy's disk cache keys on the source text and the
options only, not on ``#include``d headers, so a hash of every file in ``kernels/`` is passed as
``-DCUFLASH_SRC_HASH=...``: editing a header changes the key.

``compile_offline`` builds variants for a named architecture without a GPU or a driver
(NVRTC only), returning ptxas's register and spill report; ``python -m cuflash.compile_check``
runs it over every variant.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from pathlib import Path

from . import _variants


def _find_kernel_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):  # wheel, then source tree
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cuflash kernels not found next to {here}")


KERNEL_DIR = _find_kernel_dir()


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def read_source(name: str) -> str:
    return (KERNEL_DIR / name).read_text()


def base_options() -> tuple:
    """The options of every build: the include path, the numbers the kernels take from
    Python as defines (``_variants.kernel_defines()``: they are part of CuPy's disk-cache key
    like every option), and the source hash."""
    defines = tuple(f"-D{name}={value}" for name, value in _variants.kernel_defines().items())
    return ("-std=c++17", f"-I{KERNEL_DIR}", *defines, f"-DCUFLASH_SRC_HASH={source_hash()}")


def arch_options(compute_capability: str) -> tuple:
    """wgmma/setmaxnreg need the architecture-specific sm_90a target on Hopper."""
    return ("-arch=sm_90a",) if compute_capability == "90" else ()


_modules: dict = {}
_modules_lock = threading.Lock()


def get_kernel(variant, device=None):
    """The compiled ``cupy.RawKernel`` of a variant (from cuflash._variants) on a device."""
    import cupy

    device = device or cupy.cuda.Device()
    key = (device.id, variant.source, variant.name_expression)
    kernel = _modules.get(key)
    if kernel is not None:
        return kernel
    with _modules_lock:  # first use from several threads compiles once
        kernel = _modules.get(key)
        if kernel is None:
            options = base_options() + arch_options(device.compute_capability)
            with device:
                module = cupy.RawModule(
                    code=read_source(variant.source),
                    options=options,
                    name_expressions=[variant.name_expression],
                )
                kernel = module.get_function(variant.name_expression)
            _modules[key] = kernel
    return kernel


_PTXAS_FUNC = re.compile(r"Compiling entry function '(\S+)' for '(\S+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
# ptxas's wgmma performance notes, e.g. "(C7514) Potential Performance Loss: wgmma.mma_async
# instructions are serialized due to ..." or "(C7519) warpgroup.arrive is injected ...".
_PTXAS_WGMMA_NOTE = re.compile(r"\((C75\d\d)\).*?function '(\S+?)'")
# The notes that say every wgmma of the kernel is serialized: an accumulator read in flight
# (C7514), a dependence on a compiler-inserted wait (WG.DP) on a divergent path (C7518), a
# compiler-inserted warpgroup.arrive on a divergent path (C7520).
SERIALIZED_WGMMA = ("C7514", "C7518", "C7520")


def serializes_wgmma(report: dict) -> bool:
    """Whether a compile_offline report carries a note that ptxas serialized every wgmma."""
    return any(code in SERIALIZED_WGMMA for code in report["wgmma_notes"])


def _whole_elf(cubin: bytes) -> bytes:
    """CuPy's getCUBIN drops the image's last byte (it treats the image like a C string), which
    cuts the ELF's program-header table short; pad the image to the size its header gives."""
    import struct

    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + bytes(max(0, size - len(cubin)))


def nvrtc_build(text: str, name: str, name_expressions, options, want_cubin: bool = False):
    """Build one program with NVRTC alone (no GPU, no driver): (log, {lowered name:
    expression}, cubin or None). Raises RuntimeError with NVRTC's log on a compile error."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(text, name, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, list(options))
        except Exception as exc:  # NVRTCError carries only the status; the log has the reason
            raise RuntimeError(f"NVRTC failed for {name}:\n{nvrtc.getProgramLog(prog)}") from exc
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, expr): expr for expr in name_expressions}
        return log, lowered, _whole_elf(nvrtc.getCUBIN(prog)) if want_cubin else None
    finally:
        nvrtc.destroyProgram(prog)


def compile_offline(source: str, name_expressions, arch: str):
    """Compile variants of one source for ``arch`` (e.g. 'sm_80', 'sm_90a') with NVRTC alone.

    Returns {name_expression: {'registers', 'stack', 'spill_stores', 'spill_loads',
    'wgmma_notes'}} (wgmma_notes: the codes of ptxas's wgmma performance notes, such as
    SERIALIZED_WGMMA); raises RuntimeError with NVRTC's log on a compile error.
    """
    options = list(base_options()) + [f"-arch={arch}", "--ptxas-options=-v"]
    log, lowered, _ = nvrtc_build(read_source(source), f"{source} ({arch})", name_expressions, options)
    report, current = {}, None
    notes = {}
    for line in log.replace("\0", "").splitlines():
        if m := _PTXAS_WGMMA_NOTE.search(line):
            notes.setdefault(lowered.get(m.group(2)), set()).add(m.group(1))
        elif m := _PTXAS_FUNC.search(line):
            current = lowered.get(m.group(1))
            if current is not None:
                report[current] = {"wgmma_notes": ()}
        elif current is not None and (m := _PTXAS_SPILL.search(line)):
            stack, stores, loads = map(int, m.groups())
            report[current].update(stack=stack, spill_stores=stores, spill_loads=loads)
        elif current is not None and (m := _PTXAS_REGS.search(line)):
            report[current]["registers"] = int(m.group(1))
    for expr, codes in notes.items():
        if expr in report:
            report[expr]["wgmma_notes"] = tuple(sorted(codes))
    missing = set(name_expressions) - set(report)
    if missing:
        raise RuntimeError(f"ptxas printed no report for {sorted(missing)}:\n{log}")
    return report
