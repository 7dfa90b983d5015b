"""The driver side of a launch: CUDA driver calls, device facts, bound kernels and tensor maps.

A plan (cuflash/_forward.py, _backward.py, _decode.py) binds each of its launches once as a
:class:`Kernel`: the compiled function, its grid and shared memory, and parameter blocks that a
call rewrites in place (the driver copies them at launch). :class:`Context` runs launches in the
plan's device context, :class:`Maps` keeps a launch's tensor maps. Nothing here chooses a
kernel: that is cuflash/_config.py's, from the plans' signatures.
"""

from __future__ import annotations

import ctypes
import functools
import struct

from . import _loader, _tma

# ---- the driver ------------------------------------------------------------------------------


class _Driver:
    """The driver calls a plan makes. Launches, memsets and the current-context query go through
    CuPy's compiled bindings (3.5 us a launch on an H200 machine, against 5.0 us through ctypes:
    bench/NOTES.md, Host time and plans); pushing and popping a context, which CuPy does not
    bind, through ctypes."""

    def __init__(self):
        from cupy_backends.cuda.api import driver, runtime

        self._launch, self._memset = driver.launchKernel, runtime.memsetAsync
        self.current_context = driver.ctxGetCurrent  # compiled (through ctypes, with its out-parameter: 0.73 us)
        self._errors = (driver.CUDADriverError, runtime.CUDARuntimeError)
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuCtxPopCurrent_v2.argtypes = (ctypes.POINTER(ctypes.c_void_p),)
        lib.cuCtxPushCurrent_v2.argtypes = (ctypes.c_void_p,)
        lib.cuGetErrorName.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self.cuCtxPushCurrent_v2 = lib.cuCtxPushCurrent_v2
        self.cuCtxPopCurrent_v2, self.cuGetErrorName = lib.cuCtxPopCurrent_v2, lib.cuGetErrorName

    def launch_kernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv) -> int:
        """cuLaunchKernel with ``argv`` the address of the parameter pointers; the status."""
        try:
            self._launch(func, gx, gy, gz, bx, by, bz, smem, stream, argv, 0)
        except self._errors as exc:
            return exc.status
        return 0

    def memset_async(self, ptr, nbytes, stream) -> int:
        """Zero ``nbytes`` at ``ptr`` on ``stream``; the status."""
        try:
            self._memset(ptr, 0, nbytes, stream)
        except self._errors as exc:
            return exc.status
        return 0


@functools.lru_cache(maxsize=1)
def driver() -> _Driver:
    return _Driver()


def check(status: int, what: str):
    if status:
        name = ctypes.c_char_p()
        driver().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({status})")


@functools.lru_cache(maxsize=None)
def device_context(device_id: int) -> int:
    """The primary context of a device (what CuPy, torch and XLA run in)."""
    import cupy

    with cupy.cuda.Device(device_id):
        cupy.cuda.runtime.free(0)  # makes the primary context current on this thread
        return driver().current_context()


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> str:
    import cupy

    return cupy.cuda.Device(device_id).compute_capability


def words(data: bytes):
    """A parameter block: ``data`` in an 8-byte-aligned ctypes buffer the launch points at."""
    block = (ctypes.c_uint64 * (-(-len(data) // 8)))()
    ctypes.memmove(block, data, len(data))
    return block


class Kernel:
    """One launch with its arguments bound: a CUfunction, its grid, and parameter blocks that
    the plan's ``run`` updates in place (the driver copies them at launch)."""

    __slots__ = ("variant", "func", "grid", "block", "smem", "params", "argv", "argv_ptr", "lists")

    def __init__(self, variant, device_id: int, grid, params, d: int = 0, dv: int = 0):
        raw = _loader.get_kernel(variant, device(device_id))
        smem = variant.smem_bytes(d, dv)
        if smem > 48 * 1024 and raw.max_dynamic_shared_size_bytes < smem:
            raw.max_dynamic_shared_size_bytes = smem
        self.variant = variant
        self.func = raw.kernel.ptr
        self.grid = tuple(int(g) for g in grid)
        self.block = (variant.threads, 1, 1)
        self.smem = smem
        self.params = params  # keeps the blocks alive for argv
        self.argv = (ctypes.c_void_p * len(params))(*(ctypes.addressof(p) for p in params))
        self.argv_ptr = ctypes.addressof(self.argv)
        self.lists = None  # block-sparse tile lists on the device, kept alive with the launch

    def launch(self, drv, stream):
        status = drv.launch_kernel(self.func, *self.grid, *self.block, self.smem, stream, self.argv_ptr)
        if status:  # the message (the variant's key) is built only for an error
            check(status, f"launching {self.variant.key}")


def device(device_id):
    import cupy

    return cupy.cuda.Device(device_id)



class Context:
    """Runs launches in a plan's device context: pushed for the call when another is current."""

    __slots__ = ("ctx", "pushed")

    def __init__(self, ctx):
        self.ctx = ctx

    def __enter__(self):
        drv = driver()
        self.pushed = drv.current_context() != self.ctx
        if self.pushed:
            check(drv.cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")
        return drv

    def __exit__(self, *exc):
        if self.pushed:
            driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


# ---- tensor maps -----------------------------------------------------------------------------


class Maps:
    """A kernel's tensor maps (struct Sm90Maps: q, k, v; Bwd90Maps: q, k, v, dO) for one plan,
    whose only per-call content is the global addresses. Where the driver's encoding is seen to
    hold the address as its first 8 bytes and nothing else changes with it (checked per geometry
    by encoding two addresses), a call writes the addresses into a template; otherwise maps are
    encoded per pointer tuple and kept (``_KEPT`` of them), so an unchanged (pointer, shape,
    strides) is never encoded again."""

    _KEPT = 64
    _MAP_WORDS = _tma.MAP_BYTES // 8

    def __init__(self, geometries, ptrs, param_bytes=_tma.PARAM_BYTES):
        self.geometries = geometries  # (cols, rows, row_stride, stride, count, box) a map
        raws = [_tma.encode(p, *g) for p, g in zip(ptrs, geometries)]
        self.ok = all(r is not None for r in raws)
        if not self.ok:
            return
        self.block = words(_tma.param_block(raws, geometries, param_bytes))
        self.patchable = all(_address_is_patchable(raw, p, g) for raw, p, g in zip(raws, ptrs, geometries))
        self.address_words = slice(0, self._MAP_WORDS * len(geometries), self._MAP_WORDS)
        self.encoded = {tuple(ptrs): b"".join(raws)}

    def bind(self, ptrs):
        block = self.block
        if self.patchable:
            block[self.address_words] = ptrs
            return True
        raw = self.encoded.get(ptrs)
        if raw is None:
            parts = [_tma.encode(p, *g) for p, g in zip(ptrs, self.geometries)]
            if any(r is None for r in parts):
                return False
            raw = b"".join(parts)
            if len(self.encoded) >= self._KEPT:
                self.encoded.pop(next(iter(self.encoded)))
            self.encoded[ptrs] = raw
        ctypes.memmove(block, raw, len(raw))
        return True


def _address_is_patchable(raw: bytes, ptr: int, geometry) -> bool:
    other = ptr + 4096
    raw2 = _tma.encode(other, *geometry)
    return (raw2 is not None and raw[8:] == raw2[8:]
            and struct.unpack_from("<Q", raw)[0] == ptr and struct.unpack_from("<Q", raw2)[0] == other)
