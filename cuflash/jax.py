"""JAX adapter: differentiable cuflash attention for JAX arrays on a CUDA GPU.

    import cuflash.jax
    o = cuflash.jax.attention(q, k, v, causal=True)     # eager, or inside jax.jit / jax.grad
    o = cuflash.jax.attention(q, k, v, block_mask=cuflash.masks.butterfly(32), window=(512, 0))

The kernels run inside XLA's own execution through ``jax.experimental.buffer_callback``: the
callback gets XLA's device buffers and its CUDA stream, looks up the launch plan of the call's
shapes (cuflash/_plan.py) and launches it on that stream, reading the inputs in place and
writing o, l, m and the gradients straight into XLA's output buffers. jaxlib offers no stable
way to launch run-time compiled GPU code from a custom call without Python: its FFI needs a
handler compiled ahead of time, and the Triton custom call is internal; so each call costs one
Python callback.  The gradient is a
``jax.custom_vjp`` whose backward pass is cuflash's FlashAttention backward.  ``jax.vmap``
works too (the forward batches natively, the backward broadcasts its unbatched operands).

Memory: cuflash's results and scratch space come from CuPy's memory pool, outside XLA's.
XLA reserves 75% of the GPU by default; for large problems leave CuPy more room with
``XLA_PYTHON_CLIENT_MEM_FRACTION`` or ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.
"""

import functools

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from . import _api, _broadcast, _checks, _plan

__all__ = ["attention"]


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
# signature of a call: (shapes, dtype, device, options) -> launch plan.
_plans: dict = {}


def _forward_plan(q, k, v, device, options):
    key = (q.shape, k.shape, v.shape, q.dtype, device, options)
    plan = _plans.get(key)
    if plan is None:
        causal, scale, mask, window = options
        dtype = _checks.dtype_name(q.dtype)
        plan = _plan.forward_plan(
            tuple(q.shape), _plan.contiguous_strides(q.shape), tuple(k.shape), _plan.contiguous_strides(k.shape), tuple(v.shape),
            _plan.contiguous_strides(v.shape), dtype, device, causal, scale, mask, window,
            (_pointer(q), _pointer(k), _pointer(v)))
        _plans[key] = plan
    return plan


def _backward_plan(args, device, options, deterministic):
    key = tuple(a.shape for a in args) + (args[1].dtype, device, options, deterministic)
    plan = _plans.get(key)
    if plan is None:
        causal, scale, mask, window = options
        main = (args[0], args[1], args[2], args[3], args[4])
        stats = tuple((tuple(x.shape), _plan.contiguous_strides(x.shape), "float32") for x in args[5:])
        plan = _plan.backward_plan(
            tuple(tuple(x.shape) for x in main), tuple(_plan.contiguous_strides(x.shape) for x in main),
            _checks.dtype_name(args[1].dtype), stats, device, causal, scale, mask, window,
            deterministic, tuple(_pointer(x) for x in main))
        _plans[key] = plan
    return plan


def _device_of(buf) -> int:
    return int(buf.__dlpack_device__()[1])


def _run_forward(ctx, outs, q, k, v, options):
    plan = _forward_plan(q, k, v, _device_of(outs[0]), options)
    o, l, m = outs
    plan.run(_pointer(q), _pointer(k), _pointer(v), _pointer(o), _pointer(l), _pointer(m), ctx.stream)


def _run_backward(ctx, outs, args, options, deterministic):
    """Gradients straight into XLA's output buffers; the workspace comes from CuPy's pool on
    XLA's stream (freed blocks are handed out again only for work queued after them there)."""
    import cupy

    device = _device_of(outs[0])
    plan = _backward_plan(args, device, options, deterministic)
    with cupy.cuda.Device(device), _cupy_stream(ctx.stream, device):
        workspace = cupy.cuda.alloc(plan.workspace_bytes) if plan.workspace_bytes else None
        base = 0 if workspace is None else workspace.ptr
        grads = [0 if g.kind == "generic" else _pointer(out) for g, out in zip(plan.grads, outs)]
        plan.run(*(_pointer(a) for a in args), *grads, base, ctx.stream)
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
def _forward_callback(causal, scale, block_mask, window):
    options = (causal, scale, block_mask, window)

    def callback(ctx, outs, q, k, v):
        _run_forward(ctx, outs, q, k, v, options)

    return callback


@functools.lru_cache(maxsize=_CALLBACKS_KEPT)
def _backward_callback(causal, scale, block_mask, window, deterministic):
    options = (causal, scale, block_mask, window)

    def callback(ctx, outs, *args):
        _run_backward(ctx, outs, args, options, deterministic)

    return callback


def _check(q, k, v, scale, block_mask, window):
    """Trace-time validation: errors surface at the call site, not inside XLA's callback."""
    _checks.check_dtypes(q.dtype, k.dtype, v.dtype)
    _checks.check_head_dims(q.shape, k.shape, v.shape)
    _checks.resolve_scale(scale, q.shape[-1])
    lead = _broadcast.out_lead_shape(q.shape, k.shape, v.shape)
    _checks.check_sparsity(block_mask, None, window, q.shape[-2], k.shape[-2], lead)
    return lead


def _forward(q, k, v, options):
    lead = _check(q, k, v, *options[1:])
    nq, dv = q.shape[-2], v.shape[-1]
    stats = jax.ShapeDtypeStruct(lead + (nq,), np.float32)
    shapes = (jax.ShapeDtypeStruct(lead + (nq, dv), q.dtype), stats, stats)
    # expand_dims: cuflash broadcasts the size-1 leading dim of unbatched operands itself.
    call = buffer_callback(_forward_callback(*options), shapes, vmap_method="expand_dims")
    return call(q, k, v)


def _backward(do, q, k, v, o, l, m, options, deterministic):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    # broadcast_all, not expand_dims: a batched gradient of an unbatched input must stay
    # per-example, whereas cuflash would sum it over a size-1 broadcast dim.
    callback = _backward_callback(*options, deterministic)
    call = buffer_callback(callback, shapes, vmap_method="broadcast_all")
    return call(do, q, k, v, o, l, m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, options, deterministic):
    return _forward(q, k, v, options)[0]


def _attention_fwd(q, k, v, options, deterministic):
    o, l, m = _forward(q, k, v, options)
    return o, (q, k, v, o, l, m)


def _attention_bwd(options, deterministic, residuals, do):
    return _backward(do, *residuals, options, deterministic)


_attention.defvjp(_attention_fwd, _attention_bwd)
_attention_jit = jax.jit(_attention, static_argnums=(3, 4))


def attention(q, k, v, *, causal: bool = False, scale=None, deterministic: bool = False,
              block_mask=None, block_size=None, window=None):
    """Exact scaled dot-product attention (FlashAttention) on JAX arrays, differentiable.

    Args:
        q: (..., Nq, d). k: (..., Nk, d). v: (..., Nk, dv). float16, bfloat16 or float32,
            one dtype, on a CUDA device; d and dv multiples of 8 up to 256. Leading dims
            broadcast; k/v with Hk heads (axis -3) where Hk divides q's Hq are grouped-query
            attention: q head h uses k/v head h // (Hq // Hk).
        causal: key j is masked for query i when j > i + (Nk - Nq) (bottom-right aligned).
        scale: multiplies q k^T; defaults to 1 / sqrt(d).
        deterministic: make the gradients bit-identical from run to run (the default
            backward accumulates dq with float atomics).
        block_mask, block_size, window: block-sparse and sliding-window attention, as in
            :func:`cuflash.attention`: a :class:`cuflash.masks.BlockMask`, or a concrete
            boolean array (..., Tq, Tk) (NumPy, or a JAX array outside jit) with
            ``block_size``; ``window=(left, right)``. They are static: each mask object is
            one trace (equal boolean arrays share one BlockMask, hence one trace).

    Returns:
        o, (..., Nq, dv) in q's dtype. Works eagerly and under jax.jit, jax.grad, jax.vmap.
    """
    scale = None if scale is None else float(scale)
    mask = _api.as_block_mask(block_mask, block_size)
    options = (bool(causal), scale, mask, _api.window_option(window))
    return _attention_jit(q, k, v, options, bool(deterministic))
