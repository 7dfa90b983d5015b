"""The JAX adapter's XLA calls (cuflash/jax.py): the buffer callbacks that find a call's launch
plan by its shapes in the plan cache and launch it on XLA's buffers and CUDA stream, and the
split-KV decoding call, planned at trace time with its workspace as one more XLA output.
"""

import functools
import math
import types

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from . import _broadcast, _spine
from ._spine import PLANS


def _pointer(buf) -> int:
    return buf.__cuda_array_interface__["data"][0]


class _StreamHandle:
    """XLA's stream pointer dressed in the CUDA stream protocol, for Stream.from_external."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


@functools.lru_cache(maxsize=16)
def _cupy_stream(ptr: int, device: int):
    """CuPy's view of XLA's stream on ``device`` (kept: XLA runs a computation on few streams)."""
    import cupy

    with cupy.cuda.Device(device):  # from_external records the current device
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))


# XLA lays out a custom call's operands row-major, so shapes, dtype and device are the whole
# signature of a call: (shapes, dtype, device, options) finds its launch plan in the plan cache
# (cuflash/_cache.py), whose hit path this is.
_recent = PLANS.recent.get


def _forward_plan(q, k, v, device, options, lengths=None):
    """lengths: (num_seqs, max_seqlen_q, max_seqlen_k) of a packed varlen batch, else None."""
    key = ("jax forward", q.shape, k.shape, v.shape, q.dtype, device, options, lengths)
    plan = _recent(key)
    if plan is None:
        plan = PLANS.get_or_build(key, _new_forward_plan, q, k, v, device, options, lengths)
    return plan


def _new_forward_plan(q, k, v, device, options, lengths):
    causal, scale, mask, window = options
    problem = _spine.forward_problem((q.shape, k.shape, v.shape), (_row_major(q), _row_major(k), _row_major(v)),
                                     (q.dtype, k.dtype, v.dtype), device, causal=causal, scale=scale, mask=mask,
                                     window=window, varlen=None if lengths is None else _spine.Varlen(*lengths))
    return _spine.forward(problem, (_pointer(q), _pointer(k), _pointer(v)))


def _row_major(x) -> tuple:
    """The element strides XLA lays a custom call's operand out with."""
    return _spine.contiguous_strides(x.shape)


def _backward_plan(args, device, options, deterministic, lengths=None):
    key = ("jax backward", *(a.shape for a in args), args[1].dtype, device, options, deterministic, lengths)
    plan = _recent(key)
    if plan is None:
        plan = PLANS.get_or_build(key, _new_backward_plan, args, device, options, deterministic, lengths)
    return plan


def _new_backward_plan(args, device, options, deterministic, lengths):
    causal, scale, mask, window = options
    main = args[:5]
    problem = _spine.backward_problem(
        tuple(x.shape for x in main), tuple(_row_major(x) for x in main), tuple(x.dtype for x in main),
        tuple((x.shape, _row_major(x), x.dtype) for x in args[5:7]), device, causal=causal, scale=scale, mask=mask,
        window=window, deterministic=deterministic, varlen=None if lengths is None else _spine.Varlen(*lengths))
    return _spine.backward(problem, tuple(_pointer(x) for x in main))


def _xla_stream(ctx) -> int:
    """The CUDA stream XLA runs the callback's computation on (a function of its own, so that the
    CPU tests can run the decoding callback on JAX's CPU backend, which has none)."""
    return ctx.stream


def _device_of(buf) -> int:
    return int(buf.__dlpack_device__()[1])


def _run_forward(ctx, outs, q, k, v, options, lengths=None, cu_seqlens=()):
    """cu_seqlens: the (cu_seqlens_q, cu_seqlens_k) buffers of a varlen call (lengths given)."""
    plan = _forward_plan(q, k, v, _device_of(outs[0]), options, lengths)
    o, l, m = outs
    plan.run((_pointer(q), _pointer(k), _pointer(v), _pointer(o), _pointer(l), _pointer(m),
              *(_pointer(c) for c in cu_seqlens)), ctx.stream)


def _run_backward(ctx, outs, args, options, deterministic, lengths=None):
    """Gradients straight into XLA's output buffers; the workspace comes from CuPy's pool on
    XLA's stream (freed blocks are handed out again only for work queued after them there).
    args: do, q, k, v, o, l, m, and a varlen call's cu_seqlens_q, cu_seqlens_k."""
    import cupy

    device = _device_of(outs[0])
    plan = _backward_plan(args, device, options, deterministic, lengths)
    with cupy.cuda.Device(device), _cupy_stream(ctx.stream, device):
        workspace = cupy.cuda.alloc(plan.workspace_bytes) if plan.workspace_bytes else None
        base = 0 if workspace is None else workspace.ptr
        grads = [0 if g.kind == "generic" else _pointer(out) for g, out in zip(plan.grads, outs)]
        plan.run((*(_pointer(a) for a in args[:7]), *grads, base, *(_pointer(c) for c in args[7:])), ctx.stream)
        for g, out in zip(plan.grads, outs):
            if g.kind == "generic":  # broadcast inputs: summed back by CuPy, copied into XLA's buffer
                acc = cupy.ndarray(g.acc_shape, np.float32, workspace + g.offset)
                grad = _broadcast.reduce_to(acc, plan.out_lead, g.shape, g.group,
                                            lambda x, axes: x.sum(axis=axes, keepdims=True))
                grad = cupy.ascontiguousarray(grad.astype(np.dtype(out.dtype)))
                if grad.nbytes:
                    cupy.cuda.runtime.memcpyAsync(_pointer(out), grad.data.ptr, grad.nbytes,
                                                  cupy.cuda.runtime.memcpyDeviceToDevice, ctx.stream)


# The static options of a call: causal, scale, block_mask (a cuflash.masks.BlockMask or None;
# hashed by identity, so one mask object is one trace) and window ((left, right) or None).
# Cached callbacks: the callback is a parameter of the XLA primitive, one object per
# configuration lets JAX reuse traces and compilations. Bounded, since masks are keys.
_CALLBACKS_KEPT = 64


@functools.lru_cache(maxsize=_CALLBACKS_KEPT)
def _forward_callback(causal, scale, block_mask, window, lengths=None):
    options = (causal, scale, block_mask, window)

    def callback(ctx, outs, q, k, v, *cu_seqlens):
        _run_forward(ctx, outs, q, k, v, options, lengths, cu_seqlens)

    return callback


@functools.lru_cache(maxsize=_CALLBACKS_KEPT)
def _backward_callback(causal, scale, block_mask, window, deterministic, lengths=None):
    options = (causal, scale, block_mask, window)

    def callback(ctx, outs, *args):
        _run_backward(ctx, outs, args, options, deterministic, lengths)

    return callback


# ---- decoding: the split-KV kernels, planned at trace time ------------------------------------


class _RowMajorBuffer:
    """What cuflash/_decode.py reads of an array (shape, byte strides, dtype, ``data.ptr``,
    ``device.id``, ``flags``), for a row-major buffer: one XLA hands a callback, or, at trace
    time, one XLA will allocate (address 0: its buffers are at least 16-byte aligned, which the
    callback checks again)."""

    __slots__ = ("shape", "dtype", "strides", "ndim", "size", "data", "device", "flags")
    _ROW_MAJOR = types.SimpleNamespace(c_contiguous=True)

    def __init__(self, shape, dtype, ptr: int = 0, device_id: int = 0):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.strides = tuple(s * self.dtype.itemsize for s in _spine.contiguous_strides(self.shape))
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.data = types.SimpleNamespace(ptr=ptr)
        self.device = types.SimpleNamespace(id=device_id)
        self.flags = self._ROW_MAJOR

    @classmethod
    def of(cls, buf, device_id: int):
        return cls(buf.shape, buf.dtype, _pointer(buf), device_id)


def _trace_device():
    """The CUDA device a traced decoding call is planned for (its size decides the split count):
    JAX's default device when that is a GPU, else None (tracing without one, e.g. jax.eval_shape
    on a CPU), which plans for plan_decode's defaults (an H200). A plan is correct on any GPU;
    only its speed depends on the device it was made for."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    return device.local_hardware_id  # CUDA's device ordinal, which CuPy counts in too


def _gpu_size(device):
    """plan_decode's sm_count for ``device`` (None: its default)."""
    if device is None:
        return {}
    return dict(sm_count=_spine.sm_count(device))


_DECODE_INPUTS = ("q", "k", "v", "page_table", "seqlens_k")
# (shapes and dtypes of the inputs, options, forward options, device) -> (DecodeChoice, callback)
# in the plan cache: the split count, hence the workspace output's size, is fixed when the call
# is traced.


def _decode_outputs(q, k, v, page_table, seqlens_k, options, forward_options=None):
    """o, l, m of the split-KV kernels on traced arrays. options: (causal, scale, window,
    num_splits). forward_options: set when the call was routed here for its shapes (no decoding
    arguments); they are the differentiable forward's, for its fallback under jax.vmap."""
    arrays = dict(zip(_DECODE_INPUTS, (q, k, v, page_table, seqlens_k)))
    device = _trace_device()
    key = ("jax decode", *(None if x is None else (tuple(x.shape), np.dtype(x.dtype)) for x in arrays.values()),
           options, forward_options, device)
    plan, callback = PLANS.get_or_build(key, _traced_decode, arrays, device, options, forward_options)
    stats = jax.ShapeDtypeStruct(plan.out_shape[:-1], np.float32)
    shapes = (jax.ShapeDtypeStruct(plan.out_shape, q.dtype), stats, stats)
    if plan.workspace_bytes:
        shapes += (jax.ShapeDtypeStruct((plan.workspace_bytes,), np.uint8),)
    # Under jax.vmap a decoding call runs once an example ("sequential"): a paged cache has no
    # batch dim to grow. A routed call batches like the forward ("expand_dims"); its callback
    # plans the batched shapes (_run_decode).
    call = buffer_callback(callback, shapes, vmap_method="sequential" if forward_options is None else "expand_dims")
    return tuple(call(*(x for x in arrays.values() if x is not None))[:3])


def _traced_decode(arrays, device, options, forward_options):
    """(DecodeChoice, callback) of a decoding call's traced arrays."""
    causal, scale, window, num_splits = options
    meta = {name: None if x is None else _RowMajorBuffer(x.shape, x.dtype, 0, device or 0)
            for name, x in arrays.items()}
    plan = _spine.plan_decode(meta["q"], meta["k"], meta["v"], causal=causal, scale=scale, window=window,
                              page_table=meta["page_table"], seqlens_k=meta["seqlens_k"], num_splits=num_splits,
                              **_gpu_size(device))
    names = tuple(name for name, x in arrays.items() if x is not None)
    return plan, _decode_callback(plan, names, options, forward_options)


def _decode_callback(plan, names, options, forward_options):
    def callback(ctx, outs, *args):
        _run_decode(ctx, outs, dict(zip(names, args)), plan, options, forward_options)

    return callback


def _run_decode(ctx, outs, args, plan, options, forward_options):
    """The traced plan's bound launch on XLA's buffers and stream: o, l, m and the workspace
    are the call's outputs, so nothing is allocated here and no input is written."""
    device = _device_of(outs[0])
    arrays = {name: _RowMajorBuffer.of(buf, device) for name, buf in args.items()}
    o, l, m, *workspace = (_RowMajorBuffer.of(buf, device) for buf in outs)
    if o.shape != plan.out_shape:
        # Only a routed call meets new shapes: jax.vmap's "expand_dims" adds a leading batch dim
        # (of size 1 on unbatched operands), and its outputs, the workspace too, grew by it.
        if forward_options is None:
            raise RuntimeError(f"cuflash.jax: a decoding call traced for o {plan.out_shape} got buffers for {o.shape}")
        plan = _batched_decode_plan(arrays, plan.num_splits, options)
        if plan is None:
            _run_forward(ctx, outs[:3], args["q"], args["k"], args["v"], forward_options)
            return
    workspace = workspace[0] if workspace else None
    given = 0 if workspace is None else workspace.size
    if plan.workspace_bytes > given:
        raise RuntimeError(f"cuflash.jax: the decoding workspace output has {given} bytes, the plan needs "
                           f"{plan.workspace_bytes}")
    for name in ("q", "k", "v"):
        x = arrays[name]
        if x.data.ptr & 15:
            raise _spine.vector_alignment_error(name, x.shape, _spine.contiguous_strides(x.shape), x.data.ptr,
                                                _spine.dtype_name(x.dtype))
    pointers = [0 if arrays.get(name) is None else arrays[name].data.ptr for name in _DECODE_INPUTS]
    _spine.bound_plan(plan, device).run((*pointers[:3], o.data.ptr, l.data.ptr, m.data.ptr, *pointers[3:],
                                         0 if workspace is None else workspace.data.ptr), _xla_stream(ctx))


def _batched_decode_plan(arrays, num_splits, options):
    """The plan of a routed call's vmapped buffers with the traced call's split count, or None
    where those shapes do not take the split-KV kernels (an unbatched operand's size-1 dim
    broadcasts: the forward does that). The workspace output grew by the batch B: B times the
    traced plan's bytes hold B times its rows in as many splits (each part is rounded up once
    instead of B times)."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]

    def build():  # (plan or None,): the cache keeps no None
        if not _spine.routes_short_queries(q, k, v):
            return (None,)
        causal, scale, window, _ = options
        return (_spine.plan_decode(q, k, v, causal=causal, scale=scale, window=window, num_splits=num_splits),)

    return PLANS.get_or_build(("jax batched decode", q.shape, k.shape, v.shape, q.dtype, num_splits, options), build)[0]
