"""cuflash.attention and cuflash.attention_backward on CuPy arrays.

A call takes its arrays zero-copy, looks up the launch plan of its signature (cuflash/_plan.py
builds one the first time, with every argument check), allocates its outputs from CuPy's pool
and hands the plan their pointers and CuPy's current stream.
"""

from __future__ import annotations

import contextlib

import numpy as np

from . import _broadcast, _checks, _decode, _plan
from ._arrays import (AttentionGradients, AttentionOutput, as_cupy, extent, given_outputs, longest_sequence,
                      new_outputs, one_device, output_specs, stream_on)
from ._arrays import element_strides as _element_strides
from ._cache import PLANS
from ._checks import as_block_mask
from .masks import window_option


def _forward_outputs(plan, q, k, v, out):
    """o, l, m of a forward plan's call: new (one allocation) or the caller's, checked."""
    specs = plan.cupy_outputs
    if specs is None:
        specs = plan.cupy_outputs = output_specs(((plan.o_shape, q.dtype), (plan.stats_shape, np.float32),
                                                  (plan.stats_shape, np.float32)))
    if out is None:
        return new_outputs(*specs)
    extents = plan.cupy_extents
    if extents is None:
        size = q.dtype.itemsize
        extents = plan.cupy_extents = tuple((name, extent(shape, strides, size)) for name, shape, strides in plan.operands)
    inputs = [(name, x.data.ptr, e) for (name, e), x in zip(extents, (q, k, v))]
    return given_outputs(out, ("o", "l", "m"), specs[0], plan.device_id, inputs)


# The plan cache's hit path. A call's raw arguments (shapes, byte strides, dtypes, devices,
# options) find its plan: a call repeating a signature skips even the normalisation of its
# arguments. Arguments that cannot be hashed (a boolean array as block_mask, a list as window)
# take the normalising path every time.
_recent = PLANS.recent.get


def _forward_plan(q, k, v, causal, scale, block_mask, block_size, window):
    dtype = _checks.check_dtypes(q.dtype, k.dtype, v.dtype)
    device = one_device((q, k, v), "q, k and v")
    mask = as_block_mask(block_mask, block_size)
    plan = _plan.forward_plan(q.shape, _element_strides(q), k.shape, _element_strides(k), v.shape,
                              _element_strides(v), dtype, device, causal, scale, mask, window_option(window),
                              (q.data.ptr, k.data.ptr, v.data.ptr))
    plan.decode = _decode.routes_short_queries(q, k, v, mask)
    return plan


def attention(q, k, v, *, causal: bool = False, scale=None, block_mask=None, block_size=None,
              window=None, page_table=None, seqlens_k=None, num_splits=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, out=None) -> AttentionOutput:
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
        page_table, seqlens_k: a KV cache for decoding. ``k``/``v`` of shape (num_pages, Hk,
            page_size, d) (vLLM's and FlashInfer's (num_pages, page_size, Hk, d) pass as
            ``.swapaxes(1, 2)``), ``page_table`` int32 (batch, max_pages) and ``seqlens_k`` int32
            (batch,) on the device; ``seqlens_k`` alone gives per-sequence lengths of a dense
            cache. Causal and window are aligned at each sequence's end. See
            :func:`cuflash._decode.decode_attention` for the rules on out-of-range values.
        num_splits: the split-KV decoding path's number of key splits (None: chosen from the
            shapes and the SM count). Calls with 1-16 queries a head against at least 256 keys
            (16-bit, head dims up to 128, no block mask) take that path on their own.
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
        _checks.check_varlen_options(block_mask, page_table, seqlens_k, num_splits)
        return _varlen_attention(q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, out)
    try:
        key = ("cupy forward", q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, k.dtype,
               v.dtype, q.data.device_id, k.data.device_id, v.data.device_id, causal, scale, block_mask, block_size,
               window)
        plan = _recent(key)
    except TypeError:  # an unhashable argument
        key = plan = None
    if page_table is not None or seqlens_k is not None or num_splits is not None:
        if block_mask is not None:
            raise ValueError("block_mask cannot be combined with page_table, seqlens_k or num_splits "
                             "(the split-KV decoding path)")
        page_table = None if page_table is None else as_cupy(page_table, "page_table")
        seqlens_k = None if seqlens_k is None else as_cupy(seqlens_k, "seqlens_k")
        return _decode.decode_attention(q, k, v, causal=causal, scale=scale, window=window, page_table=page_table,
                                        seqlens_k=seqlens_k, num_splits=num_splits, out=out)
    if plan is None:
        plan = PLANS.get_or_build(key, lambda: _forward_plan(q, k, v, causal, scale, block_mask, block_size, window))
    if plan.decode:
        return _decode.run_routed(plan, q, k, v, causal, scale, window, out)
    stream, current = stream_on(plan.device_id)
    with (contextlib.nullcontext() if current else cupy.cuda.Device(plan.device_id)):
        o, l, m = _forward_outputs(plan, q, k, v, out)
    plan.run(q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr, stream)
    return AttentionOutput(o, l, m)


# ---- packed variable-length batches --------------------------------------------------------


def varlen_boundaries(cu_seqlens_q, cu_seqlens_k, q):
    """cu_seqlens_q / _k as CuPy arrays, checked (dtype, rank, length, q's device); returns them
    and the number of sequences. Their values are not read."""
    cu = [None if c is None else as_cupy(c, n) for c, n in ((cu_seqlens_q, "cu_seqlens_q"),
                                                            (cu_seqlens_k, "cu_seqlens_k"))]
    meta = [None if c is None else (c.shape, _checks.dtype_name(c.dtype), c.data.device_id) for c in cu]
    num_seqs = _checks.check_cu_seqlens(*meta, q.data.device_id)
    return cu[0], cu[1], num_seqs


def _varlen_lengths(cu_q, cu_k, max_seqlen_q, max_seqlen_k, total_q, total_k):
    """max_seqlen_q / _k checked, or computed from the boundaries where None (a host sync)."""
    import cupy

    max_q = _checks.check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _checks.check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if max_q is None or max_k is None:
        with cupy.cuda.Device(cu_q.data.device_id):
            max_q = longest_sequence(cu_q, total_q) if max_q is None else max_q
            max_k = longest_sequence(cu_k, total_k) if max_k is None else max_k
    return max_q, max_k


def _varlen_attention(q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      out=None):
    import cupy

    cu_q, cu_k, num_seqs = varlen_boundaries(cu_seqlens_q, cu_seqlens_k, q)
    _checks.check_varlen_shapes(q.shape, k.shape, v.shape)
    max_q, max_k = _varlen_lengths(cu_q, cu_k, max_seqlen_q, max_seqlen_k, q.shape[-2], k.shape[-2])
    dtype = _checks.check_dtypes(q.dtype, k.dtype, v.dtype)
    device = one_device((q, k, v), "q, k and v")
    plan = _plan.varlen_forward_plan(q.shape, _element_strides(q), k.shape, _element_strides(k), v.shape,
                                     _element_strides(v), dtype, device, causal, scale, window_option(window),
                                     num_seqs, max_q, (q.data.ptr, k.data.ptr, v.data.ptr))
    stream, current = stream_on(plan.device_id)
    with (contextlib.nullcontext() if current else cupy.cuda.Device(plan.device_id)):
        o, l, m = _forward_outputs(plan, q, k, v, out)
    plan.run(q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr, stream, cu_q.data.ptr,
             cu_k.data.ptr)
    return AttentionOutput(o, l, m)


def _backward_plan(arrays, causal, scale, deterministic, block_mask, block_size, window):
    do, q, k, v, o, l, m = arrays
    dtype = _checks.check_dtypes(q.dtype, k.dtype, v.dtype)
    _checks.check_like_q(dtype, do=do.dtype, o=o.dtype)
    device = one_device(arrays, "all arguments")
    mask = as_block_mask(block_mask, block_size)
    tensors = (do, q, k, v, o)
    stats = tuple((x.shape, _element_strides(x), _checks.dtype_name(x.dtype)) for x in (l, m))
    return _plan.backward_plan(tuple(x.shape for x in tensors), tuple(_element_strides(x) for x in tensors),
                               dtype, stats, device, causal, scale, mask, window_option(window), deterministic,
                               tuple(x.data.ptr for x in tensors))


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
        _checks.check_varlen_options(block_mask)
        return _varlen_backward(arrays, causal, scale, deterministic, window, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, out)
    try:
        key = ("cupy backward", *((x.shape, x.strides, x.dtype, x.data.device_id) for x in arrays), causal, scale,
               deterministic, block_mask, block_size, window)
        plan = _recent(key)
    except TypeError:
        key = plan = None
    if plan is None:
        plan = PLANS.get_or_build(key, lambda: _backward_plan(arrays, causal, scale, deterministic, block_mask,
                                                              block_size, window))
    return _run_backward(plan, arrays, out)


def _backward_outputs(plan, arrays, out) -> tuple:
    """(dq, dk, dv, or None for a gradient summed by CuPy; the caller's arrays or None)."""
    q = arrays[1]
    if plan.cupy_outputs is None:  # the kernels' gradients, in one allocation
        plan.cupy_outputs = output_specs((g.shape, q.dtype) for g in plan.grads if g.kind != "generic")
    if out is None:
        made = iter(new_outputs(*plan.cupy_outputs))
        return [None if g.kind == "generic" else next(made) for g in plan.grads], None
    if plan.cupy_extents is None:  # of do, q, k, v, o, l, m; and the specs of all three gradients
        size, (l, m) = q.dtype.itemsize, arrays[5:]
        plan.cupy_extents = (tuple((name, extent(shape, strides, size)) for name, shape, strides in plan.operands)
                             + (("l", (0, l.nbytes) if l.nbytes else None), ("m", (0, m.nbytes) if m.nbytes else None)),
                             output_specs((g.shape, q.dtype) for g in plan.grads)[0])
    extents, specs = plan.cupy_extents
    inputs = [(name, x.data.ptr, e) for (name, e), x in zip(extents, arrays)]
    given = given_outputs(out, ("dq", "dk", "dv"), specs, plan.device_id, inputs)
    return [None if g.kind == "generic" else x for g, x in zip(plan.grads, given)], given


def _run_backward(plan, arrays, out, *cu_seqlens):
    """Outputs (unless given) and workspace from CuPy's pool, the plan's launches on CuPy's
    current stream."""
    import cupy

    do, q, k, v, o, l, m = arrays
    stream, current = stream_on(plan.device_id)
    with (contextlib.nullcontext() if current else cupy.cuda.Device(plan.device_id)):
        grads, given = _backward_outputs(plan, arrays, out)
        workspace = cupy.cuda.alloc(plan.workspace_bytes) if plan.workspace_bytes else None
        base = workspace.ptr if workspace is not None else 0
        plan.run(do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, l.data.ptr, m.data.ptr,
                 *(0 if g is None else g.data.ptr for g in grads), base, stream, *cu_seqlens)
        for index, g in enumerate(plan.grads):
            if g.kind == "generic":  # broadcast inputs: summed back by CuPy
                acc = cupy.ndarray(g.acc_shape, np.float32, workspace + g.offset)
                grads[index] = _broadcast.reduce_to(acc, plan.out_lead, g.shape, g.group, _sum_keeping).astype(q.dtype)
                if given is not None:
                    given[index][...] = grads[index]
                    grads[index] = given[index]
    return AttentionGradients(*grads)


def _varlen_backward(arrays, causal, scale, deterministic, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, out=None):
    do, q, k, v, o, l, m = arrays
    cu_q, cu_k, num_seqs = varlen_boundaries(cu_seqlens_q, cu_seqlens_k, q)
    _checks.check_varlen_shapes(q.shape, k.shape, v.shape)
    max_q, max_k = _varlen_lengths(cu_q, cu_k, max_seqlen_q, max_seqlen_k, q.shape[-2], k.shape[-2])
    dtype = _checks.check_dtypes(q.dtype, k.dtype, v.dtype)
    _checks.check_like_q(dtype, do=do.dtype, o=o.dtype)
    device = one_device(arrays, "all arguments")
    tensors = (do, q, k, v, o)
    stats = tuple((x.shape, _element_strides(x), _checks.dtype_name(x.dtype)) for x in (l, m))
    plan = _plan.varlen_backward_plan(tuple(x.shape for x in tensors), tuple(_element_strides(x) for x in tensors),
                                      dtype, stats, device, causal, scale, window_option(window), deterministic,
                                      num_seqs, max_q, max_k, tuple(x.data.ptr for x in tensors))
    return _run_backward(plan, arrays, out, cu_q.data.ptr, cu_k.data.ptr)
