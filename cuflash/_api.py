"""The CuPy front end: cuflash.attention and cuflash.attention_backward on CuPy arrays.

A call takes its arrays zero-copy and finds the plan of its signature in the plan cache by its
raw arguments (cuflash/_cache.py); the first call of a signature turns them into a problem and
asks the spine (cuflash/_spine.py) for its plan, which runs every argument check. The call then
allocates its outputs from CuPy's pool and hands the plan their pointers and CuPy's current
stream.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np

from . import _broadcast, _spine
from ._arrays import (AttentionGradients, AttentionOutput, as_cupy, element_strides, extent, given_outputs,
                      new_outputs, one_device, output_specs, stream_on)

# The plan cache's hit path. A call's raw arguments (shapes, byte strides, dtypes, devices,
# options) find its entry: a call repeating a signature skips even the normalisation of its
# arguments. Arguments that cannot be hashed (a boolean array as block_mask, a list as window)
# take the normalising path every time.
_recent = _spine.PLANS.recent.get

# CUFLASH_VALIDATE, read once: switched off, a call pays one test of this constant.
_VALIDATE = _spine.validation_enabled()


class _Call(NamedTuple):
    """The CuPy front end's entry for a signature: its plan, and what this front end made for
    it once: its outputs' one-allocation layout and its inputs' byte extents (which
    caller-given outputs must not overlap)."""

    plan: Any  # its ForwardPlan, BackwardPlan or (a decoding call's) DecodePlan
    specs: tuple  # (specs, bytes) of cuflash._arrays.output_specs
    extents: tuple  # ((name, (first, end) or None), ...) of the inputs
    launch: Any = None  # the DecodePlan a forward signature is routed to, or None
    given_specs: tuple = ()  # a backward's: the specs of all three gradients, for caller-given ones


def _extents(arrays, names) -> tuple:
    return tuple((name, extent(x.shape, element_strides(x), x.dtype.itemsize)) for name, x in zip(names, arrays))


def _forward_call(q, k, v, causal, scale, block_mask, block_size, window, varlen=None) -> _Call:
    """The entry of a forward signature (varlen: a packed batch's Varlen)."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    _spine.check_dtypes(*dtypes)  # before the devices, as cuflash has always checked them
    device = one_device((q, k, v), "q, k and v")
    mask = _spine.as_block_mask(block_mask, block_size)
    problem = _spine.forward_problem((q.shape, k.shape, v.shape), (element_strides(q), element_strides(k),
                                     element_strides(v)), dtypes, device, causal=causal, scale=scale, mask=mask,
                                     window=_spine.window_option(window), varlen=varlen)
    plan = _spine.forward(problem, (q.data.ptr, k.data.ptr, v.data.ptr))
    launch = _spine.routed(q, k, v, problem)
    if launch is None:
        specs = output_specs(((plan.o_shape, q.dtype), (plan.stats_shape, np.float32), (plan.stats_shape, np.float32)))
    else:
        specs = launch.output_specs(q.dtype)
    return _Call(plan, specs, _extents((q, k, v), ("q", "k", "v")), launch)


def _checked(call: _Call, out, names, inputs, device_id):
    """The caller's outputs ``out`` for ``names``, checked against the entry's layout and the
    inputs' extents (``inputs``: the arrays in the entry's order)."""
    spans = [(name, x.data.ptr, e) for (name, e), x in zip(call.extents, inputs)]
    return given_outputs(out, names, call.specs[0][:len(names)], device_id, spans)


def attention(q, k, v, *, causal: bool = False, scale=None, block_mask=None, block_size=None,
              window=None, page_table=None, seqlens_k=None, num_splits=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, out=None) -> AttentionOutput:
    """Exact scaled dot-product attention, computed tile by tile (FlashAttention).

    The dense and block-sparse entry point. A packed variable-length batch has its own,
    :func:`cuflash.attention_varlen`, and so does decoding against a dense or paged KV cache,
    :func:`cuflash.attention_with_kvcache`: they take only their mode's arguments and call this
    function with the keywords of that mode below.

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
        page_table, seqlens_k: a KV cache for decoding. ``k``/``v`` of shape (num_pages, Hk,
            page_size, d) (vLLM's and FlashInfer's (num_pages, page_size, Hk, d) pass as
            ``.swapaxes(1, 2)``), ``page_table`` int32 (batch, max_pages) and ``seqlens_k`` int32
            (batch,) on the device; ``seqlens_k`` alone gives per-sequence lengths of a dense
            cache. Causal and window are aligned at each sequence's end. The host never reads
            them: a length is clamped into [0, capacity] (Nk, or max_pages * page_size), and a
            page index outside [0, num_pages) masks that page's keys instead of reading them.
        num_splits: the split-KV decoding path's number of key splits, 1 to 256 (None: chosen
            from the shapes and the SM count). Calls with 1-16 queries a head against at least
            64 keys (16-bit, head dims up to 128, no block mask) take that path on their own.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: a packed variable-length batch
            (as flash_attn_varlen_func): q (Hq, total_q, d), k (Hk, total_k, d), v (Hk,
            total_k, dv), and int32 device arrays of length batch + 1; sequence b owns rows
            [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], ...) of k and v.
            Causal and window are aligned at each sequence's bottom right. The host never reads
            the boundaries: each is clamped into [0, total] and an end before its start is an
            empty sequence. max_seqlen_q / _k (host ints) size the grid only, a longer sequence
            is still computed whole; None computes them from the boundaries (one host sync).
            Returns o (Hq, total_q, dv), l and m (Hq, total_q); rows that no sequence covers are
            left unwritten. Not with block_mask or the decoding arguments.
        out: (o, l, m) to write instead of new arrays: C-contiguous, of the shapes and dtypes
            returned below, on q's device, sharing no memory with the inputs or each other;
            returned as given. Without it o, l and m are new arrays of one allocation (which
            each of them keeps alive).

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
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        _spine.check_varlen_options(block_mask, page_table, seqlens_k, num_splits)
        return _varlen_attention(q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, out)
    if page_table is not None or seqlens_k is not None or num_splits is not None:
        if block_mask is not None:
            raise ValueError("block_mask cannot be combined with page_table, seqlens_k or num_splits "
                             "(the split-KV decoding path)")
        page_table = None if page_table is None else as_cupy(page_table, "page_table")
        seqlens_k = None if seqlens_k is None else as_cupy(seqlens_k, "seqlens_k")
        return decode_attention(q, k, v, causal=causal, scale=scale, window=window, page_table=page_table,
                                seqlens_k=seqlens_k, num_splits=num_splits, out=out)
    try:
        key = ("cupy forward", q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype,
               v.dtype, q.data.device_id, k.data.device_id, v.data.device_id, causal, scale, block_mask, block_size,
               window)
        call = _recent(key)
    except TypeError:  # an unhashable argument
        key = call = None
    if call is None:
        call = _spine.PLANS.get_or_build(key, _forward_call, q, k, v, causal, scale, block_mask, block_size,
                                         window)
    plan, specs, _, launch, _ = call
    if launch is not None:  # routed to the split-KV kernels
        return _run_routed(call, q, k, v, out)
    stream, current = stream_on(plan.device_id)
    with (contextlib.nullcontext() if current else cupy.cuda.Device(plan.device_id)):
        o, l, m = new_outputs(*specs) if out is None else _checked(call, out, ("o", "l", "m"), (q, k, v),
                                                                    plan.device_id)
    plan.run((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr), stream)
    return AttentionOutput(o, l, m)


def _run_routed(call: _Call, q, k, v, out) -> AttentionOutput:
    """A forward signature's call routed to the split-KV kernels (its entry's DecodePlan)."""
    import cupy

    plan = call.plan
    if (q.data.ptr | k.data.ptr | v.data.ptr) & 15:
        plan.check_alignment((q.data.ptr, k.data.ptr, v.data.ptr))  # the error the forward gives
    if out is not None:
        out = _checked(call, out, ("o", "l", "m"), (q, k, v), plan.device_id)
    stream, current = stream_on(plan.device_id)
    with (contextlib.nullcontext() if current else cupy.cuda.Device(plan.device_id)):
        return _run_launch(call.launch, call.specs, q, k, v, None, None, None, out, stream)


# ---- packed variable-length batches --------------------------------------------------------


def varlen_boundaries(cu_seqlens_q, cu_seqlens_k):
    """cu_seqlens_q / _k as CuPy arrays (None where not given), and the metadata (shape, dtype
    name, device) the spine checks them by. Their values are not read."""
    cu = [None if c is None else as_cupy(c, n) for c, n in ((cu_seqlens_q, "cu_seqlens_q"),
                                                            (cu_seqlens_k, "cu_seqlens_k"))]
    meta = [None if c is None else (c.shape, _spine.dtype_name(c.dtype), c.data.device_id) for c in cu]
    return cu, meta


def _varlen_lengths(cu_q, cu_k, max_seqlen_q, max_seqlen_k, total_q, total_k):
    """max_seqlen_q / _k checked, or computed from the boundaries where None (a host sync)."""
    import cupy

    max_q = _spine.check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _spine.check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if max_q is None or max_k is None:
        with cupy.cuda.Device(cu_q.data.device_id):
            max_q = _spine.longest_sequence(cu_q, total_q) if max_q is None else max_q
            max_k = _spine.longest_sequence(cu_k, total_k) if max_k is None else max_k
    return max_q, max_k


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """(cu_seqlens_q, cu_seqlens_k as CuPy arrays, the problem's Varlen), after the checks of
    the boundaries, of q, k and v's ranks and of the longest lengths."""
    (cu_q, cu_k), meta = varlen_boundaries(cu_seqlens_q, cu_seqlens_k)
    num_seqs = _spine.check_cu_seqlens(*meta, q.data.device_id)
    _spine.check_varlen_shapes(q.shape, k.shape, v.shape)
    if _VALIDATE:
        _spine.check_varlen_inputs(cu_q, cu_k, total_q=q.shape[-2], total_k=k.shape[-2])
    max_q, max_k = _varlen_lengths(cu_q, cu_k, max_seqlen_q, max_seqlen_k, q.shape[-2], k.shape[-2])
    return cu_q, cu_k, _spine.Varlen(num_seqs, max_q, max_k)


def _varlen_attention(q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      out=None):
    import cupy

    cu_q, cu_k, varlen = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    try:
        key = ("cupy varlen forward", q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype,
               v.dtype, q.data.device_id, k.data.device_id, v.data.device_id, causal, scale, window, varlen)
        call = _recent(key)
    except TypeError:  # an unhashable argument
        key = call = None
    if call is None:
        call = _spine.PLANS.get_or_build(key, _forward_call, q, k, v, causal, scale, None, None, window, varlen)
    plan = call.plan
    stream, current = stream_on(plan.device_id)
    with (contextlib.nullcontext() if current else cupy.cuda.Device(plan.device_id)):
        o, l, m = new_outputs(*call.specs) if out is None else _checked(call, out, ("o", "l", "m"), (q, k, v),
                                                                         plan.device_id)
    plan.run((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr, cu_q.data.ptr,
              cu_k.data.ptr), stream)
    return AttentionOutput(o, l, m)


# ---- the backward ----------------------------------------------------------------------------


def _backward_call(arrays, causal, scale, deterministic, block_mask, block_size, window, varlen=None) -> _Call:
    do, q, k, v, o, l, m = arrays
    tensors = (do, q, k, v, o)
    # The dtypes before the devices, as cuflash has always checked them.
    _spine.check_like_q(_spine.check_dtypes(q.dtype, k.dtype, v.dtype), do=do.dtype, o=o.dtype)
    device = one_device(arrays, "all arguments")
    mask = _spine.as_block_mask(block_mask, block_size)
    problem = _spine.backward_problem(
        tuple(x.shape for x in tensors), tuple(element_strides(x) for x in tensors), tuple(x.dtype for x in tensors),
        tuple((x.shape, element_strides(x), x.dtype) for x in (l, m)), device, causal=causal, scale=scale, mask=mask,
        window=_spine.window_option(window), deterministic=deterministic, varlen=varlen)
    plan = _spine.backward(problem, tuple(x.data.ptr for x in tensors))
    specs = output_specs((g.shape, q.dtype) for g in plan.grads if g.kind != "generic")  # the kernels' gradients
    # of do, q, k, v, o, l, m; and the specs of all three gradients (caller-given ones)
    extents = _extents(tensors, ("do", "q", "k", "v", "o")) + (("l", (0, l.nbytes) if l.nbytes else None),
                                                               ("m", (0, m.nbytes) if m.nbytes else None))
    return _Call(plan, specs, extents, given_specs=output_specs((g.shape, q.dtype) for g in plan.grads)[0])


def _sum_keeping(x, axes):
    return x.sum(axis=axes, keepdims=True)


def attention_backward(do, q, k, v, o, l, m, *, causal: bool = False, scale=None,
                       deterministic: bool = False, block_mask=None, block_size=None,
                       window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, out=None) -> AttentionGradients:
    """Gradients of :func:`attention`, recomputing S and P tile by tile (no N x N buffer).

    Args:
        do: (..., Nq, dv) gradient of the loss with respect to o; o's shape, q's dtype.
        q, k, v: the forward's inputs (same shapes, strides, broadcasting and grouped heads).
        o, l, m: what :func:`attention` returned for them (l, m float32, C-contiguous).
        causal, scale, block_mask, block_size, window: as given to the forward.
        deterministic: bit-identical gradients across runs. The default accumulates dQ with
            float atomics across key tiles; ``True`` computes dQ in a separate pass that
            recomputes S and dP per query tile (two more matmuls, no atomics). float32 is
            always deterministic. Varlen calls keep this (their own dQ pass).
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: a packed variable-length batch,
            as given to the forward (do, o (Hq, total_q, dv); l, m (Hq, total_q)). Gradient
            rows that no sequence covers are unspecified.
        out: (dq, dk, dv) to write instead of new arrays: C-contiguous, shaped and typed like
            q, k and v, on their device, sharing no memory with the inputs or each other;
            returned as given. Without it the gradients are new arrays of one allocation
            (which each of them keeps alive).

    Returns:
        AttentionGradients(dq, dk, dv) of CuPy arrays with q's, k's and v's shapes and dtype.
        Gradients of broadcast or grouped k / v (and q) are summed over the broadcast
        positions. Extra device memory is O(N): float32 accumulators for dq, dk, dv (over
        the output's leading dims) and three float32 statistics per query row.

    Example:
        >>> o, l, m = cuflash.attention(q, k, v, causal=True)
        >>> dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, l, m, causal=True)
    """
    names = ("do", "q", "k", "v", "o", "l", "m")
    arrays = tuple(as_cupy(x, n) for x, n in zip((do, q, k, v, o, l, m), names))
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        _spine.check_varlen_options(block_mask)
        cu_q, cu_k, varlen = _varlen(*arrays[1:4], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        cu_seqlens = (cu_q.data.ptr, cu_k.data.ptr)
    else:
        varlen, cu_seqlens = None, ()
    try:
        key = ("cupy backward", *((x.shape, x.strides, x.dtype, x.data.device_id) for x in arrays), causal, scale,
               deterministic, block_mask, block_size, window, varlen)
        call = _recent(key)
    except TypeError:
        key = call = None
    if call is None:
        call = _spine.PLANS.get_or_build(key, _backward_call, arrays, causal, scale, deterministic, block_mask,
                                         block_size, window, varlen)
    return _run_backward(call, arrays, out, *cu_seqlens)


def _backward_outputs(call: _Call, arrays, out) -> tuple:
    """(dq, dk, dv, or None for a gradient summed by CuPy; the caller's arrays or None)."""
    plan = call.plan
    if out is None:
        made = iter(new_outputs(*call.specs))
        return [None if g.kind == "generic" else next(made) for g in plan.grads], None
    spans = [(name, x.data.ptr, e) for (name, e), x in zip(call.extents, arrays)]
    given = given_outputs(out, ("dq", "dk", "dv"), call.given_specs, plan.device_id, spans)
    return [None if g.kind == "generic" else x for g, x in zip(plan.grads, given)], given


def _run_backward(call: _Call, arrays, out, *cu_seqlens):
    """Outputs (unless given) and workspace from CuPy's pool, the plan's launches on CuPy's
    current stream."""
    import cupy

    plan = call.plan
    do, q, k, v, o, l, m = arrays
    stream, current = stream_on(plan.device_id)
    with (contextlib.nullcontext() if current else cupy.cuda.Device(plan.device_id)):
        grads, given = _backward_outputs(call, arrays, out)
        workspace = cupy.cuda.alloc(plan.workspace_bytes) if plan.workspace_bytes else None
        base = workspace.ptr if workspace is not None else 0
        plan.run((do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr,
                  *(0 if g is None else g.data.ptr for g in grads), base, *cu_seqlens), stream)
        for index, g in enumerate(plan.grads):
            if g.kind == "generic":  # broadcast inputs: summed back by CuPy
                acc = cupy.ndarray(g.acc_shape, np.float32, workspace + g.offset)
                grads[index] = _broadcast.reduce_to(acc, plan.out_lead, g.shape, g.group, _sum_keeping).astype(q.dtype)
                if given is not None:
                    given[index][...] = grads[index]
                    grads[index] = given[index]
    return AttentionGradients(*grads)


# ---- decoding against a KV cache -------------------------------------------------------------


def _decode_call(q, k, v, page_table, seqlens_k, causal, scale, window, num_splits) -> _Call:
    launch = _spine.decode_plan(q, k, v, page_table, seqlens_k, causal=causal, scale=scale, window=window,
                                  num_splits=num_splits, device=q.device.id)
    given = [(name, x) for name, x in zip(("q", "k", "v", "page_table", "seqlens_k"), (q, k, v, page_table, seqlens_k))
             if x is not None]
    return _Call(launch, launch.output_specs(q.dtype), _extents([x for _, x in given], [n for n, _ in given]))


def decode_attention(q, k, v, *, causal: bool = False, scale=None, window=None, page_table=None,
                     seqlens_k=None, num_splits=None, out=None) -> AttentionOutput:
    """Attention of a few queries a head against a KV cache, split over the keys.

    Args:
        q: (batch..., Hq, Nq, d) cupy array, Nq in 1..16; the batch dims (any number, also
            none) must address as one dim (``x.reshape(B, Hq, Nq, d)`` would be a view).
        k, v: dense caches (batch..., Hk, Nk, d) / (..., dv) with q's batch dims, or, with
            ``page_table``, paged caches (num_pages, Hk, page_size, d) / (..., dv), page_size
            a power of two in 16..256. Hk divides Hq: q head h reads k/v head h // (Hq // Hk).
            float16 or bfloat16, all three alike; d and dv multiples of 8 up to 128. Any
            strides whose last dim is contiguous and 16-byte aligned: vLLM's (num_pages,
            page_size, Hk, d) passes as ``.swapaxes(1, 2)`` without a copy.
        page_table: int32 (batch, max_pages), C-contiguous, on q's device: page of key j of
            sequence b is page_table[b, j // page_size]. An entry outside [0, num_pages) is
            never dereferenced: the keys of that page are masked.
        seqlens_k: int32 (batch,), on q's device: each sequence's key count. Required when
            paged; optional when dense (default Nk). Read by the kernel, never by the host:
            a value below 0 counts as 0, one above the capacity (Nk, or max_pages *
            page_size) as the capacity. A length of 0 gives o = 0, l = 0, m = -inf.
        causal: query i of Nq sees key j iff j <= len - Nq + i (aligned at each sequence's end).
        scale: multiplies q k^T; default 1 / sqrt(d).
        window: (left, right), the same alignment: len - Nq + i - left <= j <= len - Nq + i +
            right; -1 leaves a side unbounded. Combines with causal.
        num_splits: None (chosen from the batch, heads, row tiles, capacity and SM count) or
            1..MAX_DECODE_SPLITS: the key range of each (batch, k/v head) in that many CTAs.
        out: (o, l, m) to write, as :func:`cuflash.attention` takes it.

    Returns:
        AttentionOutput(o, l, m): o (batch..., Hq, Nq, dv) in q's dtype, l and m (batch...,
        Hq, Nq) float32, as :func:`cuflash.attention`: m = max_j S, l = sum_j exp(S - m),
        S = scale * q k^T over the allowed keys. Runs on CuPy's current stream; with more than
        one split, a float32 workspace comes from CuPy's memory pool.

    Example (vLLM's cache layout, one token a sequence):
        >>> k_cache = cupy.zeros((num_pages, page_size, 8, 128), cupy.float16)
        >>> o, l, m = decode_attention(q, k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2),
        ...                            page_table=block_tables, seqlens_k=context_lens)
    """
    import cupy

    q, k, v = as_cupy(q, "q"), as_cupy(k, "k"), as_cupy(v, "v")
    with q.device:
        arrays = (q, k, v, page_table, seqlens_k)
        try:
            key = ("cupy decode", *(None if x is None else (x.shape, x.strides, x.dtype, x.data.device_id)
                                    for x in arrays), causal, scale, window, num_splits)
            call = _recent(key)
        except (TypeError, AttributeError):  # unhashable or not arrays: the checks say what is wrong
            key = call = None
        if (q.data.ptr | k.data.ptr | v.data.ptr) & 15:  # planning again raises the alignment error
            key = call = None
        if call is None:
            call = _spine.PLANS.get_or_build(key, _decode_call, q, k, v, page_table, seqlens_k, causal, scale,
                                             window, num_splits)
        if out is not None:
            out = _checked(call, out, ("o", "l", "m"), [x for x in arrays if x is not None], q.data.device_id)
        return _run_launch(call.plan, call.specs, q, k, v, page_table, seqlens_k, None, out,
                           cupy.cuda.get_current_stream().ptr)


def run_plan(choice, q, k, v, *, page_table=None, seqlens_k=None, workspace=None, out=None) -> AttentionOutput:
    """Launch the plan of a decoding choice (cuflash._decode.plan_decode's) on CuPy arrays of the
    shapes and strides it was made for, on CuPy's current stream. ``workspace``: a device buffer
    (cupy.cuda.MemoryPointer or a float32 array) of at least ``choice.workspace_bytes`` bytes, or None
    to take it from CuPy's pool; ``out``: (o, l, m) to write, or None for new arrays. With both
    given a call allocates nothing (what a captured CUDA graph needs)."""
    import cupy

    launch = _spine.bound_plan(choice, q.data.device_id)
    specs = launch.output_specs(q.dtype) if out is None else None
    return _run_launch(launch, specs, q, k, v, page_table, seqlens_k, workspace, out,
                       cupy.cuda.get_current_stream().ptr)


def _run_launch(launch, specs, q, k, v, page_table, seqlens_k, workspace, out, stream):
    """One call of a DecodePlan (``launch``) on CuPy arrays, on the current device: outputs and
    workspace (``specs``: their layout) from CuPy's pool unless given."""
    import cupy

    if _VALIDATE:
        _spine.check_decode_choice(launch.choice, page_table, seqlens_k)
    if out is None:
        specs, nbytes = specs
        if workspace is None:  # one allocation holds them all
            o, l, m, workspace = new_outputs(specs, nbytes)
        else:  # o, l and m alone: the layout's first three, up to where the workspace starts
            o, l, m = new_outputs(specs[:3], specs[3][2])
    else:
        o, l, m = out
    ws = 0
    if launch.workspace_bytes:
        if workspace is None:
            workspace = cupy.cuda.alloc(launch.workspace_bytes)
        elif isinstance(workspace, cupy.ndarray) and (not workspace.flags.c_contiguous
                                                       or workspace.nbytes < launch.workspace_bytes):
            raise ValueError(f"workspace must be a contiguous array of at least {launch.workspace_bytes} bytes, "
                             f"got shape {workspace.shape}, dtype {workspace.dtype}")
        ws = workspace.data.ptr if isinstance(workspace, cupy.ndarray) else workspace.ptr
    launch.run((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr,
                0 if page_table is None else page_table.data.ptr, 0 if seqlens_k is None else seqlens_k.data.ptr,
                ws), stream)
    return AttentionOutput(o, l, m)
