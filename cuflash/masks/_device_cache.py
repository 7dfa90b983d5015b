"""The per-mask caches of tile lists, and their one-time upload to a GPU."""

from __future__ import annotations

import threading

_MAX_CACHED_LISTS = 32  # per mask; a mask is normally used at a handful of (length, tile) sizes


_CACHE_LOCK = threading.Lock()  # masks are shared between threads that launch at once


def _remember(cache: dict, key, value, *, bounded: bool = True):
    """cache[key] = value, dropping the oldest entry past _MAX_CACHED_LISTS when bounded.

    Device lists are not bounded: dropping one could free memory a kernel queued on another
    stream is still reading, and they are a few bytes per tile.
    """
    with _CACHE_LOCK:
        if bounded and len(cache) >= _MAX_CACHED_LISTS:
            cache.pop(next(iter(cache)), None)
        return cache.setdefault(key, value)


def _upload(arrays, device_id: int):
    """CuPy copies of NumPy arrays on a device, complete when this returns.

    The copies live as long as the mask, so they come from CuPy's default pool rather than
    whatever allocator the current call installed (torch's, under cuflash.torch); the
    stream is synchronised once so that later launches on any stream see finished copies.
    """
    import cupy

    with cupy.cuda.Device(device_id):
        with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            copies = tuple(cupy.asarray(a) for a in arrays)
        cupy.cuda.get_current_stream().synchronize()
    return copies
