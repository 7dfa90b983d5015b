"""JAX adapter: differentiable cuflash attention for JAX arrays on a CUDA GPU.

    import cuflash.jax
    o = cuflash.jax.attention(q, k, v, causal=True)     # eager, or inside jax.jit / jax.grad
    o = cuflash.jax.attention(q, k, v, block_mask=cuflash.masks.butterfly(32), window=(512, 0))

The kernels run inside XLA's own execution through ``jax.experimental.buffer_callback``: the
callback (cuflash/_jax_calls.py) gets XLA's device buffers and its CUDA stream, looks up the
launch plan of the call's shapes (cuflash/_spine.py) and launches it on that stream, reading
the inputs in place and writing o, l, m and the gradients straight into XLA's output buffers. jaxlib offers no stable
way to launch run-time compiled GPU code from a custom call without Python: its FFI needs a
handler compiled ahead of time, and the Triton custom call is internal; so each call costs one
Python callback.  The gradient is a
``jax.custom_vjp`` whose backward pass is cuflash's FlashAttention backward.  ``jax.vmap``
works too (the forward batches natively, the backward broadcasts its unbatched operands).

Decoding against a KV cache (``page_table=``, ``seqlens_k=``, ``num_splits=``) runs the split-KV
kernels (cuflash/_decode.py), forward only. Their plan, with the number of splits, is made at
trace time from the static shapes, so the splits' workspace is one more output of the XLA call
(XLA allocates it with the program's temporaries) and a callback only writes pointers into the
plan's bound launch; the lengths and page indices are read by the kernels from device memory,
never by the host. Short-query calls without those arguments take the same kernels where
cuflash.attention would (``_spine.routes_short_queries``) and stay differentiable: their o, l,
m feed the usual backward.

Memory: cuflash's results and scratch space come from CuPy's memory pool, outside XLA's.
XLA reserves 75% of the GPU by default; for large problems leave CuPy more room with
``XLA_PYTHON_CLIENT_MEM_FRACTION`` or ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.
"""

import functools

import numpy as np

from . import _requirements

try:
    import jax
    from jax.experimental.buffer_callback import buffer_callback
except ModuleNotFoundError as error:
    raise _requirements.framework_error(error, "cuflash.jax") from None
if not _requirements.installed("cupy"):
    raise _requirements.missing_cupy("cuflash.jax")

from . import _spine
from ._jax_calls import _backward_callback, _decode_outputs, _forward_callback, _RowMajorBuffer
from .masks import window_option

__all__ = ["attention"]


# ---- decoding: the split-KV kernels, forward only ---------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _decoding(q, k, v, page_table, seqlens_k, options):
    return _decode_outputs(q, k, v, page_table, seqlens_k, options)[0]


@_decoding.defjvp
def _decoding_jvp(options, primals, tangents):
    # A custom_jvp rule is traced for jax.grad, jax.vjp and jax.jvp alike: one clear error for all.
    raise ValueError(
        "cuflash.jax.attention with page_table, seqlens_k or num_splits runs the split-KV decoding kernels, "
        "which are forward only: it cannot be differentiated (call it outside jax.grad / jax.jvp, or on "
        "jax.lax.stop_gradient of its inputs)")


_decoding_jit = jax.jit(_decoding, static_argnums=(5,))


# ---- the differentiable attention ------------------------------------------------------------


def _check(q, k, v, scale, block_mask, window):
    """Trace-time validation: errors surface at the call site, not inside XLA's callback."""
    return _spine.check_traced((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype), scale, block_mask, window)


def _forward(q, k, v, options):
    lead = _check(q, k, v, *options[1:])
    causal, scale, mask, window = options
    if _spine.routes_short_queries(*(_RowMajorBuffer(x.shape, x.dtype) for x in (q, k, v)), mask):
        return _decode_outputs(q, k, v, None, None, (causal, scale, window, None), forward_options=options)
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


# ---- packed variable-length batches -----------------------------------------------------------
#
# q (Hq, total_q, d), k / v (Hk, total_k, d / dv) and the int32 boundaries cu_seqlens_q / _k,
# as in cuflash.attention. The number of sequences and the longest lengths are static (they
# size the grids); the boundaries stay on the device and are read by the kernels only.


def _varlen_forward(q, k, v, cu_q, cu_k, options, lengths):
    lead = _check(q, k, v, *options[1:])
    nq, dv = q.shape[-2], v.shape[-1]
    stats = jax.ShapeDtypeStruct(lead + (nq,), np.float32)
    shapes = (jax.ShapeDtypeStruct(lead + (nq, dv), q.dtype), stats, stats)
    # sequential: a packed batch has no batch dim for vmap to map onto
    call = buffer_callback(_forward_callback(*options, lengths), shapes, vmap_method="sequential")
    return call(q, k, v, cu_q, cu_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _varlen(q, k, v, cu_q, cu_k, options, lengths, deterministic):
    return _varlen_forward(q, k, v, cu_q, cu_k, options, lengths)[0]


def _varlen_fwd(q, k, v, cu_q, cu_k, options, lengths, deterministic):
    o, l, m = _varlen_forward(q, k, v, cu_q, cu_k, options, lengths)
    return o, (q, k, v, o, l, m, cu_q, cu_k)


def _varlen_bwd(options, lengths, deterministic, residuals, do):
    q, k, v = residuals[:3]
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = buffer_callback(_backward_callback(*options, deterministic, lengths), shapes, vmap_method="sequential")
    return (*call(do, *residuals), None, None)  # the integer boundaries have no cotangent


_varlen.defvjp(_varlen_fwd, _varlen_bwd)
_varlen_jit = jax.jit(_varlen, static_argnums=(5, 6, 7))


def _longest(name, value, cu, total):
    """max_seqlen_q / _k: as given, or read from concrete boundaries (a host copy); under jit
    the boundaries are traced, so the value must be given."""
    value = _spine.check_max_seqlen(name, value)
    if value is not None:
        return value
    try:
        host = np.asarray(cu)
    except jax.errors.TracerArrayConversionError:
        raise ValueError(f"{name} must be given (a host int) when cu_seqlens are traced, e.g. under jax.jit: "
                         f"the lengths live on the device") from None
    return _spine.longest_sequence(host, total)


def _check_int_arrays(**arrays):
    """The index arguments (page_table, seqlens_k, cu_seqlens): None or array-like; their dtype
    and shape are checked where the call is planned."""
    for name, x in arrays.items():
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an int32 array, got {type(x).__module__}.{type(x).__name__}")


def _varlen_attention(q, k, v, causal, scale, window, deterministic, cu_q, cu_k, max_q, max_k):
    _check_int_arrays(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    meta = [None if c is None else (tuple(c.shape), _spine.dtype_name(c.dtype), 0) for c in (cu_q, cu_k)]
    num_seqs = _spine.check_cu_seqlens(*meta, 0)  # XLA places every operand of a call on one device
    _spine.check_varlen_shapes(q.shape, k.shape, v.shape)
    lengths = (num_seqs, _longest("max_seqlen_q", max_q, cu_q, q.shape[-2]),
               _longest("max_seqlen_k", max_k, cu_k, k.shape[-2]))
    return _varlen_jit(q, k, v, cu_q, cu_k, (causal, scale, None, window), lengths, deterministic)


def attention(q, k, v, *, causal: bool = False, scale=None, deterministic: bool = False,
              block_mask=None, block_size=None, window=None, page_table=None, seqlens_k=None, num_splits=None,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Exact scaled dot-product attention (FlashAttention) on JAX arrays, differentiable.

    The dense and block-sparse entry point. A packed variable-length batch has its own,
    :func:`cuflash.jax.attention_varlen`, and so does decoding against a dense or paged KV
    cache, :func:`cuflash.jax.attention_with_kvcache`: they take only their mode's arguments
    and call this function with the keywords of that mode below.

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
        page_table, seqlens_k, num_splits: decoding against a KV cache on the split-KV
            kernels, forward only (differentiating raises), as in :func:`cuflash.attention`:
            k, v of shape (num_pages, Hk, page_size, d) with ``page_table`` int32 (batch,
            max_pages) and ``seqlens_k`` int32 (batch,), or dense (batch..., Hk, Nk, d) with
            optional ``seqlens_k``; causal and window aligned at each sequence's end.
            ``num_splits`` (static) forces the number of key splits, else it is chosen at trace
            time from the shapes and JAX's default GPU. XLA passes operands row-major: keep a
            cache as (num_pages, Hk, page_size, d), since ``jnp.swapaxes`` of vLLM's layout
            is a transposed copy of the whole cache. Under jax.vmap such a call runs once an
            example. Calls with 1-16 queries a head against at least 64
            keys take the same kernels on their own, differentiably.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: a packed variable-length
            batch, as in :func:`cuflash.attention`: q (Hq, total_q, d), k / v (Hk, total_k,
            d / dv), int32 boundaries of length batch + 1; the longest lengths are host ints
            (static: one trace each), needed under jax.jit, else read from the boundaries.
            Differentiable; not under jax.vmap.

    Returns:
        o, (..., Nq, dv) in q's dtype. Works eagerly and under jax.jit, jax.grad, jax.vmap.

    Example (one new token a sequence against a paged cache, inside a jitted decode step):
        >>> k_cache = jnp.zeros((num_pages, 8, 64, 128), jnp.bfloat16)   # (pages, Hk, page, d)
        >>> o = jax.jit(cuflash.jax.attention)(q, k_cache, v_cache, page_table=block_tables,
        ...                                    seqlens_k=context_lens)
    """
    scale = None if scale is None else float(scale)
    mask = _spine.as_block_mask(block_mask, block_size)
    window = window_option(window)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        _spine.check_varlen_options(mask, page_table, seqlens_k, num_splits)
        return _varlen_attention(q, k, v, bool(causal), scale, window, bool(deterministic), cu_seqlens_q,
                                 cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if page_table is not None or seqlens_k is not None or num_splits is not None:
        if mask is not None:
            raise ValueError("block_mask cannot be combined with page_table, seqlens_k or num_splits "
                             "(the split-KV decoding path)")
        _check_int_arrays(page_table=page_table, seqlens_k=seqlens_k)
        options = (bool(causal), scale, window, _spine.check_num_splits(num_splits))
        return _decoding_jit(q, k, v, page_table, seqlens_k, options)
    options = (bool(causal), scale, mask, window)
    return _attention_jit(q, k, v, options, bool(deterministic))


# ---- one entry point a mode ------------------------------------------------------------------
#
# The packed-batch and KV-cache modes of `attention`, each with only its own arguments (as
# cuflash.attention_varlen and cuflash.attention_with_kvcache are for CuPy arrays). The static
# and traced arguments are attention's: arrays are traced, host ints and options static.

from ._entry_points import check_boundaries_given  # noqa: E402  (the block stands apart at the end)

__all__ += ["attention_varlen", "attention_with_kvcache"]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal: bool = False,
                     scale=None, window=None, deterministic: bool = False):
    """Attention over a packed batch of sequences of different lengths, differentiable
    (flash_attn_varlen_func).

    Args:
        q: (Hq, total_q, d), k: (Hk, total_k, d), v: (Hk, total_k, dv): the sequences
            concatenated along the token dim, heads first (XLA passes operands row-major, so
            flash-attn's (total, H, d) would be a transposed copy). Dtypes, head dims and
            grouped heads as :func:`attention`'s.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) arrays, traced under jax.jit: sequence b
            owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], ...) of
            k and v, clamped into [0, total] by the kernels (never read by the host, not even
            with ``CUFLASH_VALIDATE=1``: the launches run inside jax.jit, on traced arrays).
        max_seqlen_q, max_seqlen_k: host ints sizing the grid, static (one trace a value): under
            jax.jit close over them or name them in ``static_argnames``. None reads them from
            concrete boundaries (eager calls only).
        causal, window: aligned at each sequence's bottom right. scale: default 1 / sqrt(d).
        deterministic: bit-identical gradients from run to run.

    Returns:
        o (Hq, total_q, dv) in q's dtype; rows that no sequence covers are unspecified, and so
        are their gradients. Works eagerly and under jax.jit and jax.grad, not under jax.vmap.

    Example:
        >>> cu = jnp.array([0, 17, 130, 131], jnp.int32)                   # 3 sequences
        >>> q = jnp.ones((8, 131, 64), jnp.bfloat16)                       # (Hq, total, d)
        >>> o = cuflash.jax.attention_varlen(q, q, q, cu, cu, 113, 113, causal=True)
    """
    check_boundaries_given("cuflash.jax.attention_varlen", cu_seqlens_q, cu_seqlens_k)
    return attention(q, k, v, causal=causal, scale=scale, window=window, deterministic=deterministic,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k)


def attention_with_kvcache(q, k_cache, v_cache, *, page_table=None, seqlens_k=None, num_splits=None,
                           causal: bool = False, scale=None, window=None):
    """Decoding: a few new queries a sequence against a dense or paged KV cache, split over the keys.

    Args:
        q: (batch..., Hq, Nq, d).
        k_cache, v_cache: dense (batch..., Hk, Nk, d) / (..., dv) with q's batch dims, or, with
            ``page_table``, paged (num_pages, Hk, page_size, d) / (..., dv), page_size a power
            of two in 16..256. XLA passes operands row-major: keep a cache in this layout, since
            ``jnp.swapaxes`` of vLLM's (num_pages, page_size, Hk, d) copies the whole cache.
            Hk divides Hq.
        page_table: int32 (batch, max_pages), traced; a page index outside [0, num_pages) is
            never read (its keys are masked).
        seqlens_k: int32 (batch,), traced; required with ``page_table``, optional for a dense
            cache (default Nk); clamped into [0, capacity] by the kernels. ``CUFLASH_VALIDATE``
            does not check them here: the launches run inside jax.jit, on traced arrays.
        num_splits: key splits of each (batch, k/v head), 1 to
            ``cuflash._constants.MAX_DECODE_SPLITS``, static (under jax.jit close over it or
            name it in ``static_argnames``); None chooses at trace time from the shapes and
            JAX's default GPU.
        causal, window: aligned at each sequence's end. scale: default 1 / sqrt(d).

    With any of ``page_table``, ``seqlens_k``, ``num_splits`` the call runs the split-KV
    decoding kernels, forward only (differentiating raises): 1 to 16 queries a head, float16
    or bfloat16, head dims up to 128; under jax.vmap it runs once an example. Without them it
    is :func:`attention` over a whole dense cache.

    Returns:
        o (batch..., Hq, Nq, dv) in q's dtype.

    Example (one new token a sequence, inside a jitted decode step):
        >>> k_cache = jnp.zeros((num_pages, 8, 64, 128), jnp.bfloat16)   # (pages, Hk, page_size, d)
        >>> step = jax.jit(cuflash.jax.attention_with_kvcache)
        >>> o = step(q, k_cache, v_cache, page_table=block_tables, seqlens_k=context_lens)
    """
    return attention(q, k_cache, v_cache, causal=causal, scale=scale, window=window, page_table=page_table,
                     seqlens_k=seqlens_k, num_splits=num_splits)
