"""Argument checks shared by every entry point: each error names the argument and quotes the
shapes, strides or dtypes it was given. They run when a call signature is seen for the first
time (the plans cache what they decide: cuflash/_cache.py); only pointer alignment is checked
per call.
"""

from __future__ import annotations

import collections
import hashlib
import math
import threading
from typing import Optional, Tuple

import numpy as np

from . import _constants
from ._broadcast import broadcast_layout
from .masks import DEFAULT_BLOCK_SIZE, BlockMask, _block_pair, window_option

NO_WINDOW = (-1, -1)
_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


def check_head_dims(q_shape, k_shape, v_shape):
    """Validate the trailing (N, d) dims; returns (nq, nk, d, dv)."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) < 2:
            raise ValueError(f"{name} must have shape (..., N, head_dim), got {tuple(shape)}")
    nq, d = q_shape[-2:]
    nk, dk = k_shape[-2:]
    nv, dv = v_shape[-2:]
    if dk != d:
        raise ValueError(f"q and k head dims differ: q {tuple(q_shape)}, k {tuple(k_shape)}")
    if nv != nk:
        raise ValueError(f"k and v sequence lengths differ: k {tuple(k_shape)}, v {tuple(v_shape)}")
    for name, dim, shape in (("q/k", d, q_shape), ("v", dv, v_shape)):
        if dim < _constants.HEAD_DIM_MULTIPLE or dim % _constants.HEAD_DIM_MULTIPLE or dim > _constants.MAX_HEAD_DIM:
            raise ValueError(
                f"head dim of {name} must be a multiple of {_constants.HEAD_DIM_MULTIPLE} between "
                f"{_constants.HEAD_DIM_MULTIPLE} and {_constants.MAX_HEAD_DIM}, got {dim} (shape {tuple(shape)})"
            )
    return nq, nk, d, dv


_DTYPE_NAMES: dict = {}  # dtype object -> its NumPy name (np.dtype(t).name costs ~2 us a call)


def dtype_name(t) -> str:
    """NumPy's name of a NumPy / CuPy / JAX dtype or a torch dtype ('bfloat16' for both bfloat16s)."""
    try:
        name = _DTYPE_NAMES.get(t)
    except TypeError:  # an unhashable dtype-like: no caching
        return np.dtype(t).name
    if name is None:
        if type(t).__module__.startswith("torch"):
            name = str(t).rsplit(".", 1)[-1]
        else:
            name = np.dtype(t).name
        name = _DTYPE_NAMES.setdefault(t, name)
    return name


def check_dtypes(q_dtype, k_dtype, v_dtype) -> str:
    names = [dtype_name(t) for t in (q_dtype, k_dtype, v_dtype)]
    if len(set(names)) != 1:
        raise TypeError(f"q, k and v must share one dtype, got q {names[0]}, k {names[1]}, v {names[2]}")
    if names[0] not in _constants.SUPPORTED_DTYPES:
        raise TypeError(f"dtype {names[0]} is not supported; use one of {', '.join(_constants.SUPPORTED_DTYPES)}")
    return names[0]


def check_last_dim_contiguous(name, shape, strides):
    """``strides`` in elements."""
    if math.prod(shape) and shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"the last dim of {name} must be contiguous (stride 1), got shape {tuple(shape)} with "
            f"element strides {tuple(strides)}"
        )


def vector_stride_ok(shape, strides, itemsize) -> bool:
    """Whether the 16-bit kernels' 16-byte vector loads can walk these (element) strides."""
    per_vector = 16 // itemsize
    return all(s % per_vector == 0 for n, s in zip(shape[:-1], strides[:-1]) if n > 1)


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def vector_alignment_error(name, shape, strides, ptr, dtype: str) -> ValueError:
    """The error for a 16-bit operand whose address or strides break 16-byte vector loads."""
    return ValueError(
        f"{name} must be 16-byte aligned with strides that are multiples of {16 // _ITEMSIZE[dtype]} "
        f"elements for {dtype}; got shape {tuple(shape)}, element strides {tuple(strides)}, address "
        f"{ptr:#x} (a view that slices the head dim is not supported)"
    )


def itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]


def resolve_scale(scale, d):
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, (bool, np.bool_)):  # float(True) would pass as 1.0
        raise TypeError(f"scale must be a real number, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be finite and positive, got {scale!r}")
    return value


# ---- block masks and windows --------------------------------------------------------------

# Boolean arrays given as block_mask, converted to BlockMasks, by content: a caller that passes
# the same array every step pays the conversion (and the GPU copies of its lists) once.
_converted_masks: "collections.OrderedDict[tuple, BlockMask]" = collections.OrderedDict()
_converted_lock = threading.Lock()
_MAX_CONVERTED_MASKS = 16


def _host_blocks(block_mask) -> np.ndarray:
    """block_mask (NumPy, CuPy, or any array NumPy or DLPack can read) as a NumPy array."""
    on_gpu = hasattr(block_mask, "__cuda_array_interface__") or (
        hasattr(block_mask, "__dlpack_device__")
        and int(block_mask.__dlpack_device__()[0]) in _DLPACK_CUDA_DEVICES
    )
    if not on_gpu:
        return np.asarray(block_mask)
    import cupy

    if isinstance(block_mask, cupy.ndarray):
        return block_mask.get()
    if getattr(block_mask, "requires_grad", False):
        block_mask = block_mask.detach()
    return cupy.from_dlpack(block_mask).get()


def as_block_mask(block_mask, block_size=None) -> Optional[BlockMask]:
    """The BlockMask that ``block_mask=`` (with ``block_size=``) stands for, or None.

    A BlockMask passes through; block_size must then be left out or equal its block size.
    A boolean array (..., Tq, Tk) becomes ``BlockMask.from_dense(array, block_size)``, block
    size 128 by default; equal arrays give the same (cached) BlockMask.
    """
    if block_mask is None:
        if block_size is not None:
            raise ValueError(f"block_size={block_size!r} was given without a block_mask")
        return None
    if isinstance(block_mask, BlockMask):
        if block_size is not None and _block_pair(block_size) != block_mask.block_size:
            raise ValueError(
                f"block_size={block_size!r} differs from the block size {block_mask.block_size} "
                f"of the given {block_mask!r}; leave block_size out when passing a BlockMask"
            )
        return block_mask
    size = _block_pair(DEFAULT_BLOCK_SIZE if block_size is None else block_size)
    blocks = np.ascontiguousarray(_host_blocks(block_mask))
    key = (blocks.shape, blocks.dtype.str, size, hashlib.blake2b(blocks.tobytes(), digest_size=16).digest())
    with _converted_lock:
        mask = _converted_masks.get(key)
        if mask is not None:
            _converted_masks.move_to_end(key)
            return mask
    try:
        mask = BlockMask.from_dense(blocks, size)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"block_mask must be a cuflash.masks.BlockMask or a boolean array (..., Tq, Tk): {exc}"
        ) from None
    with _converted_lock:
        _converted_masks[key] = mask
        while len(_converted_masks) > _MAX_CONVERTED_MASKS:
            _converted_masks.popitem(last=False)
    return mask


def check_sparsity(block_mask, block_size, window, nq: int, nk: int, out_lead_shape) -> Tuple:
    """(BlockMask or None, (left, right) or None) for attention's block_mask / window arguments.

    The mask's grid must be exactly (ceil(Nq / bq), ceil(Nk / bk)) and its leading dims must
    broadcast to the output's, ``out_lead_shape``. A window of (-1, -1) is no window.
    """
    mask = as_block_mask(block_mask, block_size)
    if mask is not None:
        mask.check(nq, nk, batch_shape=tuple(out_lead_shape))
    return mask, window_option(window)


def layout_with_mask(qkv_strides, extras, mask):
    """broadcast_layout with the block mask as one more extra operand (the last), so that its
    leading dims take part in merging and get strides over the merged dims, counted in whole
    (Tq, Tk) slices: the kernel's mask-batch index, for the lists and the block bytes."""
    if mask is None:
        return broadcast_layout(*qkv_strides, extras=extras)
    batch = mask.batch_shape
    slice_strides = tuple(math.prod(batch[i + 1:]) for i in range(len(batch)))
    operand = (batch + mask.shape[-2:], slice_strides + (0, 0))
    try:
        return broadcast_layout(*qkv_strides, extras=tuple(extras) + (operand,))
    except ValueError as exc:
        raise ValueError(f"{exc}; with block_mask of shape {mask.shape}, whose leading dims must merge too") from None


def check_like_q(dtype: str, **dtypes):
    """The backward's dO and O must have q's dtype."""
    for name, t in dtypes.items():
        if dtype_name(t) != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}, got {dtype_name(t)}")


# ---- packed variable-length batches (varlen) --------------------------------------------------


def check_varlen_shapes(q_shape, k_shape, v_shape):
    """A varlen call's q (Hq, total_q, d), k (Hk, total_k, d), v (Hk, total_k, dv): three dims."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 3:
            raise ValueError(
                f"with cu_seqlens, {name} must have shape (heads, total_tokens, head_dim) (a (total, heads, "
                f"head_dim) tensor passes as .transpose(0, 1)), got {tuple(shape)}"
            )


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, device) -> int:
    """The number of sequences of a varlen call. Each argument is (shape, dtype name, device) of
    a cu_seqlens array, or None; ``device`` is q's. The values are never read here."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        given = "cu_seqlens_q" if cu_seqlens_k is None else "cu_seqlens_k"
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be given together; only {given} was given")
    for name, (shape, dtype, dev) in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if dtype != "int32" or len(shape) != 1 or shape[0] < 1:
            raise ValueError(
                f"{name} must be a 1-D int32 array of length batch + 1, got shape {tuple(shape)}, dtype {dtype}"
            )
        if dev != device:
            raise ValueError(f"{name} must be on q's device {device}, got device {dev}")
    if cu_seqlens_q[0] != cu_seqlens_k[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got shapes "
            f"{tuple(cu_seqlens_q[0])} and {tuple(cu_seqlens_k[0])}"
        )
    return cu_seqlens_q[0][0] - 1


def check_max_seqlen(name, value):
    """max_seqlen_q / max_seqlen_k: None (computed from the lengths) or a host int >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a host int (or None), got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_varlen_options(block_mask=None, page_table=None, seqlens_k=None, num_splits=None):
    """What a varlen call cannot be combined with."""
    if block_mask is not None:
        raise ValueError("block_mask cannot be combined with cu_seqlens_q / cu_seqlens_k (packed variable-length "
                         "batches); use window= or causal= for per-sequence masks")
    decoding = [n for n, x in (("page_table", page_table), ("seqlens_k", seqlens_k), ("num_splits", num_splits))
                if x is not None]
    if decoding:
        raise ValueError(f"{', '.join(decoding)} (the split-KV decoding path) cannot be combined with cu_seqlens_q / "
                         f"cu_seqlens_k (packed variable-length batches)")
