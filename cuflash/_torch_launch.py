"""The torch adapter's launches (cuflash/torch.py): a call's plan found by its tensors' raw
arguments (shapes, strides, dtypes, devices, options) in the plan cache, run on torch's current
stream of the inputs' device, with outputs, statistics and scratch space from torch's caching
allocator. The eager path (autograd.Function) and the custom operators both end here.
"""

import math

import torch

from . import _broadcast, _spine, _views
from ._spine import PLANS

# CUFLASH_VALIDATE, read once: switched off, a call pays one test of this constant. Switched
# on, eager calls check their page tables, lengths and boundaries before launching, and so do
# the operators when a compiled graph runs them (not while torch.compile traces: the checks
# copy values to the host); cuflash._validate skips them while a CUDA graph captures.
_VALIDATE = _spine.validation_enabled()


def _out_lead_shape(q_shape, k_shape, v_shape):
    """Leading dims of o, l, m (torch.broadcast_shapes: fake tensors' sizes may be symbolic)."""
    return _broadcast.out_lead_shape(q_shape, k_shape, v_shape, torch.broadcast_shapes)


def _check_cuda(*tensors):
    device = tensors[0].device
    for t in tensors:
        if t.device.type != "cuda" or t.device != device:
            raise ValueError(
                f"cuflash.torch.attention needs CUDA tensors on one device, got devices "
                f"{', '.join(str(t.device) for t in tensors)}"
            )
    return device


try:  # the raw handle of torch's current stream, without building a torch.cuda.Stream
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older or newer torch
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


# The plan cache's hit path (cuflash/_cache.py): a call's raw arguments (shapes, strides,
# dtypes, devices, options) find its launch plan when it repeats a signature.
_recent = PLANS.recent.get


def _forward_impl(q, k, v, causal, scale, mask, window):
    """o, l, m of cuflash's forward on torch's current stream; outputs from torch's allocator,
    three of them (a custom operator's outputs may not share memory)."""
    plan, _ = _forward_plan(q, k, v, causal, scale, mask, window)
    device = q.device
    o = torch.empty(plan.o_shape, dtype=q.dtype, device=device)
    l = torch.empty(plan.stats_shape, dtype=torch.float32, device=device)
    m = torch.empty(plan.stats_shape, dtype=torch.float32, device=device)
    plan.run((q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), l.data_ptr(), m.data_ptr()),
             _raw_stream(device.index))
    return o, l, m


def _split_stats(stats, shape):
    """l and m as views of a call's float32 statistics buffer (l's rows, then m's)."""
    n = math.prod(shape)
    return stats[:n].view(shape), stats[n:2 * n].view(shape)


def _forward_plan(q, k, v, causal, scale, mask, window, route=False):
    """(the forward plan of a call's signature, the decoding launch it is routed to or None),
    found by the call's raw arguments. ``route``: the call may take the split-KV kernels (autograd
    does not record it), as cuflash.attention routes a few queries a head against many keys."""
    key = ("torch forward", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, q.device, k.device, v.device, causal, scale, mask, window, route)
    entry = _recent(key)
    if entry is None:
        entry = PLANS.get_or_build(key, _new_forward_plan, q, k, v, causal, scale, mask, window, route)
    return entry


def _new_forward_plan(q, k, v, causal, scale, mask, window, route=False, varlen=None):
    device = _check_cuda(q, k, v)
    problem = _spine.forward_problem((q.shape, k.shape, v.shape), (q.stride(), k.stride(), v.stride()),
                                     (q.dtype, k.dtype, v.dtype), device.index, causal=causal, scale=scale, mask=mask,
                                     window=window, varlen=varlen)
    plan = _spine.forward(problem, (q.data_ptr(), k.data_ptr(), v.data_ptr()))
    launch = None
    if route and plan.kernel is not None:  # asked on zero-copy views, as the CuPy front end asks it
        with _spine.on_device(device.index):
            views = [_views.torch_view(t, same_stream=True) for t in (q, k, v)]
        launch = _spine.routed(*views, problem)
    return plan, launch


def _forward_with_plan(q, k, v, causal, scale, mask, window, route=False):
    """o, the statistics buffer (l's rows, then m's: _split_stats; one allocation for both) and
    the forward's plan, by which the eager backward finds its own. With ``route`` (a call
    autograd does not record) a few queries a head against many keys take the split-KV
    decoding kernels, as cuflash.attention routes them (_spine.routed)."""
    plan, launch = _forward_plan(q, k, v, causal, scale, mask, window, route)
    if launch is not None:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            plan.check_alignment((q.data_ptr(), k.data_ptr(), v.data_ptr()))  # the error the forward gives
        return (*_decode_run(launch, q, k, v, None, None), plan)
    device = q.device
    o = torch.empty(plan.o_shape, dtype=q.dtype, device=device)
    stats = torch.empty(2 * plan.stats_rows, dtype=torch.float32, device=device)
    l = stats.data_ptr()
    plan.run((q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), l, l + 4 * plan.stats_rows),
             _raw_stream(device.index))
    return o, stats, plan


# ---- packed variable-length batches ------------------------------------------------------


def _varlen_boundaries(q, cu_seqlens_q, cu_seqlens_k):
    """The number of sequences, after the checks of cu_seqlens_q / _k (dtype, rank, length,
    q's device); their values are not read."""
    meta = [None if c is None else (tuple(c.shape), _spine.dtype_name(c.dtype), c.device)
            for c in (cu_seqlens_q, cu_seqlens_k)]
    return _spine.check_cu_seqlens(*meta, q.device)


def _max_seqlens(cu_q, cu_k, max_seqlen_q, max_seqlen_k, q, k):
    """The operators' max_seqlen arguments (-1: compute from the boundaries) as host ints."""
    max_q = _spine.longest_sequence(cu_q, q.shape[-2]) if max_seqlen_q < 0 else max_seqlen_q
    max_k = _spine.longest_sequence(cu_k, k.shape[-2]) if max_seqlen_k < 0 else max_seqlen_k
    return max_q, max_k


def _varlen_forward_impl(q, k, v, causal, scale, window, cu_q, cu_k, max_seqlen_q, max_seqlen_k):
    """o, l, m of a packed variable-length batch on torch's current stream."""
    max_q, _ = _max_seqlens(cu_q, cu_k, max_seqlen_q, 0, q, k)
    num_seqs = _varlen_boundaries(q, cu_q, cu_k)
    key = ("torch varlen forward", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, q.device, k.device, v.device, causal, scale, window, num_seqs, max_q)
    entry = _recent(key)
    if entry is None:
        entry = PLANS.get_or_build(key, _new_forward_plan, q, k, v, causal, scale, None, window, False,
                                   _spine.Varlen(num_seqs, max_q))
    plan = entry[0]
    if _VALIDATE and not torch.compiler.is_compiling():
        _spine.check_varlen_inputs(cu_q, cu_k, total_q=q.shape[-2], total_k=k.shape[-2])
    device = q.device
    o = torch.empty(plan.o_shape, dtype=q.dtype, device=device)
    l = torch.empty(plan.stats_shape, dtype=torch.float32, device=device)
    m = torch.empty(plan.stats_shape, dtype=torch.float32, device=device)
    plan.run((q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), l.data_ptr(), m.data_ptr(), cu_q.data_ptr(),
              cu_k.data_ptr()), _raw_stream(device.index))
    return o, l, m


def _decode_impl(q, k, v, causal, scale, window, page_table=None, seqlens_k=None, num_splits=None):
    """o and the statistics buffer (_split_stats) of the split-KV decoding kernels (forward
    only) on torch's current stream, every buffer from
    torch's allocator and the launch bound once per signature: a decode step can be captured in
    a CUDA graph (lengths and pages are read from device memory, never by the host)."""
    tensors = (q, k, v, page_table, seqlens_k)
    key = ("torch decode", *(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors),
           causal, scale, window, num_splits)
    launch = _recent(key)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:  # planning again raises the alignment error
        key = launch = None
    if launch is None:
        launch = PLANS.get_or_build(key, _decode_plan, tensors, causal, scale, window, num_splits)
    if _VALIDATE and not torch.compiler.is_compiling():
        _spine.check_decode_choice(launch.choice, page_table, seqlens_k)
    return _decode_run(launch, q, k, v, page_table, seqlens_k)


def _decode_plan(tensors, causal, scale, window, num_splits):
    """The DecodePlan of (q, k, v, page_table, seqlens_k), planned on zero-copy views."""
    import cupy

    device = _check_cuda(*(t for t in tensors if t is not None))
    with cupy.cuda.Device(device.index):
        views = [None if t is None else _views.torch_view(t, same_stream=True) for t in tensors]
        return _spine.decode_plan(*views, causal=causal, scale=scale, window=window, num_splits=num_splits,
                                    device=device.index)


def _decode_run(launch, q, k, v, page_table, seqlens_k):
    """o and the statistics buffer (as _forward_with_plan's) of one call of the DecodePlan
    ``launch``; the buffer's tail past the statistics is its workspace: two allocations a call."""
    choice, device = launch.choice, q.device
    o = torch.empty(choice.out_shape, dtype=q.dtype, device=device)
    rows = math.prod(choice.out_shape[:-1])
    workspace_at = _spine.align(8 * rows)  # bytes: l and m, then the workspace
    floats = (workspace_at + launch.workspace_bytes) // 4 if launch.workspace_bytes else 2 * rows
    stats = torch.empty(floats, dtype=torch.float32, device=device)
    l = stats.data_ptr()
    launch.run((q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), l, l + 4 * rows,
                0 if page_table is None else page_table.data_ptr(), 0 if seqlens_k is None else seqlens_k.data_ptr(),
                l + workspace_at if launch.workspace_bytes else 0), _raw_stream(device.index))
    return o, stats



def _sum_keeping(x, axes):
    return x.sum(dim=axes, keepdim=True)


def _backward_impl(do, q, k, v, o, l, m, causal, scale, mask, window, deterministic, varlen=None):
    """dq, dk, dv on torch's current stream. varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k) of a packed batch."""
    plan, do, cu_seqlens = _backward_signature(do, q, k, v, o, l, m, causal, scale, mask, window, deterministic,
                                               varlen, None, None)
    return _backward_run(plan, do, q, k, v, o, l.data_ptr(), m.data_ptr(), cu_seqlens)


def _eager_backward(forward_plan, do, q, k, v, o, stats, causal, scale, mask, window, deterministic):
    """dq, dk, dv of a dense call the eager path ran on ``forward_plan`` (q, k, v, o and the
    statistics buffer ``stats`` are what it ran on, and autograd gives dO o's shape and device):
    the backward's plan is looked up by the forward's plan and dO's strides and dtype alone."""
    l = stats.data_ptr()
    m = l + 4 * forward_plan.stats_rows
    short = None
    if not do.data_ptr() & 15:  # a misaligned dO is copied
        short = ("torch eager backward", forward_plan, do.stride(), do.dtype, deterministic)
        plan = _recent(short)
        if plan is not None:
            return _backward_run(plan, do, q, k, v, o, l, m, ())
    plan, do, _ = _backward_signature(do, q, k, v, o, *_split_stats(stats, o.shape[:-1]), causal, scale, mask,
                                      window, deterministic, None, forward_plan, short)
    return _backward_run(plan, do, q, k, v, o, l, m, ())


def _backward_signature(do, q, k, v, o, l, m, causal, scale, mask, window, deterministic, varlen, forward_plan,
                        short):
    """The backward plan of a full signature, dO as the kernels will read it, and the packed
    batch's boundary pointers (none when dense)."""
    # The incoming gradient's layout is autograd's choice, not the user's: e.g. the gradient
    # of o.sum() is an expanded (stride-0) tensor, which cuflash cannot read. Copy then.
    copied = not _kernel_readable(do)
    if copied:
        do = do.contiguous()
    tensors = (do, q, k, v, o, l, m)
    cu_seqlens = ()
    if varlen is not None:
        cu_q, cu_k, max_q, max_k = varlen
        max_q, max_k = _max_seqlens(cu_q, cu_k, max_q, max_k, q, k)
        packed = (_varlen_boundaries(q, cu_q, cu_k), max_q, max_k)
        cu_seqlens = (cu_q.data_ptr(), cu_k.data_ptr())
    else:
        packed = None
    key = ("torch backward", *((t.shape, t.stride(), t.dtype, t.device) for t in tensors), causal, scale, mask,
           window, deterministic, packed)
    plan = _recent(key)
    if plan is None:
        plan = PLANS.get_or_build(key, _new_backward_plan, tensors, causal, scale, mask, window, deterministic,
                                  None if packed is None else _spine.Varlen(*packed))
    if varlen is not None and _VALIDATE and not torch.compiler.is_compiling():
        _spine.check_varlen_inputs(cu_q, cu_k, total_q=q.shape[-2], total_k=k.shape[-2])
    if short is not None and not copied:  # a dO laid out like this one needs no copy either
        PLANS.get_or_build(short, lambda found: found, plan)
    return plan, do, cu_seqlens


def _new_backward_plan(tensors, causal, scale, mask, window, deterministic, varlen=None):
    do, q, k, v, o, l, m = tensors
    device = _check_cuda(*tensors)
    main = (do, q, k, v, o)
    problem = _spine.backward_problem(
        tuple(t.shape for t in main), tuple(t.stride() for t in main), tuple(t.dtype for t in main),
        tuple((t.shape, t.stride(), t.dtype) for t in (l, m)), device.index, causal=causal, scale=scale, mask=mask,
        window=window, deterministic=deterministic, varlen=varlen)
    return _spine.backward(problem, tuple(t.data_ptr() for t in main))


def _backward_run(plan, do, q, k, v, o, l, m, cu_seqlens):
    """The plan's launches; l and m: the statistics' pointers."""
    device = q.device
    grads = [None if g.kind == "generic" else torch.empty(g.shape, dtype=q.dtype, device=device)
             for g in plan.grads]
    workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device) if plan.workspace_bytes else None
    base = 0 if workspace is None else workspace.data_ptr()
    plan.run((do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), l, m,
              *(0 if g is None else g.data_ptr() for g in grads), base, *cu_seqlens), _raw_stream(device.index))
    for index, g in enumerate(plan.grads):
        if g.kind == "generic":  # broadcast inputs: summed back by torch
            acc = workspace[g.offset:g.offset + 4 * math.prod(g.acc_shape)].view(torch.float32).view(g.acc_shape)
            grads[index] = _broadcast.reduce_to(acc, plan.out_lead, g.shape, g.group, _sum_keeping).to(q.dtype)
    return tuple(grads)


def _kernel_readable(t: torch.Tensor) -> bool:
    """Whether cuflash reads ``t`` in place: unit last stride, no broadcast (stride-0) dims,
    16-byte aligned pointer and strides (the 16-bit kernels load 16-byte vectors)."""
    if t.numel() == 0:
        return True
    per_vector = 16 // t.element_size()
    outer = [s for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1]
    return (
        (t.shape[-1] == 1 or t.stride(-1) == 1)
        and t.data_ptr() % 16 == 0
        and all(s > 0 and s % per_vector == 0 for s in outer)
    )
