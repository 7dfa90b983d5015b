"""Decoding's plans: a few queries a head against a long, dense or paged, KV cache
(kernels/flash_decode.cu).

The split-KV kernels split each (batch, k/v head)'s keys over CTAs, pack the query heads that
share a k/v head into one tile of rows, and merge the splits' partial results exactly by their
log-sum-exp. :func:`supports` says whether a call fits them; :func:`plan_decode` does every
host-side check and choice without touching the GPU (what the CPU tests exercise), and
:class:`DecodePlan` binds its :class:`DecodeChoice` for launches. The CuPy entry point is
cuflash._api.decode_attention; cuflash.attention routes to it by :func:`routes_short_queries`.

Values in device memory are never read on the host (no synchronisation): lengths
(``seqlens_k``) are clamped to [0, capacity] inside the kernel, where capacity is Nk (dense) or
max_pages * page_size (paged), and a page index outside [0, num_pages) masks the keys of that
page (they take no part, as if past the sequence's end) instead of being dereferenced.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import NamedTuple, Optional, Tuple

import numpy as np

from . import _arrays, _checks, _config, _constants, _driver, _launch, _params, _tiles, _variants
from ._cache import PLANS
from ._driver import Context
from .masks import window_option

_recent = PLANS.recent.get  # the plan cache's hit path (cuflash/_cache.py)

# The kernel counts keys (and capacity + Nq) in 32 bits, and a paged CTA computes key positions
# of tiles up to DECODE_PAGE_SLOTS + 2 past its last (page-table reads ahead, their results
# unused there): with that slack every position it forms stays under 2^31.
MAX_KEY_POSITION = 2**31 - 1 - (_constants.DECODE_PAGE_SLOTS + 2) * _tiles.DECODE_MAX_TILE_KEYS

class DecodeChoice(NamedTuple):
    """Everything a decoding call decides from shapes, strides and the GPU's size (what
    :class:`DecodePlan` binds)."""

    variant: _variants.SplitKvDecode
    combine: Optional[_variants.DecodeCombine]  # None with one split: the kernel writes o, l, m
    num_splits: int
    tiles_per_split: int  # key tiles of block_cols keys a split covers
    row_tiles: int  # CTAs of variant.block_rows packed rows per (batch, k/v head)
    batch: int
    kv_heads: int
    group: int  # query heads per k/v head
    nq: int
    capacity: int  # keys a sequence can hold: Nk, or max_pages * page_size
    d: int
    dv: int
    out_shape: tuple  # o's; l and m drop the last dim
    fields: dict  # the DecodeParams members that are not pointers

    @property
    def grid_x(self) -> int:
        return self.row_tiles * self.num_splits

    @property
    def num_bh(self) -> int:
        return self.batch * self.kv_heads

    @property
    def total_rows(self) -> int:
        return self.batch * self.kv_heads * self.group * self.nq

    @property
    def workspace_offsets(self) -> Tuple[int, int]:
        """Byte offsets of ws_l and ws_m in the splits' workspace (ws_o first, at 0)."""
        split_rows = self.num_splits * self.total_rows
        ws_l = _arrays.align(4 * split_rows * self.dv)
        return ws_l, ws_l + _arrays.align(4 * split_rows)

    @property
    def workspace_bytes(self) -> int:
        """Device memory the splits' partial results take (0 with one split). Shapes alone
        decide it, so the JAX adapter sizes its workspace output with it at trace time."""
        if self.combine is None:
            return 0
        return self.workspace_offsets[1] + _arrays.align(4 * self.num_splits * self.total_rows)


# ---- checks ---------------------------------------------------------------------------------


def _element_strides(x, name) -> tuple:
    strides = _arrays.element_strides(x)
    _checks.check_last_dim_contiguous(name, x.shape, strides)
    return strides


def _check_vector_alignment(x, name, strides):
    dtype = _checks.dtype_name(x.dtype)
    if x.data.ptr & 15 or not _checks.vector_stride_ok(x.shape, strides, _checks.itemsize(dtype)):
        raise _checks.vector_alignment_error(name, x.shape, strides, x.data.ptr, dtype)


def _shape_text(x) -> str:
    return f"shape {tuple(x.shape)}, dtype {_checks.dtype_name(x.dtype)}"


def _merged_batch(shape, strides, name) -> Tuple[int, int]:
    """(size, element stride) of leading dims that must address as one: each dim's stride is
    the next one's times its size (size-1 dims are free). Raises ValueError otherwise."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    size = math.prod(shape)
    if not dims or size == 0:
        return size, 0
    for (n_outer, s_outer), (n_inner, s_inner) in zip(dims, dims[1:]):
        if s_outer != s_inner * n_inner:
            raise ValueError(
                f"the batch dims {tuple(shape)} of {name} must collapse into one (element strides "
                f"{tuple(strides)} do not nest); reshape it to (batch, heads, N, head_dim)")
    return size, dims[-1][1]


def _check_index_array(x, name, shape, device_id):
    """page_table / seqlens_k: an int32, C-contiguous device array of exactly ``shape``."""
    if isinstance(x, np.ndarray) or not hasattr(x, "data") or not hasattr(x, "device"):
        raise TypeError(f"{name} must be an int32 GPU array of shape {shape}, got {type(x).__module__}."
                        f"{type(x).__name__}")
    if _checks.dtype_name(x.dtype) != "int32":
        raise TypeError(f"{name} must be int32, got {_shape_text(x)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape_text(x)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got {_shape_text(x)} with strides {tuple(x.strides)}")
    if x.device.id != device_id:
        raise ValueError(f"{name} is on device {x.device.id}, q on device {device_id}")


def check_num_splits(num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be an int or None, got {num_splits!r}")
    if not 1 <= num_splits <= _constants.MAX_DECODE_SPLITS:
        raise ValueError(f"num_splits must be between 1 and {_constants.MAX_DECODE_SPLITS}, got {num_splits}")
    return int(num_splits)


def _band(causal: bool, window) -> Tuple[int, int]:
    """(window_left, window_right) with causal folded in (right clipped to 0); -1 = unbounded."""
    left, right = window_option(window) or _checks.NO_WINDOW
    return left, 0 if causal else right


def supports(q, k, v, *, block_mask=None, page_table=None) -> bool:
    """Whether the split-KV kernels take this call: 1 to MAX_DECODE_QUERIES queries a head,
    float16 / bfloat16, head dims (multiples of 8) up to 128, no block mask, and a layout they
    read (see :func:`plan_decode`). With a ``page_table`` call plan_decode directly: its errors
    say what is wrong."""
    if block_mask is not None:
        return False
    try:
        _plan_layout(q, k, v, page_table)
    except (TypeError, ValueError):
        return False
    return True


def routes_short_queries(q, k, v, block_mask=None) -> bool:
    """Whether a call without decoding arguments takes the split-KV kernels all the same: at
    least one query row, no block mask, at least ``_config.DECODE_MIN_KEYS`` keys, and a layout
    :func:`supports`. A few queries a head against many keys would occupy only a handful of
    the forward's 128-row query tiles while the split-KV kernels stream K and V on every SM;
    below DECODE_MIN_KEYS the keys fit one tile of the forward: nothing to split. Every
    front end that routes (the CuPy API, the JAX adapter) asks here."""
    return (block_mask is None and math.prod(q.shape[:-1]) > 0 and k.shape[-2] >= _config.DECODE_MIN_KEYS
            and supports(q, k, v))


def _plan_layout(q, k, v, page_table):
    """The shape and stride checks: (dtype, layout dict). Raises TypeError / ValueError."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "strides"):
            raise TypeError(f"{name} must be a GPU array, got {type(x).__module__}.{type(x).__name__}")
    dtype = _checks.check_dtypes(q.dtype, k.dtype, v.dtype)
    if dtype not in _constants.TENSOR_CORE_DTYPES:
        raise TypeError(f"decoding takes float16 or bfloat16, got q {_shape_text(q)}")
    devices = {x.device.id for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k and v must be on one device, got devices q {q.device.id}, k {k.device.id}, "
                         f"v {v.device.id}")
    if q.ndim < 3:
        raise ValueError(f"q must have shape (batch..., Hq, Nq, head_dim), got {_shape_text(q)}")
    paged = page_table is not None
    kv_rank = "(num_pages, Hk, page_size, head_dim)" if paged else "(batch..., Hk, Nk, head_dim)"
    for name, x in (("k", k), ("v", v)):
        if x.ndim < 3 or (paged and x.ndim != 4):
            raise ValueError(f"{name} must have shape {kv_rank}, got {_shape_text(x)}")
    nq, nk, d, dv = _checks.check_head_dims(q.shape, k.shape, v.shape)
    if not 1 <= nq <= _constants.MAX_DECODE_QUERIES:
        raise ValueError(f"decoding takes 1 to {_constants.MAX_DECODE_QUERIES} queries a head, got q {_shape_text(q)}")
    if max(d, dv) > _tiles.DECODE_HEAD_DIM_BUCKETS[-1]:
        raise ValueError(f"decoding takes head dims up to {_tiles.DECODE_HEAD_DIM_BUCKETS[-1]}, got q "
                         f"{_shape_text(q)}, v {_shape_text(v)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in every dim but the last: k {_shape_text(k)}, v {_shape_text(v)}")
    strides = {name: _element_strides(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_vector_alignment(x, name, strides[name])
    hq, hk = q.shape[-3], k.shape[-3]
    if hk == 0 or hq % hk:
        raise ValueError(f"the k/v heads must divide the query heads: q {_shape_text(q)}, k {_shape_text(k)}")
    batch, q_batch_stride = _merged_batch(q.shape[:-3], strides["q"][:-3], "q")
    layout = dict(dtype=dtype, nq=nq, d=d, dv=dv, batch=batch, kv_heads=hk, group=hq // hk,
                  q_strides=(q_batch_stride,) + strides["q"][-3:-1])
    if paged:
        num_pages, _, page_size, _ = k.shape
        if page_size not in _constants.DECODE_PAGE_SIZES:
            raise ValueError(f"page size (k.shape[2]) must be one of {_constants.DECODE_PAGE_SIZES}, got k {_shape_text(k)}")
        for name, x in (("k", k), ("v", v)):
            # The kernel steps through a 16-key group of a page by 32-bit byte offsets.
            if abs(strides[name][2]) * x.dtype.itemsize * _constants.DECODE_PAGE_GROUP >= 2 ** 31:
                raise ValueError(f"{name}'s rows must lie less than {2 ** 31 // _constants.DECODE_PAGE_GROUP} "
                                 f"bytes apart in a paged cache, got {_shape_text(x)} with strides {x.strides}")
        layout.update(num_pages=num_pages, page_size=page_size,
                      k_strides=strides["k"][:3], v_strides=strides["v"][:3])
    else:
        if k.shape[:-3] != q.shape[:-3]:
            raise ValueError(f"the batch dims of q and k must be equal: q {_shape_text(q)}, k {_shape_text(k)}")
        layout["capacity"] = nk
        for name in ("k", "v"):
            _, batch_stride = _merged_batch(k.shape[:-3], strides[name][:-3], name)
            layout[f"{name}_strides"] = (batch_stride,) + strides[name][-3:-1]
    return dtype, layout


def plan_decode(q, k, v, *, causal=False, scale=None, window=None, page_table=None, seqlens_k=None,
                num_splits=None, sm_count: int = 132) -> DecodeChoice:
    """Every check and choice of a decoding call, on the host only (arrays need
    shape, strides, dtype, ``data.ptr`` and ``device.id``; nothing is read from the GPU).
    ``sm_count``: the GPU's size, for choosing the number of splits (by default an H100's / H200's)."""
    dtype, layout = _plan_layout(q, k, v, page_table)
    paged = page_table is not None
    batch, device_id = layout["batch"], q.device.id
    if paged:
        if seqlens_k is None:
            raise ValueError("a paged cache needs seqlens_k (int32, (batch,)) with the length of each sequence")
        if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.shape[1] < 1:
            raise ValueError(f"page_table must have shape (batch, max_pages) = ({batch}, >= 1) for q "
                             f"{_shape_text(q)}, got {_shape_text(page_table)}")
        _check_index_array(page_table, "page_table", tuple(page_table.shape), device_id)
        layout["capacity"] = page_table.shape[1] * layout["page_size"]
    if seqlens_k is not None:
        _check_index_array(seqlens_k, "seqlens_k", (batch,), device_id)
    capacity = layout["capacity"]
    if capacity + layout["nq"] > MAX_KEY_POSITION:
        raise ValueError(f"a cache of {capacity} keys a sequence exceeds the {MAX_KEY_POSITION - layout['nq']} "
                         f"the decoding kernels count")
    scale = _checks.resolve_scale(scale, layout["d"])
    window_left, window_right = _band(causal, window)
    forced = check_num_splits(num_splits)

    rows = layout["group"] * layout["nq"]
    num_bh = batch * layout["kv_heads"]
    variant = _config.decode_config(dtype, layout["d"], layout["dv"], paged, rows, num_bh, capacity, sm_count)
    row_tiles = -(-rows // variant.block_rows)
    if num_bh * rows >= 2**31:
        raise ValueError(f"{num_bh * rows} query rows exceed the 2^31 the decoding kernels count: q {_shape_text(q)}")
    key_tiles = -(-capacity // variant.block_cols)
    if forced is None:
        splits, tiles_per_split = _config.decode_splits(num_bh * row_tiles, key_tiles, sm_count)
    else:  # as given, even where some splits get no tile (they write the empty state)
        splits, tiles_per_split = forced, max(1, -(-key_tiles // forced))
    fields = dict(
        kv_heads=layout["kv_heads"], group=layout["group"], nq=layout["nq"], rows=rows, row_tiles=row_tiles,
        num_bh=num_bh, capacity=capacity, d=layout["d"], dv=layout["dv"],
        q_batch_stride=layout["q_strides"][0], q_head_stride=layout["q_strides"][1],
        q_row_stride=layout["q_strides"][2],
        k_batch_stride=layout["k_strides"][0], k_head_stride=layout["k_strides"][1],
        k_row_stride=layout["k_strides"][2],
        v_batch_stride=layout["v_strides"][0], v_head_stride=layout["v_strides"][1],
        v_row_stride=layout["v_strides"][2],
        page_shift=int(layout.get("page_size", 1)).bit_length() - 1,
        max_pages=page_table.shape[1] if paged else 0, num_pages=layout.get("num_pages", 0),
        num_splits=splits, tiles_per_split=tiles_per_split,
        scale=scale, scale_log2=scale * math.log2(math.e),
        window_left=window_left, window_right=window_right,
    )
    return DecodeChoice(
        variant=variant, num_splits=splits,
        combine=_config.decode_combine_config(dtype, num_bh * rows, sm_count) if splits > 1 else None,
        tiles_per_split=tiles_per_split, row_tiles=row_tiles, batch=batch, kv_heads=layout["kv_heads"],
        group=layout["group"], nq=layout["nq"], capacity=capacity, d=layout["d"], dv=layout["dv"],
        out_shape=tuple(q.shape[:-1]) + (layout["dv"],), fields=fields,
    )


# ---- the bound launch ---------------------------------------------------------------------


class DecodePlan(_launch.Plan):
    """A decoding choice's launches with their parameter blocks bound once (cuflash/_driver.py's
    Kernel): ``run((q, k, v, o, l, m, page_table, seqlens_k, workspace), stream)`` writes the
    pointers into the blocks and launches, packing nothing. page_table and seqlens_k are 0 where
    not given; ``workspace`` starts :attr:`workspace_bytes` of device memory for the splits'
    partial results (ignored with one split)."""

    pointer_names = ("q", "k", "v", "o", "l", "m", "page_table", "seqlens_k", "workspace")

    def __init__(self, choice: DecodeChoice, device_id: int):
        self.choice = choice
        self.device_id = device_id
        self.total_rows = choice.total_rows  # 0: nothing to launch
        zero = {name: 0 for name, kind in _params.DECODE_PARAM_FIELDS if kind == "Q"}
        block = _driver.words(struct.pack(_params.fields_format(_params.DECODE_PARAM_FIELDS), *(
            {**choice.fields, **zero}[name] for name, _ in _params.DECODE_PARAM_FIELDS)))
        self.kernel = _driver.Kernel(choice.variant, device_id, _launch.slice_grid(choice.grid_x, choice.num_bh),
                                     [block], choice.d, choice.dv)
        self.ws_l_offset, self.ws_m_offset = choice.workspace_offsets  # ws_o, then ws_l, then ws_m
        self.workspace_bytes = choice.workspace_bytes
        self.combine = None
        if choice.combine is not None:
            combine = dict(ws_o=0, ws_l=0, ws_m=0, o=0, l=0, m=0, total_rows=choice.total_rows, dv=choice.dv,
                           num_splits=choice.num_splits, scale=choice.fields["scale"],
                           scale_log2=choice.fields["scale_log2"])
            block = _driver.words(struct.pack(_params.fields_format(_params.COMBINE_PARAM_FIELDS), *(
                combine[name] for name, _ in _params.COMBINE_PARAM_FIELDS)))
            # a CTA a row
            self.combine = _driver.Kernel(choice.combine, device_id, (choice.total_rows, 1, 1), [block])
        self.ctx = _driver.device_context(device_id)
        self.lock = threading.Lock()

    def output_specs(self, dtype):
        """(specs, bytes) of o (in ``dtype``, q's), l, m and the splits' workspace (uint8) in one
        allocation (cuflash._arrays.output_specs)."""
        stats = self.choice.out_shape[:-1]
        return _arrays.output_specs(((self.choice.out_shape, dtype), (stats, np.float32), (stats, np.float32),
                                     ((self.workspace_bytes,), np.uint8)))

    def run(self, pointers, stream):
        if not self.total_rows:
            return
        q, k, v, o, l, m, page_table, seqlens, workspace = pointers
        ws = (0, 0, 0)
        if self.combine is not None:
            ws = (workspace, workspace + self.ws_l_offset, workspace + self.ws_m_offset)
        with self.lock, Context(self.ctx) as drv:
            self.kernel.params[0][0:11] = (q, k, v, o, l, m, *ws, page_table, seqlens)
            self.kernel.launch(drv, stream)
            if self.combine is not None:
                self.combine.params[0][0:6] = (*ws, o, l, m)
                self.combine.launch(drv, stream)


def bound_plan(choice: DecodeChoice, device_id: int) -> DecodePlan:
    """The :class:`DecodePlan` of a choice on ``device_id``, built once: kept with the choice, so
    that the choice's id is not reused while the entry lives."""
    return PLANS.get_or_build(("decode", id(choice), device_id), _kept_plan, choice, device_id)[1]


def _kept_plan(choice: DecodeChoice, device_id: int) -> tuple:
    return choice, DecodePlan(choice, device_id)
