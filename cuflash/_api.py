"""cuflash.attention: argument checking, broadcasting, and the kernel launch."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import math
import struct
import threading
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from . import _config, _loader, _tma, _views
from .masks import DEFAULT_BLOCK_SIZE, BlockMask, _block_pair, window_option

MAX_LEAD_DIMS = 4  # kMaxLead in kernels/common.cuh


class AttentionOutput(NamedTuple):
    """What :func:`attention` returns.

    o: (..., Nq, dv), q's dtype.  l, m: (..., Nq), float32, where S = scale * q k^T with masked
    entries excluded, ``m = max_j S``, ``l = sum_j exp(S - m)``; ``m + log(l)`` is the
    log-sum-exp. A row with no allowed key has o = 0, l = 0, m = -inf.
    """

    o: Any
    l: Any
    m: Any


# ---- inputs ------------------------------------------------------------------------------

_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


def as_cupy(x, name: str):
    """Take a GPU array zero-copy as a cupy.ndarray, or raise TypeError naming ``name``."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} is a NumPy array (host memory, shape {x.shape}, dtype {x.dtype}); cuflash "
            f"needs a GPU array: pass cupy.asarray({name}) or a CUDA tensor"
        )
    if hasattr(x, "__dlpack__"):
        if _views.is_cuda_tensor(x) and not x.requires_grad:
            return _views.torch_view(x)
        if hasattr(x, "__dlpack_device__"):
            dev_type, _ = x.__dlpack_device__()
            if int(dev_type) not in _DLPACK_CUDA_DEVICES:
                raise TypeError(
                    f"{name} ({type(x).__module__}.{type(x).__name__}) lives on DLPack device "
                    f"type {int(dev_type)}, not on a CUDA GPU"
                )
        if getattr(x, "requires_grad", False):
            raise TypeError(
                f"{name} is a torch tensor that requires grad; use cuflash.torch.attention for "
                f"autograd, or pass {name}.detach()"
            )
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(
        f"{name} must be a GPU array (cupy.ndarray or an object exporting __dlpack__ or "
        f"__cuda_array_interface__), got {type(x).__module__}.{type(x).__name__}"
    )


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
        if dim < _config.HEAD_DIM_MULTIPLE or dim % _config.HEAD_DIM_MULTIPLE or dim > _config.MAX_HEAD_DIM:
            raise ValueError(
                f"head dim of {name} must be a multiple of {_config.HEAD_DIM_MULTIPLE} between "
                f"{_config.HEAD_DIM_MULTIPLE} and {_config.MAX_HEAD_DIM}, got {dim} (shape {tuple(shape)})"
            )
    return nq, nk, d, dv


_DTYPE_NAMES: dict = {}  # dtype object -> its NumPy name (np.dtype(t).name costs ~2 us a call)


def _dtype_name(t) -> str:
    try:
        name = _DTYPE_NAMES.get(t)
    except TypeError:  # an unhashable dtype-like: no caching
        return np.dtype(t).name
    if name is None:
        name = _DTYPE_NAMES.setdefault(t, np.dtype(t).name)
    return name


def check_dtypes(q_dtype, k_dtype, v_dtype) -> str:
    names = [_dtype_name(t) for t in (q_dtype, k_dtype, v_dtype)]
    if len(set(names)) != 1:
        raise TypeError(f"q, k and v must share one dtype, got q {names[0]}, k {names[1]}, v {names[2]}")
    if names[0] not in _config.SUPPORTED_DTYPES:
        raise TypeError(f"dtype {names[0]} is not supported; use one of {', '.join(_config.SUPPORTED_DTYPES)}")
    return names[0]


class BatchLayout(NamedTuple):
    lead_shape: tuple  # output leading dims, after merging (at most MAX_LEAD_DIMS)
    out_lead_shape: tuple  # output leading dims as the user sees them
    q_strides: tuple  # element strides per merged dim, 0 where broadcast
    k_strides: tuple
    v_strides: tuple
    kv_group: int  # q heads per k/v head in the last dim
    extra_strides: tuple = ()  # per extra tensor (dO, O in the backward), like q_strides


@functools.lru_cache(maxsize=256)  # a training loop asks for the same few layouts every step
def broadcast_layout(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, extras=()) -> BatchLayout:
    """Broadcast the leading (batch) dims of q, k, v; strides are in elements (all tuples).

    NumPy's rules, plus grouped heads: when k/v's last leading dim Hk > 1 divides q's Hq
    (and differs), q head h reads k/v head h // (Hq // Hk). ``extras`` are (shape, strides)
    of tensors whose leading dims are exactly the output's (dO and O in the backward); they
    take part in merging dims and get their own strides.
    """
    lq, lk, lv = (tuple(s[:-2]) for s in (q_shape, k_shape, v_shape))
    try:
        lkv = np.broadcast_shapes(lk, lv)
    except ValueError:
        raise ValueError(
            f"leading dims of k and v do not broadcast: k {tuple(k_shape)}, v {tuple(v_shape)}"
        ) from None
    hq = lq[-1] if lq else 1
    hkv = lkv[-1] if lkv else 1
    group = hq // hkv if (hkv > 1 and hq != hkv and hq % hkv == 0) else 1
    lkv_as_q = lkv[:-1] + (hq,) if group > 1 else lkv
    try:
        out = tuple(np.broadcast_shapes(lq, lkv_as_q))
    except ValueError:
        raise ValueError(
            f"leading dims of q, k, v do not broadcast: q {tuple(q_shape)}, k {tuple(k_shape)}, "
            f"v {tuple(v_shape)} (grouped heads need q's heads to be a multiple of k's)"
        ) from None
    rank = len(out)

    def aligned(shape, strides):
        shape, strides = tuple(shape[:-2]), tuple(strides[:-2])
        pad = rank - len(shape)
        # a missing or size-1 dim is broadcast: every output coordinate reads the same slice
        return [0 if i < pad or shape[i - pad] == 1 else strides[i - pad] for i in range(rank)]

    per_tensor = [aligned(s, st) for s, st in ((q_shape, q_strides), (k_shape, k_strides),
                                              (v_shape, v_strides), *extras)]
    # Drop size-1 dims and merge neighbours whose strides nest, so that any rank usually fits.
    # A grouped head dim stays on its own: the kernel divides its coordinate for k and v.
    dims = [[out[i]] + [st[i] for st in per_tensor] for i in range(rank) if out[i] != 1]
    keep_last = group > 1
    merged: list = []
    for i, dim in enumerate(dims):
        if merged and not (keep_last and i == len(dims) - 1):
            prev = merged[-1]
            if all(prev[t] == dim[t] * dim[0] for t in range(1, len(dim))):
                merged[-1] = [prev[0] * dim[0]] + dim[1:]
                continue
        merged.append(list(dim))
    if len(merged) > MAX_LEAD_DIMS:
        raise ValueError(
            f"cuflash supports at most {MAX_LEAD_DIMS} leading dims that cannot be merged, got "
            f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}"
        )
    merged = [[1] + [0] * len(per_tensor)] * (MAX_LEAD_DIMS - len(merged)) + merged
    cols = [tuple(c) for c in zip(*merged)]
    return BatchLayout(cols[0], out, cols[1], cols[2], cols[3], group, tuple(cols[4:]))


def _element_strides(x, name):
    itemsize = x.dtype.itemsize
    strides = tuple(s // itemsize for s in x.strides)
    if x.size and x.shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"the last dim of {name} must be contiguous (stride 1), got shape {x.shape} with "
            f"element strides {strides}"
        )
    return strides


def _check_vector_alignment(x, name, strides):
    """The 16-bit kernels read 16-byte vectors: pointer and row/batch strides must allow it."""
    per_vector = 16 // x.dtype.itemsize
    bad = [s for dim, s in zip(x.shape[:-1], strides[:-1]) if dim > 1 and s % per_vector]
    if x.data.ptr % 16 or bad:
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of {per_vector} "
            f"elements for {x.dtype}; got shape {x.shape}, element strides {strides}, address "
            f"{x.data.ptr:#x} (a view that slices the head dim is not supported)"
        )


def _resolve_scale(scale, d):
    if scale is None:
        return 1.0 / math.sqrt(d)
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be finite and positive, got {scale!r}")
    return value


# Field order of struct FwdParams in kernels/common.cuh (every member 8 bytes; tests/
# test_validation.py counts the header's members against this).
_FWD_PARAM_FORMAT = "<" + "".join((
    "Q" * 6,                    # q, k, v, o, l, m
    "q" * 4 + "q",              # nq, nk, d, dv; num_batch
    "q" * (4 * MAX_LEAD_DIMS),  # lead_shape, q/k/v_lead_stride
    "q" * 3 + "q",              # q/k/v_row_stride; kv_group
    "dd",                       # scale, scale_log2
    "qq",                       # window_left, window_right
    "QQQ",                      # tile_counts, tile_lists, blocks
    "qq" + "q" * 4,             # n_outer, list_stride; block_q, block_k, mask_tq, mask_tk
    "q" * MAX_LEAD_DIMS,        # mask_lead_stride
))
NO_WINDOW = (-1, -1)
# The block-sparsity fields of a dense launch: null lists, so the kernel walks every tile.
_DENSE_TILES = (0,) * (3 + 2 + 4 + MAX_LEAD_DIMS)
_DENSE_SPARSITY = NO_WINDOW + _DENSE_TILES  # everything after scale_log2


def _pack_forward_params(q, k, v, o, l, m, nq, nk, d, dv, layout, row_strides, scale,
                         sparsity=_DENSE_SPARSITY):
    """struct FwdParams as bytes; sparsity: the fields after scale_log2 (_sparsity_fields)."""
    num_batch = math.prod(layout.lead_shape)
    values = (
        q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr,
        nq, nk, d, dv, num_batch,
        *layout.lead_shape, *layout.q_strides, *layout.k_strides, *layout.v_strides,
        *row_strides, layout.kv_group, scale, scale * math.log2(math.e), *sparsity,
    )
    return np.void(struct.pack(_FWD_PARAM_FORMAT, *values))


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
    return as_cupy(block_mask, "block_mask").get() if on_gpu else np.asarray(block_mask)


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


def _layout_with_mask(qkv_strides, extras, mask) -> BatchLayout:
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


def _sparsity_fields(mask, mask_strides, nq, nk, variant, *, transpose, causal, window):
    """The FwdParams fields after scale_log2 for one launch of ``variant``.

    transpose: the launch walks key tiles (the backward's key passes). Without a mask the
    lists are null (a dense launch, the window still applies). The lists come from the mask's
    per-device cache: after the first call with these sizes, no conversion and no copy.
    """
    if mask is None:
        return (*(window or NO_WINDOW), *_DENSE_TILES)
    tiles = mask.device_tile_lists(nq, nk, variant.block_rows, variant.block_cols, transpose=transpose,
                                   causal=causal, window=window)
    return (
        *(window or NO_WINDOW),
        tiles.counts.data.ptr, tiles.lists.data.ptr, tiles.blocks.data.ptr, tiles.n_outer, tiles.list_stride,
        *mask.block_size, *mask.shape[-2:], *mask_strides,
    )


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


# id(kernel) -> (kernel, the dynamic shared memory it has been allowed): reading the attribute
# back is a driver call on every launch. The entry holds the kernel, so that its id cannot be
# reused by another kernel while the entry stands (a test that swaps _loader's cache out drops
# the kernels it built).
_smem_allowed: dict = {}


def _launch(variant, grid_x, num_batch, args, d, dv, grid=None):
    """Launch a variant over grid_x tiles for every (batch..., head) slice, on the current
    stream; ``grid``: a persistent kernel's own grid instead."""
    kernel = _loader.get_kernel(variant)
    smem = variant.smem_bytes(d, dv)
    allowed = _smem_allowed.get(id(kernel))
    if smem > 48 * 1024 and (allowed is None or allowed[1] < smem):
        if kernel.max_dynamic_shared_size_bytes < smem:
            kernel.max_dynamic_shared_size_bytes = smem
        _smem_allowed[id(kernel)] = (kernel, smem)
    if grid is None:
        grid_y = min(num_batch, 65535)  # y is limited to 65535: the rest goes to z
        if -(-num_batch // grid_y) > 65535:
            raise ValueError(f"{num_batch} (batch..., head) slices exceed the {65535 ** 2} a launch grid can hold")
        grid = (grid_x, grid_y, -(-num_batch // grid_y))
    kernel(grid, (variant.threads,), args, shared_mem=smem)


def attention(q, k, v, *, causal: bool = False, scale=None, block_mask=None, block_size=None,
              window=None) -> AttentionOutput:
    """Exact scaled dot-product attention, computed tile by tile (FlashAttention).

    Args:
        q: (..., Nq, d) query. k: (..., Nk, d) keys. v: (..., Nk, dv) values. CuPy arrays or
            any CUDA array exporting ``__dlpack__`` / ``__cuda_array_interface__`` (PyTorch,
            JAX), taken without a copy. One dtype for all three: float16, bfloat16 or float32.
            d and dv: multiples of 8 up to 256. Only the last dim must be contiguous: strided
            views such as ``x.swapaxes(-2, -3)`` of a (B, N, H, d) array are read in place.
            Leading dims broadcast by NumPy's rules; if q has Hq heads (last leading dim) and
            k/v have Hk that divides Hq, q head h uses k/v head h // (Hq // Hk) (GQA / MQA).
        causal: mask key j for query i when j > i + (Nk - Nq), i.e. aligned at the bottom
            right. For Nq = 2, Nk = 5 (1 = attended)::

                1 1 1 1 0
                1 1 1 1 1

            and for Nq = 5, Nk = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A row with no allowed key gets o = 0, l = 0, m = -inf.
        scale: multiplies q k^T; defaults to 1 / sqrt(d). Must be finite and positive.
        block_mask: block-sparse attention (the paper's Algorithm 5). A
            :class:`cuflash.masks.BlockMask` of shape (..., Tq, Tk) with block size (bq, bk),
            or a boolean array of that shape (NumPy or CuPy; True = block present) together
            with ``block_size``. Key j is masked for query i unless block
            (i // bq, j // bk) is present; the grid must be exactly
            (ceil(Nq / bq), ceil(Nk / bk)), and the leading dims broadcast to the output's
            (per head: Hq of them, after grouping). Absent tiles are skipped, not computed.
            Build a BlockMask once and reuse it: its per-tile lists and their GPU copies are
            cached on it (equal boolean arrays share one cached conversion too).
        block_size: with a boolean block_mask, an int or (bq, bk); default 128.
        window: (left, right) sliding window, bottom-right aligned like causal: query i sees
            key j iff i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right; -1 leaves a side
            unbounded, so (-1, 0) is causal and (w, 0) causal with w keys of look-back.
            Combines with ``causal`` and ``block_mask`` (a key must pass all three).

    Returns:
        AttentionOutput(o, l, m) of CuPy arrays: o (..., Nq, dv) in q's dtype, l and m
        (..., Nq) float32, with S = scale * q k^T: m = max_j S, l = sum_j exp(S - m),
        o = softmax(S) v. The work runs on CuPy's current stream.

    Example:
        >>> q = cupy.random.randn(2, 8, 1024, 64, dtype=cupy.float32).astype(cupy.float16)
        >>> o, l, m = cuflash.attention(q, q, q, causal=True)
        >>> lse = m + cupy.log(l)
        >>> mask = cuflash.masks.butterfly(8)   # 8 x 8 blocks of 128 x 128
        >>> o, l, m = cuflash.attention(q, q, q, block_mask=mask, window=(256, 0))
    """
    import cupy

    q, k, v = as_cupy(q, "q"), as_cupy(k, "k"), as_cupy(v, "v")
    dtype = check_dtypes(q.dtype, k.dtype, v.dtype)
    devices = {x.device.id for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k and v must be on one device, got devices q {q.device.id}, "
                         f"k {k.device.id}, v {v.device.id}")
    nq, nk, d, dv = check_head_dims(q.shape, k.shape, v.shape)
    strides = {name: _element_strides(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    qkv_strides = (q.shape, strides["q"], k.shape, strides["k"], v.shape, strides["v"])
    layout = broadcast_layout(*qkv_strides)
    scale = _resolve_scale(scale, d)
    mask, window = check_sparsity(block_mask, block_size, window, nq, nk, layout.out_lead_shape)
    if mask is not None:
        layout = _layout_with_mask(qkv_strides, (), mask)

    with q.device:
        o = cupy.empty(layout.out_lead_shape + (nq, dv), dtype=q.dtype)
        l = cupy.empty(layout.out_lead_shape + (nq,), dtype=cupy.float32)
        m = cupy.empty(layout.out_lead_shape + (nq,), dtype=cupy.float32)
        num_batch = math.prod(layout.lead_shape)
        if num_batch == 0 or nq == 0:
            return AttentionOutput(o, l, m)
        if dtype != "float32":
            for name, x in (("q", q), ("k", k), ("v", v)):
                _check_vector_alignment(x, name, strides[name])
        variant = _config.forward_config(dtype, d, dv, causal, sparse=mask is not None,
                                         wgmma=_config.has_wgmma(q.device.compute_capability), nq=nq)
        row_strides = (strides["q"][-2], strides["k"][-2], strides["v"][-2])
        mask_strides = layout.extra_strides[-1] if mask is not None else ()
        sparsity = _sparsity_fields(mask, mask_strides, nq, nk, variant, transpose=False, causal=causal, window=window)
        params = _pack_forward_params(q, k, v, o, l, m, nq, nk, d, dv, layout, row_strides, scale, sparsity)
        args, grid = (params,), None
        n_q_tiles = -(-nq // variant.block_rows)
        if isinstance(variant, _config.HopperForward):
            maps = _tma.forward_maps(q, k, v, nq, nk, d, layout, row_strides, variant.block_rows,
                                     variant.block_cols) if variant.tma else None
            if maps is None:  # the copy engine cannot map these inputs: the cp.async form
                variant = dataclasses.replace(variant, tma=False)
                maps = _tma.empty_maps()
            args = (params, maps)
            if variant.persistent and n_q_tiles * num_batch >= 2**31:  # its item count is 32-bit
                variant = dataclasses.replace(variant, persistent=False)
            if variant.persistent:
                grid = (min(n_q_tiles * num_batch, _sm_count(q.device.id)), 1, 1)
        _launch(variant, n_q_tiles, num_batch, args, d, dv, grid=grid)
    return AttentionOutput(o, l, m)


class AttentionGradients(NamedTuple):
    """What :func:`attention_backward` returns: dq, dk, dv shaped and typed like q, k, v."""

    dq: Any
    dk: Any
    dv: Any


# Field order of struct BwdParams in kernels/common.cuh (every member 8 bytes).
_BWD_PARAM_FORMAT = "<" + "Q" * 9 + "q" + "q" * (2 * 4) + "qq" + "q"


def _reduce_to(grad, out_lead, shape, group):
    """Sum a gradient laid out over the output's leading dims back to an input's shape.

    Grouped heads first (output head h came from input head h // group), then NumPy
    broadcasting in reverse: dims the input lacked or had as 1 are summed.
    """
    tail = grad.shape[len(out_lead):]
    if group > 1:
        out_lead = out_lead[:-1] + (out_lead[-1] // group,)
        grad = grad.reshape(out_lead + (group,) + tail).sum(axis=len(out_lead))
    lead = tuple(shape[:-2])
    missing = len(out_lead) - len(lead)
    axes = tuple(range(missing)) + tuple(
        missing + i for i, n in enumerate(lead) if n == 1 and out_lead[missing + i] != 1
    )
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)


def attention_backward(do, q, k, v, o, l, m, *, causal: bool = False, scale=None,
                       deterministic: bool = False, block_mask=None, block_size=None,
                       window=None) -> AttentionGradients:
    """Gradients of :func:`attention`, recomputing S and P tile by tile (no N x N buffer).

    Args:
        do: (..., Nq, dv) gradient of the loss with respect to o; o's shape, q's dtype.
        q, k, v: the forward's inputs (same shapes, strides, broadcasting and grouped heads).
        o, l, m: what :func:`attention` returned for them (l, m float32, C-contiguous).
        causal, scale, block_mask, block_size, window: as given to the forward.
        deterministic: bit-identical gradients across runs. The default accumulates dQ with
            float atomics across key tiles; ``True`` computes dQ in a separate pass that
            recomputes S and dP per query tile (two more matmuls, no atomics). float32 is
            always deterministic.

    Returns:
        AttentionGradients(dq, dk, dv) of CuPy arrays with q's, k's and v's shapes and dtype.
        Gradients of broadcast or grouped k / v (and q) are summed over the broadcast
        positions. Extra device memory is O(N): float32 accumulators for dq, dk, dv (over
        the output's leading dims) and three float32 statistics per query row.

    Example:
        >>> o, l, m = cuflash.attention(q, k, v, causal=True)
        >>> dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, l, m, causal=True)
    """
    import cupy

    names = ("do", "q", "k", "v", "o", "l", "m")
    do, q, k, v, o, l, m = (as_cupy(x, n) for x, n in zip((do, q, k, v, o, l, m), names))
    dtype = check_dtypes(q.dtype, k.dtype, v.dtype)
    for name, x in (("do", do), ("o", o)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}, got {np.dtype(x.dtype).name}")
    devices = {x.device.id for x in (do, q, k, v, o, l, m)}
    if len(devices) != 1:
        raise ValueError(f"all arguments must be on one device, got devices {sorted(devices)}")
    nq, nk, d, dv = check_head_dims(q.shape, k.shape, v.shape)
    arrays = {"q": q, "k": k, "v": v, "do": do, "o": o}
    strides = {name: _element_strides(x, name) for name, x in arrays.items()}
    qkv_strides = (q.shape, strides["q"], k.shape, strides["k"], v.shape, strides["v"])
    out_shape = broadcast_layout(*qkv_strides).out_lead_shape + (nq, dv)
    for name, x in (("do", do), ("o", o)):
        if tuple(x.shape) != out_shape:
            raise ValueError(f"{name} must have the forward output's shape {out_shape}, got {tuple(x.shape)}")
    mask, window = check_sparsity(block_mask, block_size, window, nq, nk, out_shape[:-2])
    layout = _layout_with_mask(qkv_strides, ((do.shape, strides["do"]), (o.shape, strides["o"])), mask)
    for name, x in (("l", l), ("m", m)):
        if tuple(x.shape) != out_shape[:-1] or x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(
                f"{name} must be the forward's C-contiguous float32 array of shape {out_shape[:-1]}, "
                f"got shape {tuple(x.shape)}, dtype {np.dtype(x.dtype).name}, "
                f"contiguous {x.flags.c_contiguous}"
            )
    scale = _resolve_scale(scale, d)

    with q.device:
        num_batch = math.prod(layout.lead_shape)
        if num_batch == 0 or nq == 0 or nk == 0:  # no query sees a key: every gradient is 0
            return AttentionGradients(*(cupy.zeros(x.shape, x.dtype) for x in (q, k, v)))
        if dtype != "float32":
            for name, x in arrays.items():
                _check_vector_alignment(x, name, strides[name])
        arch = q.device.compute_capability
        plan = _config.backward_plan(dtype, d, dv, causal, deterministic, sparse=mask is not None,
                                     hopper=_config.is_hopper(arch), wgmma=_config.has_wgmma(arch))
        nq_pad = -(-nq // _config.STATS_ROW_MULTIPLE) * _config.STATS_ROW_MULTIPLE
        lse2 = cupy.empty((num_batch, nq_pad, 2), cupy.float32)  # (m, log2 l) per row
        delta = cupy.empty((num_batch, nq_pad), cupy.float32)
        alloc = cupy.zeros if plan.atomic_dq else cupy.empty
        dq_acc = alloc(layout.out_lead_shape + (nq, d), cupy.float32)
        # When k and v are not broadcast or grouped, each key row gets its gradient from one
        # CTA: the kernel writes dK and dV final, in the input dtype, with no float32 copy.
        kv_direct = all(tuple(x.shape[:-2]) == layout.out_lead_shape for x in (k, v))
        kv_dtype = q.dtype if kv_direct else cupy.float32
        dk_acc = cupy.empty(layout.out_lead_shape + (nk, d), kv_dtype)
        dv_acc = cupy.empty(layout.out_lead_shape + (nk, dv), kv_dtype)

        row_strides = (strides["q"][-2], strides["k"][-2], strides["v"][-2])
        do_lead, o_lead = layout.extra_strides[:2]
        mask_strides = layout.extra_strides[-1] if mask is not None else ()

        def params_for(variant, transpose=False):
            """FwdParams with the lists of this launch's own tiles; the preprocess walks no
            tiles, so it gets null lists (and the window, unused)."""
            tiled = mask if variant is not plan.preprocess else None
            sparsity = _sparsity_fields(tiled, mask_strides, nq, nk, variant,
                                        transpose=transpose, causal=causal, window=window)
            return _pack_forward_params(q, k, v, o, l, m, nq, nk, d, dv, layout, row_strides, scale, sparsity)

        bparams = np.void(struct.pack(
            _BWD_PARAM_FORMAT,
            do.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr, lse2.data.ptr, delta.data.ptr,
            dq_acc.data.ptr, dk_acc.data.ptr, dv_acc.data.ptr, nq_pad,
            *do_lead, *o_lead, strides["do"][-2], strides["o"][-2], int(kv_direct and dtype != "float32"),
        ))
        args = (params_for(plan.preprocess), bparams)
        _launch(plan.preprocess, nq_pad // plan.preprocess.warps, num_batch, args, d, dv)
        for variant in plan.key_passes:  # one CTA per key tile: the transposed lists
            args = (params_for(variant, transpose=True), bparams)
            _launch(variant, -(-nk // variant.block_cols), num_batch, args, d, dv)
        if plan.dq is not None:  # one CTA per query tile
            _launch(plan.dq, -(-nq // plan.dq.block_rows), num_batch, (params_for(plan.dq), bparams), d, dv)

        out_lead = layout.out_lead_shape
        dq = _reduce_to(dq_acc, out_lead, q.shape, 1).astype(q.dtype)
        if kv_direct:
            dk, dv_ = dk_acc.reshape(k.shape), dv_acc.reshape(v.shape)
        else:
            dk = _reduce_to(dk_acc, out_lead, k.shape, layout.kv_group).astype(k.dtype)
            dv_ = _reduce_to(dv_acc, out_lead, v.shape, layout.kv_group).astype(v.dtype)
    return AttentionGradients(dq, dk, dv_)
