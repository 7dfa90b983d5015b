"""JAX adapter: differentiable cuflash attention for JAX arrays on a CUDA GPU.

    import cuflash.jax
    o = cuflash.jax.attention(q, k, v, causal=True)     # eager, or inside jax.jit / jax.grad
    o = cuflash.jax.attention(q, k, v, block_mask=cuflash.masks.butterfly(32), window=(512, 0))

The kernels run inside XLA's own execution through ``jax.experimental.buffer_callback``: the
callback gets XLA's device buffers and its CUDA stream, reads the inputs in place, runs
cuflash on that stream and copies the results into XLA's output buffers (a device-to-device
copy of o or of the gradients, small next to the attention itself).  The gradient is a
``jax.custom_vjp`` whose backward pass is cuflash's FlashAttention backward.  ``jax.vmap``
works too (the forward batches natively, the backward broadcasts its unbatched operands).

Memory: cuflash's results and scratch space come from CuPy's memory pool, outside XLA's.
XLA reserves 75% of the GPU by default; for large problems leave CuPy more room with
``XLA_PYTHON_CLIENT_MEM_FRACTION`` or ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.
"""

import functools
import math

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import cuflash as _cf

from . import _api, reference

__all__ = ["attention"]


class _StreamHandle:
    """XLA's stream pointer dressed in the CUDA stream protocol, for Stream.from_external."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _cupy_stream(ptr, device):
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device)  # CuPy < 14


def _as_cupy(buf, device):
    """A CuPy view of an XLA buffer (row-major, as XLA lays out custom-call operands).

    Built from the raw pointer rather than through DLPack or cupy.asarray: XLA describes
    bfloat16 in __cuda_array_interface__ as raw bytes ('<V2'), and marks input capsules
    read-only. ``buf.dtype`` is the real NumPy dtype (ml_dtypes' bfloat16).
    """
    import cupy

    dtype = np.dtype(buf.dtype)
    ptr = buf.__cuda_array_interface__["data"][0]
    nbytes = math.prod(buf.shape) * dtype.itemsize
    memory = cupy.cuda.UnownedMemory(ptr, nbytes, buf, device)
    return cupy.ndarray(tuple(buf.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


def _launch(ctx, outs, fn, args, kwargs):
    """Run ``fn(*args, **kwargs)`` on XLA's stream and copy its results into ``outs``.

    Inputs are only read: XLA may share them with other operations.
    """
    import cupy

    device = int(outs[0].__dlpack_device__()[1])
    with cupy.cuda.Device(device):
        # Made after selecting the device: Stream.from_external records the current one.
        stream = _cupy_stream(ctx.stream, device)
        with stream:
            results = fn(*(_as_cupy(a, device) for a in args), **kwargs)
            for out, result in zip(outs, results):
                result = cupy.ascontiguousarray(result)
                if result.nbytes:
                    dst = _as_cupy(out, device)
                    dst.data.copy_from_device_async(result.data, result.nbytes, stream)
    # The temporaries return to CuPy's pool now; the pool hands them out again only for work
    # on this same stream, after the kernels and copies queued above.


# The static options of a call: causal, scale, block_mask (a cuflash.masks.BlockMask or None;
# hashed by identity, so one mask object is one trace) and window ((left, right) or None).
# Cached callbacks: the callback is a parameter of the XLA primitive, one object per
# configuration lets JAX reuse traces and compilations. Bounded, since masks are keys.
_CALLBACKS_KEPT = 64


@functools.lru_cache(maxsize=_CALLBACKS_KEPT)
def _forward_callback(causal, scale, block_mask, window):
    options = dict(causal=causal, scale=scale, block_mask=block_mask, window=window)

    def callback(ctx, outs, q, k, v):
        _launch(ctx, outs, _cf.attention, (q, k, v), options)

    return callback


@functools.lru_cache(maxsize=_CALLBACKS_KEPT)
def _backward_callback(causal, scale, block_mask, window, deterministic):
    options = dict(causal=causal, scale=scale, block_mask=block_mask, window=window, deterministic=deterministic)

    def callback(ctx, outs, do, q, k, v, o, l, m):
        _launch(ctx, outs, _cf.attention_backward, (do, q, k, v, o, l, m), options)

    return callback


def _check(q, k, v, scale, block_mask, window):
    """Trace-time validation: errors surface at the call site, not inside XLA's callback."""
    _api.check_dtypes(q.dtype, k.dtype, v.dtype)
    _api.check_head_dims(q.shape, k.shape, v.shape)
    _api._resolve_scale(scale, q.shape[-1])
    lead = reference.broadcast_plan(q.shape, k.shape, v.shape).batch_shape
    _api.check_sparsity(block_mask, None, window, q.shape[-2], k.shape[-2], lead)
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
