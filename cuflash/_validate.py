"""Opt-in checks of the values that live on the GPU: page tables, sequence lengths, cu_seqlens.

The kernels trust none of these values and never read out of bounds because of them, but they
do not report them: a length past the cache's capacity counts as the capacity, a page index
outside [0, num_pages) masks that page's keys, a packed-batch boundary outside [0, total] is
clamped and an end before its start is an empty sequence (kernels/flash_decode.cu,
kernels/slice.cuh). A server that builds a wrong table gets a wrong answer, not an error.

These checks raise a ValueError naming the argument, the first bad entry (its index and value)
and the bound it breaks. Each copies its array to the host, which waits for the GPU: a tool
for debugging, switched on by ``CUFLASH_VALIDATE=1`` in the environment (read once, at
import; see :func:`enabled`), which makes the CuPy and torch front ends run them before each
launch that reads such arrays, or called directly. While CuPy's or torch's current stream is
capturing a CUDA graph a host copy would break the capture, so the checks do nothing then; the
torch adapter does not run them while torch.compile traces, and cuflash.jax never does (its
launches run inside jax.jit, on traced arrays).

The arrays may be CuPy arrays, torch tensors, or anything NumPy reads (NumPy, JAX arrays).
"""

from __future__ import annotations

import os
import sys

import numpy as np

__all__ = ["enabled", "check_seqlens_k", "check_page_table", "check_cu_seqlens", "check_decode_inputs",
           "check_decode_choice", "check_varlen_inputs"]

_ENABLED = os.environ.get("CUFLASH_VALIDATE", "0") not in ("", "0")


def enabled() -> bool:
    """Whether ``CUFLASH_VALIDATE`` was set (to anything but 0) when cuflash was imported."""
    return _ENABLED


def _capturing() -> bool:
    """Whether CuPy's or torch's current stream is capturing a graph (a host copy would break
    the capture)."""
    cupy, torch = sys.modules.get("cupy"), sys.modules.get("torch")
    try:
        if cupy is not None and cupy.cuda.get_current_stream().is_capturing():
            return True
        return torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # no GPU or no driver: nothing can be capturing
        return False


def _host(x, name: str) -> np.ndarray:
    """``x`` as a NumPy array of integers (a device-to-host copy for a GPU array)."""
    if hasattr(x, "get") and not isinstance(x, np.ndarray):  # CuPy
        x = x.get()
    elif type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    host = np.asarray(x)
    if host.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {host.dtype}")
    return host


def _index(flat_index: int, shape) -> str:
    """'[i]' or '[i, j]' of the flat index into an array of ``shape``."""
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(flat_index, shape)) + "]"


def check_seqlens_k(lengths, *, capacity: int, name: str = "seqlens_k") -> None:
    """Every length in [0, capacity] (the keys a sequence's cache holds: Nk dense, max_pages
    x page_size paged); the kernels would count a length outside as the nearest bound."""
    if _capturing():
        return
    host = _host(lengths, name)
    bad = np.flatnonzero((host < 0) | (host > capacity))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}{_index(i, host.shape)} = {int(host.flat[i])} is outside [0, {capacity}] (the "
                         f"cache's capacity); {bad.size} of {host.size} lengths are")


def check_page_table(table, lengths, *, num_pages: int, page_size: int, name: str = "page_table") -> None:
    """Every entry a sequence reads (the first ceil(length / page_size) of its row, lengths
    clamped as the kernels clamp them) in [0, num_pages); the kernels would mask that page's
    keys. Entries past a sequence's last page are never read, so any value may stand there."""
    if _capturing():
        return
    host = _host(table, name)
    if host.ndim != 2:
        raise ValueError(f"{name} must have shape (batch, max_pages), got {host.shape}")
    lens = np.clip(_host(lengths, "seqlens_k").astype(np.int64), 0, host.shape[1] * page_size)
    if lens.shape != host.shape[:1]:
        raise ValueError(f"seqlens_k must have shape ({host.shape[0]},) for {name} {host.shape}, got {lens.shape}")
    used = np.arange(host.shape[1]) < -(-lens[:, None] // page_size)
    bad = np.flatnonzero(used & ((host < 0) | (host >= num_pages)))
    if bad.size:
        b, page = np.unravel_index(int(bad[0]), host.shape)
        raise ValueError(
            f"{name}[{b}, {page}] = {int(host[b, page])} is outside [0, {num_pages}) (the pages of the cache), "
            f"and sequence {b} of length {int(lens[b])} reads it for keys {page * page_size}.."
            f"{min((page + 1) * page_size, int(lens[b])) - 1}; {bad.size} entries in use are outside")


def check_cu_seqlens(boundaries, *, total: int, name: str = "cu_seqlens") -> None:
    """Boundaries in [0, total] (the packed rows) that never decrease; the kernels would clamp
    a boundary into [0, total] and take an end before its start as an empty sequence. Rows
    before the first boundary or after the last are allowed: they are left unwritten."""
    if _capturing():
        return
    host = _host(boundaries, name)
    if host.ndim != 1:
        raise ValueError(f"{name} must be 1-D (batch + 1,), got shape {host.shape}")
    outside = np.flatnonzero((host < 0) | (host > total))
    if outside.size:
        i = int(outside[0])
        raise ValueError(f"{name}[{i}] = {int(host[i])} is outside [0, {total}] (the packed rows); {outside.size} of "
                         f"{host.size} boundaries are")
    falling = np.flatnonzero(np.diff(host.astype(np.int64)) < 0)
    if falling.size:
        i = int(falling[0])
        raise ValueError(f"{name} must not decrease: {name}[{i + 1}] = {int(host[i + 1])} is less than {name}[{i}] = "
                         f"{int(host[i])} (sequence {i} would end before it starts)")


def check_decode_inputs(page_table=None, seqlens_k=None, *, capacity: int, num_pages: int = 0,
                        page_size: int = 0) -> None:
    """The checks of a decoding call: its lengths (when given) against the capacity, and with a
    page table the entries each sequence reads against the pool."""
    if seqlens_k is not None:
        check_seqlens_k(seqlens_k, capacity=capacity)
    if page_table is not None:
        if seqlens_k is None:
            raise ValueError("a paged cache needs seqlens_k to say which page-table entries are read")
        check_page_table(page_table, seqlens_k, num_pages=num_pages, page_size=page_size)


def check_decode_choice(choice, page_table, seqlens_k) -> None:
    """:func:`check_decode_inputs` against the cache a decoding plan was made for (a
    cuflash._decode.DecodeChoice: its capacity, its pool's pages and their size)."""
    check_decode_inputs(page_table, seqlens_k, capacity=choice.capacity, num_pages=choice.fields["num_pages"],
                        page_size=1 << choice.fields["page_shift"])


def check_varlen_inputs(cu_seqlens_q, cu_seqlens_k, *, total_q: int, total_k: int) -> None:
    """The checks of a packed batch's boundaries against q's and k's packed rows."""
    check_cu_seqlens(cu_seqlens_q, total=total_q, name="cu_seqlens_q")
    check_cu_seqlens(cu_seqlens_k, total=total_k, name="cu_seqlens_k")
