"""Tensor maps for the Hopper kernels' bulk tensor copies (TMA), encoded through the driver.

``cuTensorMapEncodeTiled`` is called through ctypes on ``libcuda`` (no extra dependency): a
CUDA driver is present wherever a kernel can run. Each of q, k, v (and the backward's dO) is
described as a 3-D tensor (head dim, rows, slices): a (batch..., head) slice of it starts at a
multiple of the slice stride, the greatest common divisor of its leading strides, and the
kernel computes which multiple from the same offsets the cp.async path uses. Rows past a
slice's end are zero-filled by the copy engine, so ragged tiles never read the next slice. A
packed (varlen) batch's slice is a head, whose rows hold every sequence: there a ragged tile
reads the next sequence's rows, which the kernels mask.

A tensor the copy engine cannot describe (a stride that is not a multiple of 16 bytes, a
driver that refuses the encoding) gets ``None``; the caller then runs the cp.async variant.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
from typing import Optional


_UINT16 = 1  # CU_TENSOR_MAP_DATA_TYPE_UINT16: bf16 and fp16 are copied as 16-bit words
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_OOB_FILL_ZERO = 0
MAP_BYTES = 128
BOX_COLS = 64  # one 128-byte swizzle row of 16-bit elements


@functools.lru_cache(maxsize=1)
def _encoder():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    return fn


def slice_stride(lead_shape, strides, kv_group: int = 1) -> tuple:
    """(stride, count) in elements: the gcd of the nonzero leading strides, and how many
    multiples of it the offsets span (the tensor map's slice dim). ``kv_group`` divides the
    last dim's extent (grouped heads read head h // kv_group)."""
    extents = list(lead_shape)
    if extents:
        extents[-1] = max(1, extents[-1] // kv_group)
    nonzero = [s for n, s in zip(extents, strides) if s and n > 1]
    if not nonzero:
        return 1, 1
    stride = functools.reduce(math.gcd, nonzero)
    span = sum((n - 1) * s for n, s in zip(extents, strides))
    return stride, span // stride + 1


def encode(ptr: int, cols: int, rows: int, row_stride: int, stride: int, count: int,
           box_rows: int) -> Optional[bytes]:
    """The 128 bytes of a tensor map over (cols, rows, count slices) of 16-bit elements with
    element strides row_stride and stride, read in boxes of (64, box_rows, 1); None when the
    copy engine cannot take it."""
    if count == 1:  # the slice stride is never stepped: any the copy engine takes will do
        stride = -(-(row_stride * rows) // 8) * 8
    if ptr % 16 or (2 * row_stride) % 16 or (2 * stride) % 16 or cols % BOX_COLS:
        return None
    out = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 3)(cols, rows, count)
    strides = (ctypes.c_uint64 * 2)(2 * row_stride, 2 * stride)
    box = (ctypes.c_uint32 * 3)(BOX_COLS, box_rows, 1)
    ones = (ctypes.c_uint32 * 3)(1, 1, 1)
    try:
        status = _encoder()(ctypes.byref(out), _UINT16, 3, ctypes.c_void_p(ptr), dims, strides, box, ones,
                            _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZERO)
    except OSError:  # no driver library
        return None
    return bytes(out) if status == 0 else None


# struct Sm90Maps in kernels/sm90.cuh: three maps (q, k, v), then their slice strides
# (elements); struct Bwd90Maps: four (q, k, v, dO), then theirs. Each is rounded up to the
# struct's 64-byte alignment (a static_assert checks it).
PARAM_BYTES = 448  # 3 * 128 + 24
BWD_PARAM_BYTES = 576  # 4 * 128 + 32


def param_block(raws, geometries, param_bytes: int) -> bytes:
    """The maps' parameter block: the encoded maps, then each one's slice stride."""
    payload = b"".join(raws) + struct.pack(f"<{len(geometries)}q", *(g[3] for g in geometries))
    return payload + bytes(param_bytes - len(payload))


def geometries(nq: int, nk: int, d: int, layout, row_strides, block_rows: int, block_cols: int) -> tuple:
    """The arguments of ``encode`` after the pointer, for q, k and v of one forward launch:
    (cols, rows, row_stride, slice stride, slice count, box rows). They depend on the call's
    signature only; the forward's plan (cuflash/_forward.py) keeps them."""
    out = []
    for n, strides, group, box, row_stride in ((nq, layout.q_strides, 1, block_rows, row_strides[0]),
                                               (nk, layout.k_strides, layout.kv_group, block_cols, row_strides[1]),
                                               (nk, layout.v_strides, layout.kv_group, block_cols, row_strides[2])):
        stride, count = slice_stride(layout.lead_shape, strides, group)
        out.append((d, n, row_stride, stride, count, box))
    return tuple(out)


def backward_geometries(nq: int, nk: int, d: int, layout, row_strides, do_strides, block_rows: int,
                        block_cols: int) -> tuple:
    """``geometries`` for the wgmma backward's q, k, v and dO: q and dO in boxes of block_rows
    (a query tile), k and v in boxes of block_cols (the CTA's keys); do_strides: dO's strides
    over the layout's leading dims, then its row stride."""
    q, k, v = geometries(nq, nk, d, layout, row_strides, block_rows, block_cols)
    stride, count = slice_stride(layout.lead_shape, do_strides[:-1])
    return q, k, v, (d, nq, do_strides[-1], stride, count, block_rows)
