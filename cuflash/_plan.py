"""Launch plans: what a call's signature decides, decided once.

A signature is everything about a call but its data: shapes, strides, dtypes, device, flags,
scale, block mask and window. ``forward_plan`` and ``backward_plan`` look one up, or build it:
they validate (with the errors cuflash has always given), choose the kernels (cuflash/_config.py
decides, nothing here overrides it), and bind everything that follows from the signature: grids,
shared memory, the packed parameter blocks, the block-sparse tile lists, the tensor maps'
templates, the workspace layout and the outputs' shapes. A call with a known signature then
checks what can change between such calls (the pointers' alignment), writes its pointers into
the bound parameter blocks and launches through the driver (``cuLaunchKernel``) on the caller's
stream. The plans take raw pointers, so the CuPy API, the torch adapter and the JAX adapter each
allocate their outputs their own way and share the plans.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import struct
import threading
from typing import NamedTuple


from . import _checks, _config, _constants, _loader, _params, _tma, _variants
from ._arrays import align
from ._broadcast import broadcast_layout
from ._constants import MAX_LEAD_DIMS

# ---- the driver ------------------------------------------------------------------------------

class _Driver:
    """The driver calls a plan makes. Launches, memsets and the current-context query go through
    CuPy's compiled bindings (3.5 us a launch on the H200's host, against 5.0 us through ctypes);
    pushing and popping a context, which CuPy does not bind, through ctypes."""

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
def _driver() -> _Driver:
    return _Driver()


def _check(status: int, what: str):
    if status:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({status})")


@functools.lru_cache(maxsize=None)
def device_context(device_id: int) -> int:
    """The primary context of a device (what CuPy, torch and XLA run in)."""
    import cupy

    with cupy.cuda.Device(device_id):
        cupy.cuda.runtime.free(0)  # makes the primary context current on this thread
        return _driver().current_context()


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> str:
    import cupy

    return cupy.cuda.Device(device_id).compute_capability


def _words(data: bytes):
    """A parameter block: ``data`` in an 8-byte-aligned ctypes buffer the launch points at."""
    block = (ctypes.c_uint64 * (-(-len(data) // 8)))()
    ctypes.memmove(block, data, len(data))
    return block


class Kernel:
    """One launch with its arguments bound: a CUfunction, its grid, and parameter blocks that
    the plan's ``run`` updates in place (the driver copies them at launch)."""

    __slots__ = ("variant", "func", "grid", "block", "smem", "params", "argv", "argv_ptr", "lists")

    def __init__(self, variant, device_id: int, grid, params, d: int = 0, dv: int = 0):
        raw = _loader.get_kernel(variant, _device(device_id))
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
            _check(status, f"launching {self.variant.key}")


def _device(device_id):
    import cupy

    return cupy.cuda.Device(device_id)


def slice_grid(grid_x: int, num_batch: int):
    """A grid of grid_x tiles for every (batch..., head) slice: y holds up to 65535, z the rest."""
    grid_y = min(num_batch, 65535)
    if -(-num_batch // grid_y) > 65535:
        raise ValueError(f"{num_batch} (batch..., head) slices exceed the {65535 ** 2} a launch grid can hold")
    return grid_x, grid_y, -(-num_batch // grid_y)


def forward_grid(variant, tiles: int, slices: int, device_id: int):
    """The forward's grid: one CTA an SM walking the tiles x slices items (a persistent
    variant), else a CTA each (slice_grid)."""
    if getattr(variant, "persistent", False):
        return (min(tiles * slices, sm_count(device_id)), 1, 1)
    return slice_grid(tiles, slices)


class Context:
    """Runs launches in a plan's device context: pushed for the call when another is current."""

    __slots__ = ("ctx", "pushed")

    def __init__(self, ctx):
        self.ctx = ctx

    def __enter__(self):
        drv = _driver()
        self.pushed = drv.current_context() != self.ctx
        if self.pushed:
            _check(drv.cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")
        return drv

    def __exit__(self, *exc):
        if self.pushed:
            _driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


# ---- parameter blocks ------------------------------------------------------------------------

# The block-sparsity fields of a dense launch: null lists, so the kernel walks every tile.
DENSE_TILES = (0,) * (3 + 2 + 4 + MAX_LEAD_DIMS)
DENSE_SPARSITY = _checks.NO_WINDOW + DENSE_TILES  # the fields from window_left to mask_lead_stride


def forward_params(nq, nk, d, dv, layout, row_strides, scale, sparsity=DENSE_SPARSITY, num_seqs=0,
                   varlen_tiles=0) -> bytes:
    """struct FwdParams with null pointers (a call writes them); sparsity: the fields from
    window_left on (sparsity_fields). num_seqs > 0: a varlen launch of that many sequences,
    nq and nk the packed totals; its slices are (sequence, head), and its cu_seqlens pointers
    are written per call (_params.CU_SEQLENS_WORD). varlen_tiles: a persistent varlen
    forward's query tiles a slice (the x of its one-item-a-CTA grid)."""
    num_batch = math.prod(layout.lead_shape) * (num_seqs or 1)
    values = (
        0, 0, 0, 0, 0, 0,
        nq, nk, d, dv, num_batch,
        *layout.lead_shape, *layout.q_strides, *layout.k_strides, *layout.v_strides,
        *row_strides, layout.kv_group, scale, scale * math.log2(math.e), *sparsity, 0, 0, num_seqs, varlen_tiles,
    )
    return struct.pack(_params.FWD_PARAM_FORMAT, *values)


def sparse_row_tiles(mask, nq, nk, variant, causal, window) -> float:
    """The mean number of key tiles a query tile of ``variant`` (a forward) visits under
    ``mask`` (from its host tile lists, which the mask keeps); nq > 0, as every plan that asks
    has at least one query tile."""
    counts = mask.tile_lists(nq, nk, variant.block_rows, variant.block_cols, causal=causal, window=window).counts
    return float(counts.mean())


def sparsity_fields(mask, mask_strides, nq, nk, variant, *, transpose, causal, window):
    """The FwdParams fields after scale_log2 for one launch of ``variant``, and the device
    arrays they point at (the plan holds them).

    transpose: the launch walks key tiles (the backward's key passes). Without a mask the
    lists are null (a dense launch, the window still applies).
    """
    if mask is None:
        return (*(window or _checks.NO_WINDOW), *DENSE_TILES), None
    tiles = mask.device_tile_lists(nq, nk, variant.block_rows, variant.block_cols, transpose=transpose,
                                   causal=causal, window=window)
    fields = (
        *(window or _checks.NO_WINDOW),
        tiles.counts.data.ptr, tiles.lists.data.ptr, tiles.blocks.data.ptr, tiles.n_outer, tiles.list_stride,
        *mask.block_size, *mask.shape[-2:], *mask_strides,
    )
    return fields, tiles


# ---- tensor maps -----------------------------------------------------------------------------


class _Maps:
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
        self.block = _words(_tma.param_block(raws, geometries, param_bytes))
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


# ---- forward ---------------------------------------------------------------------------------


def _check_vector_operands(operands, ptrs, dtype):
    """The 16-bit kernels load 16-byte vectors: every operand's pointer and strides must allow it."""
    if dtype == "float32":
        return
    for (name, shape, strides), ptr in zip(operands, ptrs):
        if ptr & 15 or not _checks.vector_stride_ok(shape, strides, _checks.itemsize(dtype)):
            raise _checks.vector_alignment_error(name, shape, strides, ptr, dtype)


class ForwardPlan:
    """One forward signature's launch: ``run(q, k, v, o, l, m, stream)`` on raw pointers."""

    def __init__(self, device_id, dtype, o_shape, stats_shape, operands, kernel=None, maps=None,
                 fallback=None):
        self.device_id = device_id
        self.dtype = dtype
        self.o_shape, self.stats_shape = o_shape, stats_shape
        self.stats_rows = math.prod(stats_shape)  # of l (and of m)
        self.operands = operands  # ((name, shape, element strides), ...) of q, k, v for errors
        self.vectors = dtype != "float32"  # 16-byte vector loads need 16-byte aligned pointers
        self.kernel = kernel  # None: nothing to compute (no query or no slice)
        self.maps = maps
        self.fallback = fallback  # builds the cp.async plan, for pointers the copy engine refuses
        self.ctx = device_context(device_id)
        self.lock = threading.Lock()
        self.decode = False  # the CuPy front end routes this signature to cuflash/_decode.py
        self.decode_launch = None  # ... on this bound launch (cuflash._decode.run_routed)
        # (dO strides, dO dtype, deterministic) -> BackwardPlan, for the torch adapter's eager
        # backward of a call this plan ran: the rest of the backward's signature follows from it.
        self.backward_plans: dict = {}
        self.varlen = False  # the launch reads cu_seqlens_q / cu_seqlens_k (run's last arguments)
        # The CuPy front end's, made at its first call: the outputs' one-allocation layout, and
        # the byte extents of q, k and v (against which caller-given outputs are checked).
        self.cupy_outputs = self.cupy_extents = None

    @property
    def variant(self):
        return None if self.kernel is None else self.kernel.variant

    def check(self, q, k, v):
        if self.vectors and (q | k | v) & 15:
            for (name, shape, strides), ptr in zip(self.operands, (q, k, v)):
                if ptr & 15:
                    raise _checks.vector_alignment_error(name, shape, strides, ptr, self.dtype)

    def run(self, q, k, v, o, l, m, stream, cu_seqlens_q=0, cu_seqlens_k=0):
        self.check(q, k, v)
        kernel = self.kernel
        if kernel is None:
            return
        with self.lock:
            if self.maps is not None and not self.maps.bind((q, k, v)):
                plan = self.fallback()
                return plan.run(q, k, v, o, l, m, stream, cu_seqlens_q, cu_seqlens_k)
            kernel.params[0][0:6] = (q, k, v, o, l, m)
            if self.varlen:
                word = _params.CU_SEQLENS_WORD
                kernel.params[0][word:word + 2] = (cu_seqlens_q, cu_seqlens_k)
            with Context(self.ctx) as drv:
                kernel.launch(drv, stream)


def _forward_signature_plan(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id,
                            causal, scale, mask, window, ptrs, tma=True):
    nq, nk, d, dv = _checks.check_head_dims(q_shape, k_shape, v_shape)
    for name, shape, strides in (("q", q_shape, q_strides), ("k", k_shape, k_strides), ("v", v_shape, v_strides)):
        _checks.check_last_dim_contiguous(name, shape, strides)
    qkv = (q_shape, q_strides, k_shape, k_strides, v_shape, v_strides)
    layout = broadcast_layout(*qkv)
    scale = _checks.resolve_scale(scale, d)
    mask, window = _checks.check_sparsity(mask, None, window, nq, nk, layout.out_lead_shape)
    if mask is not None:
        layout = _checks.layout_with_mask(qkv, (), mask)
    o_shape = layout.out_lead_shape + (nq, dv)
    stats_shape = layout.out_lead_shape + (nq,)
    operands = (("q", q_shape, q_strides), ("k", k_shape, k_strides), ("v", v_shape, v_strides))
    num_batch = math.prod(layout.lead_shape)
    if num_batch == 0 or nq == 0:
        return ForwardPlan(device_id, dtype, o_shape, stats_shape, operands)
    _check_vector_operands(operands, ptrs, dtype)
    cc = compute_capability(device_id)
    variant = _config.forward_config(dtype, d, dv, causal, sparse=mask is not None, wgmma=_config.has_wgmma(cc),
                                     nq=nq, slices=num_batch, tma=tma)
    row_tiles = None
    if mask is not None and isinstance(variant, _variants.HopperForward):  # its tiles decide the form
        row_tiles = sparse_row_tiles(mask, nq, nk, variant, causal, window)
        variant = _config.forward_config(dtype, d, dv, causal, sparse=True, wgmma=True, nq=nq, slices=num_batch,
                                         tma=tma, row_tiles=row_tiles)
    row_strides = (q_strides[-2], k_strides[-2], v_strides[-2])
    maps = None
    if isinstance(variant, _variants.HopperForward) and variant.tma:
        maps = _Maps(_tma.geometries(nq, nk, d, layout, row_strides, variant.block_rows, variant.block_cols), ptrs)
        if not maps.ok:  # the copy engine cannot map these inputs: the cp.async form
            maps = None
            variant = _config.forward_config(dtype, d, dv, causal, sparse=mask is not None, wgmma=True, nq=nq,
                                             slices=num_batch, tma=False, row_tiles=row_tiles)
    with _device(device_id):
        sparsity, lists = sparsity_fields(mask, layout.extra_strides[-1] if mask is not None else (), nq, nk,
                                          variant, transpose=False, causal=causal, window=window)
    params = [_words(forward_params(nq, nk, d, dv, layout, row_strides, scale, sparsity))]
    if isinstance(variant, _variants.HopperForward):
        params.append(maps.block if maps is not None else _words(bytes(_tma.PARAM_BYTES)))
    kernel = Kernel(variant, device_id, forward_grid(variant, -(-nq // variant.block_rows), num_batch, device_id),
                    params, d, dv)
    kernel.lists = lists

    def fallback():
        return _forward_signature_plan(*qkv, dtype, device_id, causal, scale, mask, window, ptrs, tma=False)

    return ForwardPlan(device_id, dtype, o_shape, stats_shape, operands, kernel, maps,
                       functools.lru_cache(maxsize=1)(fallback) if maps is not None else None)


# ---- backward --------------------------------------------------------------------------------


class GradientOut(NamedTuple):
    """How one gradient (dq, dk or dv) is finished.

    kind: 'direct' (the kernels write it in place: pointer of the output), 'reduce' (a float32
    accumulator in the workspace, summed over ``group`` slices and converted by grad_reduce.cu),
    'generic' (the accumulator, summed back over broadcast dims by the caller's framework with
    ``_broadcast.reduce_to``).
    """

    kind: str
    offset: int  # of the accumulator in the workspace (not 'direct')
    acc_shape: tuple
    group: int
    shape: tuple  # the gradient's (its input's) shape


class BackwardPlan:
    """One backward signature's launches: ``run(do, q, k, v, o, l, m, dq, dk, dv, workspace,
    stream)`` on raw pointers (dq/dk/dv: 0 for a 'generic' gradient, which the caller makes)."""

    def __init__(self, device_id, dtype, operands, grads, out_lead, workspace_bytes=0, delta_offset=0,
                 zero=None, kernels=(), fwd_blocks=(), bwd_block=None, reduces=(), zero_grads=False, maps=None,
                 fallback=None):
        self.device_id = device_id
        self.dtype = dtype
        self.operands = operands
        self.vectors = dtype != "float32"
        self.grads = grads  # GradientOut of dq, dk, dv
        self.out_lead = out_lead
        self.workspace_bytes = workspace_bytes  # lse2 at offset 0, delta at delta_offset, accumulators
        self.delta_offset = delta_offset
        self.zero = zero  # bytes of dQ's accumulator to clear first (atomic dQ), or None
        self.kernels = kernels
        self.fwd_blocks, self.bwd_block = fwd_blocks, bwd_block
        self.reduces = reduces  # (Kernel, gradient index)
        self.zero_grads = zero_grads  # no query sees a key: every gradient is 0
        self.maps = maps  # the wgmma key pass's tensor maps (q, k, v, dO), or None
        self.fallback = fallback  # builds the cp.async plan, for pointers the copy engine refuses
        self.varlen = False  # the launches read cu_seqlens_q / cu_seqlens_k (run's last arguments)
        # The CuPy front end's, made at its first call: the gradients' one-allocation layout; the
        # byte extents of the inputs and the specs of caller-given gradients.
        self.cupy_outputs = self.cupy_extents = None
        self.ctx = device_context(device_id)
        self.lock = threading.Lock()

    def check(self, do, q, k, v, o):
        if self.vectors and (do | q | k | v | o) & 15:
            for (name, shape, strides), ptr in zip(self.operands, (do, q, k, v, o)):
                if ptr & 15:
                    raise _checks.vector_alignment_error(name, shape, strides, ptr, self.dtype)

    def run(self, do, q, k, v, o, l, m, dq, dk, dv, workspace, stream, cu_seqlens_q=0, cu_seqlens_k=0):
        self.check(do, q, k, v, o)
        with self.lock:
            if self.maps is None or self.maps.bind((q, k, v, do)):
                with Context(self.ctx) as drv:
                    self._launch(drv, do, q, k, v, o, l, m, dq, dk, dv, workspace, stream, cu_seqlens_q,
                                 cu_seqlens_k)
                return
        self.fallback().run(do, q, k, v, o, l, m, dq, dk, dv, workspace, stream, cu_seqlens_q, cu_seqlens_k)

    def _launch(self, drv, do, q, k, v, o, l, m, dq, dk, dv, workspace, stream, cu_seqlens_q, cu_seqlens_k):
        outs = (dq, dk, dv)
        if self.zero_grads:
            for ptr, grad in zip(outs, self.grads):
                nbytes = math.prod(grad.shape) * _checks.itemsize(self.dtype)
                if nbytes:
                    _check(drv.memset_async(ptr, nbytes, stream), "cudaMemsetAsync")
            return
        accs = [ptr if g.kind == "direct" else workspace + g.offset for ptr, g in zip(outs, self.grads)]
        lse2, delta = workspace, workspace + self.delta_offset
        for block in self.fwd_blocks:
            block[0:6] = (q, k, v, o, l, m)
            if self.varlen:
                word = _params.CU_SEQLENS_WORD
                block[word:word + 2] = (cu_seqlens_q, cu_seqlens_k)
        self.bwd_block[0:9] = (do, o, l, m, lse2, delta, *accs)
        if self.zero is not None:
            _check(drv.memset_async(accs[0], self.zero, stream), "cudaMemsetAsync")
        for kernel in self.kernels:
            kernel.launch(drv, stream)
        for kernel, index in self.reduces:
            kernel.params[0][0:2] = (accs[index], outs[index])
            kernel.launch(drv, stream)


def _check_forward_outputs(do_shape, o_shape, out_shape):
    for name, shape in (("do", do_shape), ("o", o_shape)):
        if tuple(shape) != out_shape:
            raise ValueError(f"{name} must have the forward output's shape {out_shape}, got {tuple(shape)}")


def _check_stats(stats, stats_shape):
    """l and m as the forward returned them: ((shape, strides, dtype name), ...)."""
    for name, (shape, st, stat_dtype) in zip(("l", "m"), stats):
        contiguous = _is_c_contiguous(shape, st)
        if tuple(shape) != stats_shape or stat_dtype != "float32" or not contiguous:
            raise ValueError(
                f"{name} must be the forward's C-contiguous float32 array of shape {stats_shape}, "
                f"got shape {tuple(shape)}, dtype {stat_dtype}, contiguous {contiguous}"
            )


def _backward_block(nq_pad, do_lead, o_lead, strides, dkv_in_dtype, zero_dq_acc=False, head_group=1):
    """struct BwdParams with its pointers 0 (a call writes them); strides: do, q, k, v, o."""
    return _words(struct.pack(_params.BWD_PARAM_FORMAT, *(0,) * 9, nq_pad, *do_lead, *o_lead, strides[0][-2],
                              strides[4][-2], int(dkv_in_dtype), int(zero_dq_acc), head_group))


def _reduce_kernels(grads, out_lead, dtype, device_id):
    """(Kernel, gradient index) of each gradient summed over broadcast or grouped heads on the GPU."""
    reduces = []
    for index, grad in enumerate(grads):
        if grad.kind != "reduce":
            continue
        variant = _variants.GradientReduce(dtype)
        inner = math.prod(grad.acc_shape[len(out_lead):])
        outer = math.prod(grad.shape[:-2])
        per_cta = variant.threads * variant.elements_per_thread
        grid = (max(1, min(-(-outer * inner // per_cta), 16 * sm_count(device_id))), 1, 1)
        block = _words(struct.pack(_params.REDUCE_PARAM_FORMAT, 0, 0, grad.group, inner, outer))
        reduces.append((Kernel(variant, device_id, grid, [block]), index))
    return reduces


def _backward_signature_plan(shapes, strides, dtype, stats, device_id, causal, scale, mask, window,
                             deterministic, ptrs, tma=True):
    """shapes / strides (elements): do, q, k, v, o; stats: ((shape, strides, dtype name) of l, m);
    ptrs: theirs."""
    do_shape, q_shape, k_shape, v_shape, o_shape = shapes
    names = ("do", "q", "k", "v", "o")
    operands = tuple(zip(names, shapes, strides))
    nq, nk, d, dv = _checks.check_head_dims(q_shape, k_shape, v_shape)
    for name, shape, st in operands:
        _checks.check_last_dim_contiguous(name, shape, st)
    qkv = (q_shape, strides[1], k_shape, strides[2], v_shape, strides[3])
    out_lead = broadcast_layout(*qkv).out_lead_shape
    out_shape = out_lead + (nq, dv)
    _check_forward_outputs(do_shape, o_shape, out_shape)
    mask, window = _checks.check_sparsity(mask, None, window, nq, nk, out_lead)
    layout = _checks.layout_with_mask(qkv, ((do_shape, strides[0]), (o_shape, strides[4])), mask)
    _check_stats(stats, out_shape[:-1])
    scale = _checks.resolve_scale(scale, d)
    num_batch = math.prod(layout.lead_shape)
    grad_shapes = (q_shape, k_shape, v_shape)
    if num_batch == 0 or nq == 0 or nk == 0:  # no query sees a key: every gradient is 0
        grads = tuple(GradientOut("direct", 0, s, 1, s) for s in grad_shapes)
        return BackwardPlan(device_id, dtype, operands, grads, out_lead, zero_grads=True)
    _check_vector_operands(operands, ptrs, dtype)
    cc = compute_capability(device_id)
    kernels_for = functools.partial(_config.backward_plan, dtype, d, dv, causal, deterministic, sparse=mask is not None,
                                    hopper=_config.is_hopper(cc), wgmma=_config.has_wgmma(cc), tma=tma, nk=nk,
                                    slices=num_batch)
    nq_pad = -(-nq // _constants.STATS_ROW_MULTIPLE) * _constants.STATS_ROW_MULTIPLE
    kplan, group = _head_group(kernels_for, grad_shapes, out_lead, layout.kv_group, num_batch,
                               lambda cols: -(-nk // cols), device_id)
    row_strides = (strides[1][-2], strides[2][-2], strides[3][-2])
    do_lead, o_lead = layout.extra_strides[:2]

    @functools.lru_cache(maxsize=1)
    def fallback():  # the cp.async form, for inputs the copy engine cannot map
        return _backward_signature_plan(shapes, strides, dtype, stats, device_id, causal, scale, mask, window,
                                        deterministic, ptrs, tma=False)

    maps = _backward_maps(kplan, nq, nk, d, layout, row_strides, strides[0][-2], ptrs)
    if maps is not None and not maps.ok:
        return fallback()

    grads, delta_offset, end = gradient_layout(grad_shapes, out_lead, layout.kv_group, dtype, num_batch, nq_pad,
                                               group)
    kv_direct = grads[1].kind == "direct"
    mask_strides = layout.extra_strides[-1] if mask is not None else ()
    # Atomic dQ adds into a zeroed accumulator: the preprocess, which visits every query row
    # first, zeroes it (one launch fewer than a memset).
    bwd_block = _backward_block(nq_pad, do_lead, o_lead, strides, kv_direct and dtype != "float32", kplan.atomic_dq,
                                group)
    fwd_blocks, kernels = [], []

    def add(variant, grid_x, transpose=False, slices=num_batch):
        tiled = mask if variant is not kplan.preprocess else None  # the preprocess walks no tiles
        with _device(device_id):
            sparsity, lists = sparsity_fields(tiled, mask_strides, nq, nk, variant, transpose=transpose,
                                              causal=causal, window=window)
        block = _words(forward_params(nq, nk, d, dv, layout, row_strides, scale, sparsity))
        fwd_blocks.append(block)
        kernel = Kernel(variant, device_id, slice_grid(grid_x, slices), _backward_params(variant, block, bwd_block, maps),
                        d, dv)
        kernel.lists = lists
        kernels.append(kernel)

    add(kplan.preprocess, -(-nq_pad // kplan.preprocess.rows_a_cta(dv)))
    for variant in kplan.key_passes:  # one CTA per key tile (and group of heads): the transposed lists
        key_tiles = -(-nk // variant.block_cols)
        if getattr(variant, "persistent", False):  # one CTA an SM walks every (key tile, slice)
            add(variant, min(key_tiles * num_batch, sm_count(device_id)), transpose=True, slices=1)
        else:
            add(variant, key_tiles, transpose=True, slices=num_batch // group)
    if kplan.dq is not None:  # one CTA per query tile
        add(kplan.dq, -(-nq // kplan.dq.block_rows))

    reduces = _reduce_kernels(grads, out_lead, dtype, device_id)
    return BackwardPlan(device_id, dtype, operands, tuple(grads), out_lead, end, delta_offset, None, tuple(kernels),
                        tuple(fwd_blocks), bwd_block, tuple(reduces), maps=maps,
                        fallback=fallback if maps is not None else None)


def _backward_maps(kplan, nq, nk, d, layout, row_strides, do_row_stride, ptrs):
    """The tensor maps (q, k, v, dO) of a wgmma key pass that loads through them, else None;
    row_strides: of q, k, v; ptrs: of do, q, k, v, o. A packed batch's maps span every row of a
    head."""
    key_pass = kplan.key_passes[0]
    if not (isinstance(key_pass, _variants.HopperBackward) and key_pass.tma):
        return None
    do_strides = (*layout.extra_strides[0], do_row_stride)
    return _Maps(_tma.backward_geometries(nq, nk, d, layout, row_strides, do_strides, key_pass.block_rows,
                                          key_pass.block_cols), (ptrs[1], ptrs[2], ptrs[3], ptrs[0]),
                 _tma.BWD_PARAM_BYTES)


def _backward_params(variant, block, bwd_block, maps):
    """A backward kernel's parameter blocks: FwdParams, BwdParams and, for the wgmma key pass,
    its tensor maps (zeros where it loads with cp.async)."""
    if not isinstance(variant, _variants.HopperBackward):
        return [block, bwd_block]
    return [block, bwd_block, maps.block if maps is not None else _words(bytes(_tma.BWD_PARAM_BYTES))]


def _grouped_lead(out_lead, group) -> tuple:
    """The leading dims of k / v grouped ``group`` query heads a k/v head over the output's."""
    return out_lead[:-1] + (out_lead[-1] // group,) if group > 1 else out_lead


def _head_group(kernels_for, grad_shapes, out_lead, kv_group, num_batch, key_tiles, device_id) -> tuple:
    """(the kernels, the query heads a wgmma key-pass CTA walks): kernels_for(grouped=...) is
    _config.backward_plan with the call's arguments; the group is _config.backward_head_group's
    where k and v are grouped over q's heads and broadcast nowhere else, else 1.
    key_tiles(block_cols): the key pass's grid along x."""
    kplan = kernels_for()
    key_pass = kplan.key_passes[0]
    if not (isinstance(key_pass, _variants.HopperBackward) and key_pass.atomic_dq and not key_pass.sparse
            and kv_group > 1 and all(tuple(s[:-2]) == _grouped_lead(out_lead, kv_group) for s in grad_shapes[1:])):
        return kplan, 1
    group = _config.backward_head_group(kv_group, num_batch, key_tiles(key_pass.block_cols), sm_count(device_id))
    return (kernels_for(grouped=True) if group > 1 else kplan), group


def gradient_layout(grad_shapes, out_lead, kv_group, dtype, num_batch, nq_pad, head_group=1):
    """(GradientOut of dq, dk, dv; delta's offset; workspace bytes) of a backward: lse2
    (num_batch, nq_pad, 2) at 0, delta (num_batch, nq_pad), then the float32 accumulators of
    the gradients the kernels cannot write in place. head_group: the query heads a key-pass CTA
    walks (a divisor of kv_group, k and v grouped: _head_group): dK and dV are summed over them in the
    kernel, so written in place when it is kv_group, else accumulated over kv_group / head_group
    slices a k/v head. Shapes alone decide it (the JAX adapter sizes its workspace output with
    it at trace time)."""
    q_shape, k_shape, v_shape = grad_shapes
    nq, d, nk, dv = q_shape[-2], q_shape[-1], k_shape[-2], v_shape[-1]
    delta_offset = align(4 * num_batch * nq_pad * 2)
    end = delta_offset + align(4 * num_batch * nq_pad)
    # When k and v are not broadcast or grouped, each key row gets its gradient from one CTA:
    # the kernel writes dK and dV final, in the input dtype.
    kv_direct = all(tuple(s[:-2]) == out_lead for s in (k_shape, v_shape))
    acc_shapes = (out_lead + (nq, d), out_lead + (nk, d), out_lead + (nk, dv))
    grads = []
    for index, (shape, acc_shape) in enumerate(zip(grad_shapes, acc_shapes)):
        own_lead = tuple(shape[:-2])
        if (index == 0 and own_lead == out_lead and dtype == "float32") or (index > 0 and kv_direct):
            grads.append(GradientOut("direct", 0, acc_shape, 1, tuple(shape)))  # written in place
            continue
        group = 1 if index == 0 else kv_group
        kind = "reduce" if own_lead == _grouped_lead(out_lead, group) else "generic"
        if index > 0 and head_group > 1:
            if head_group == kv_group:  # summed over the whole group in the kernel
                grads.append(GradientOut("direct", 0, tuple(shape), 1, tuple(shape)))
                continue
            acc_shape = out_lead[:-1] + (out_lead[-1] // head_group,) + acc_shape[-2:]
            group = kv_group // head_group
        grads.append(GradientOut(kind, end, acc_shape, group, tuple(shape)))
        end += align(4 * math.prod(acc_shape))
    return tuple(grads), delta_offset, end


def _is_c_contiguous(shape, strides) -> bool:
    """Row-major without gaps (element strides; dims of one element and empty arrays pass)."""
    if 0 in tuple(shape):
        return True
    step = 1
    for n, s in zip(reversed(tuple(shape)), reversed(tuple(strides))):
        if n > 1 and s != step:
            return False
        step *= n
    return True


# ---- packed variable-length batches (varlen) ----------------------------------------------
#
# q (Hq, total_q, d), k (Hk, total_k, d), v (Hk, total_k, dv): one leading dim, the heads, and
# num_seqs sequences whose rows cu_seqlens_q / cu_seqlens_k (device arrays, never read here)
# delimit. A launch's slices are (sequence, head): num_seqs * Hq of them, each owning one
# sequence of one head (kernels/slice.cuh). max_seqlen only sizes the grid's x axis; a longer
# sequence's CTAs walk its further tiles, so it is never a bound on correctness.


def varlen_grid_x(max_seqlen: int, total: int, tile: int) -> int:
    """Tiles a slice's CTAs start on: those of the longest sequence the caller announces, no
    more than the packed total holds, at least one (a CTA of an empty sequence just exits)."""
    return max(1, -(-min(max_seqlen, total) // tile))


def varlen_stats_rows(total_q: int, num_seqs: int) -> int:
    """Rows of the backward's statistics per head: each sequence's padded to a multiple of
    STATS_ROW_MULTIPLE, at the offsets slice_geometry gives (which end by this)."""
    r = _constants.STATS_ROW_MULTIPLE
    return (-(-total_q // r) + num_seqs) * r


def _varlen_forward_signature_plan(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id,
                                   causal, scale, window, num_seqs, max_seqlen_q, ptrs, tma=True):
    _checks.check_varlen_shapes(q_shape, k_shape, v_shape)
    total_q, total_k, d, dv = _checks.check_head_dims(q_shape, k_shape, v_shape)
    for name, shape, strides in (("q", q_shape, q_strides), ("k", k_shape, k_strides), ("v", v_shape, v_strides)):
        _checks.check_last_dim_contiguous(name, shape, strides)
    qkv = (q_shape, q_strides, k_shape, k_strides, v_shape, v_strides)
    layout = broadcast_layout(*qkv)
    scale = _checks.resolve_scale(scale, d)
    window = _checks.check_sparsity(None, None, window, total_q, total_k, layout.out_lead_shape)[1]
    o_shape = layout.out_lead_shape + (total_q, dv)
    stats_shape = layout.out_lead_shape + (total_q,)
    operands = (("q", q_shape, q_strides), ("k", k_shape, k_strides), ("v", v_shape, v_strides))
    heads = math.prod(layout.lead_shape)
    if heads == 0 or total_q == 0 or num_seqs == 0:
        plan = ForwardPlan(device_id, dtype, o_shape, stats_shape, operands)
        plan.varlen = True
        return plan
    _check_vector_operands(operands, ptrs, dtype)
    cc = compute_capability(device_id)
    variant = _config.forward_config(dtype, d, dv, causal, wgmma=_config.has_wgmma(cc), nq=min(max_seqlen_q, total_q),
                                     tma=tma, slices=heads * num_seqs, varlen=True)
    row_strides = (q_strides[-2], k_strides[-2], v_strides[-2])
    maps = None
    if isinstance(variant, _variants.HopperForward) and variant.tma:
        # The maps span every packed row of a head; a sequence's tiles start at its first row.
        maps = _Maps(_tma.geometries(total_q, total_k, d, layout, row_strides, variant.block_rows,
                                     variant.block_cols), ptrs)
        if not maps.ok:
            maps = None
            variant = dataclasses.replace(variant, tma=False)
    sparsity = (*(window or _checks.NO_WINDOW), *DENSE_TILES)
    grid_x = varlen_grid_x(max_seqlen_q, total_q, variant.block_rows)
    varlen_tiles = grid_x if getattr(variant, "persistent", False) else 0  # the x a persistent walk's items span
    params = [_words(forward_params(total_q, total_k, d, dv, layout, row_strides, scale, sparsity, num_seqs,
                                    varlen_tiles))]
    if isinstance(variant, _variants.HopperForward):
        params.append(maps.block if maps is not None else _words(bytes(_tma.PARAM_BYTES)))
    kernel = Kernel(variant, device_id, forward_grid(variant, grid_x, heads * num_seqs, device_id), params, d, dv)

    def fallback():
        return _varlen_forward_signature_plan(*qkv, dtype, device_id, causal, scale, window, num_seqs, max_seqlen_q,
                                              ptrs, tma=False)

    plan = ForwardPlan(device_id, dtype, o_shape, stats_shape, operands, kernel, maps,
                       functools.lru_cache(maxsize=1)(fallback) if maps is not None else None)
    plan.varlen = True
    return plan


def _varlen_backward_signature_plan(shapes, strides, dtype, stats, device_id, causal, scale, window, deterministic,
                                    num_seqs, max_seqlen_q, max_seqlen_k, ptrs, tma=True):
    """As _backward_signature_plan, for a varlen call (shapes: do, q, k, v, o)."""
    do_shape, q_shape, k_shape, v_shape, o_shape = shapes
    names = ("do", "q", "k", "v", "o")
    operands = tuple(zip(names, shapes, strides))
    _checks.check_varlen_shapes(q_shape, k_shape, v_shape)
    total_q, total_k, d, dv = _checks.check_head_dims(q_shape, k_shape, v_shape)
    for name, shape, st in operands:
        _checks.check_last_dim_contiguous(name, shape, st)
    qkv = (q_shape, strides[1], k_shape, strides[2], v_shape, strides[3])
    out_lead = broadcast_layout(*qkv).out_lead_shape
    out_shape = out_lead + (total_q, dv)
    _check_forward_outputs(do_shape, o_shape, out_shape)
    window = _checks.check_sparsity(None, None, window, total_q, total_k, out_lead)[1]
    layout = broadcast_layout(*qkv, extras=((do_shape, strides[0]), (o_shape, strides[4])))
    _check_stats(stats, out_shape[:-1])
    scale = _checks.resolve_scale(scale, d)
    heads = math.prod(layout.lead_shape)
    grad_shapes = (q_shape, k_shape, v_shape)
    if heads == 0 or total_q == 0 or total_k == 0 or num_seqs == 0:  # no query sees a key
        grads = tuple(GradientOut("direct", 0, s, 1, s) for s in grad_shapes)
        plan = BackwardPlan(device_id, dtype, operands, grads, out_lead, zero_grads=True)
        plan.varlen = True
        return plan
    _check_vector_operands(operands, ptrs, dtype)
    cc = compute_capability(device_id)
    kernels_for = functools.partial(_config.backward_plan, dtype, d, dv, causal, deterministic,
                                    hopper=_config.is_hopper(cc), wgmma=_config.has_wgmma(cc), varlen=True, tma=tma)
    nq_pad = varlen_stats_rows(total_q, num_seqs)  # per head
    kplan, group = _head_group(kernels_for, grad_shapes, out_lead, layout.kv_group, heads * num_seqs,
                               lambda cols: varlen_grid_x(max_seqlen_k, total_k, cols), device_id)
    row_strides = (strides[1][-2], strides[2][-2], strides[3][-2])

    @functools.lru_cache(maxsize=1)
    def fallback():  # the cp.async form, for inputs the copy engine cannot map
        return _varlen_backward_signature_plan(shapes, strides, dtype, stats, device_id, causal, scale, window,
                                               deterministic, num_seqs, max_seqlen_q, max_seqlen_k, ptrs, tma=False)

    maps = _backward_maps(kplan, total_q, total_k, d, layout, row_strides, strides[0][-2], ptrs)
    if maps is not None and not maps.ok:
        return fallback()
    grads, delta_offset, end = gradient_layout(grad_shapes, out_lead, layout.kv_group, dtype, heads, nq_pad, group)
    kv_direct = grads[1].kind == "direct"
    zero = 4 * math.prod(grads[0].acc_shape) if kplan.atomic_dq else None
    do_lead, o_lead = layout.extra_strides[:2]
    bwd_block = _backward_block(nq_pad, do_lead, o_lead, strides, kv_direct and dtype != "float32", head_group=group)
    sparsity = (*(window or _checks.NO_WINDOW), *DENSE_TILES)
    fwd_blocks, kernels = [], []

    def add(variant, grid_x, slices=heads * num_seqs):
        block = _words(forward_params(total_q, total_k, d, dv, layout, row_strides, scale, sparsity, num_seqs))
        fwd_blocks.append(block)
        kernels.append(Kernel(variant, device_id, slice_grid(grid_x, slices),
                              _backward_params(variant, block, bwd_block, maps), d, dv))

    stats_rows = -(-min(max_seqlen_q, total_q) // _constants.STATS_ROW_MULTIPLE) * _constants.STATS_ROW_MULTIPLE
    add(kplan.preprocess, max(1, -(-stats_rows // kplan.preprocess.rows_a_cta(dv))))
    for variant in kplan.key_passes:
        add(variant, varlen_grid_x(max_seqlen_k, total_k, variant.block_cols), slices=heads * num_seqs // group)
    if kplan.dq is not None:
        add(kplan.dq, varlen_grid_x(max_seqlen_q, total_q, kplan.dq.block_rows))
    reduces = _reduce_kernels(grads, out_lead, dtype, device_id)
    plan = BackwardPlan(device_id, dtype, operands, tuple(grads), out_lead, end, delta_offset, zero, tuple(kernels),
                        tuple(fwd_blocks), bwd_block, tuple(reduces), maps=maps,
                        fallback=fallback if maps is not None else None)
    plan.varlen = True
    return plan


# ---- the caches ------------------------------------------------------------------------------

_MAX_PLANS = 1024  # bounded: a plan may hold a block mask's device lists alive
_forward_plans: dict = {}
_backward_plans: dict = {}
_build_lock = threading.Lock()


def remember(cache: dict, key, plan):
    """Keep ``plan`` under ``key``, dropping the oldest entry past _MAX_PLANS (the front ends'
    caches of raw call signatures use it too)."""
    if len(cache) >= _MAX_PLANS:
        cache.pop(next(iter(cache)))
    cache[key] = plan


def _cached(cache, key, build):
    plan = cache.get(key)
    if plan is None:
        with _build_lock:
            plan = cache.get(key)
            if plan is None:
                plan = build()
                remember(cache, key, plan)
    return plan


def forward_plan(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id,
                 causal, scale, mask, window, ptrs) -> ForwardPlan:
    """The plan of a forward signature (strides in elements, dtype a name, mask a BlockMask or
    None, window normalised); ``ptrs`` (q, k, v) are used only when the plan is built."""
    key = (q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal), scale,
           mask, window, _config.GENERATION[0])
    return _cached(_forward_plans, key, lambda: _forward_signature_plan(
        q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal), scale,
        mask, window, ptrs))


def backward_plan(shapes, strides, dtype, stats, device_id, causal, scale, mask, window, deterministic,
                  ptrs) -> BackwardPlan:
    key = (shapes, strides, dtype, stats, device_id, bool(causal), scale, mask, window, bool(deterministic),
           _config.GENERATION[0])
    return _cached(_backward_plans, key, lambda: _backward_signature_plan(
        shapes, strides, dtype, stats, device_id, bool(causal), scale, mask, window, bool(deterministic), ptrs))


def varlen_forward_plan(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, causal,
                        scale, window, num_seqs, max_seqlen_q, ptrs) -> ForwardPlan:
    """The plan of a varlen forward signature: forward_plan's, plus the number of sequences and
    max_seqlen_q (a host int); the cu_seqlens pointers are run's per-call arguments."""
    key = ("varlen", q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal),
           scale, window, num_seqs, max_seqlen_q, _config.GENERATION[0])
    return _cached(_forward_plans, key, lambda: _varlen_forward_signature_plan(
        q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal), scale, window,
        num_seqs, max_seqlen_q, ptrs))


def varlen_backward_plan(shapes, strides, dtype, stats, device_id, causal, scale, window, deterministic, num_seqs,
                         max_seqlen_q, max_seqlen_k, ptrs) -> BackwardPlan:
    key = ("varlen", shapes, strides, dtype, stats, device_id, bool(causal), scale, window, bool(deterministic),
           num_seqs, max_seqlen_q, max_seqlen_k, _config.GENERATION[0])
    return _cached(_backward_plans, key, lambda: _varlen_backward_signature_plan(
        shapes, strides, dtype, stats, device_id, bool(causal), scale, window, bool(deterministic), num_seqs,
        max_seqlen_q, max_seqlen_k, ptrs))


def plan_counts() -> tuple:
    """(forward, backward) plans built so far and cached (for tests)."""
    return len(_forward_plans), len(_backward_plans)


def clear():
    with _build_lock:
        _forward_plans.clear()
        _backward_plans.clear()
