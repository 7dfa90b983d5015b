"""The backward's plan: the preprocess, the key passes, the dQ pass and the gradient reduces of
one backward signature, with the workspace layout (statistics, accumulators) bound once, and
``run`` on raw pointers."""

from __future__ import annotations

import functools
import math
import struct
import threading
from typing import NamedTuple

from . import _checks, _config, _constants, _driver, _launch, _params, _tma, _variants
from ._arrays import align
from ._broadcast import broadcast_layout
from ._driver import Context

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


class BackwardPlan(_launch.Plan):
    """One backward problem's launches: ``run((do, q, k, v, o, l, m, dq, dk, dv, workspace),
    stream)`` on raw pointers (dq/dk/dv: 0 for a 'generic' gradient, which the caller makes; a
    varlen batch's with cu_seqlens_q, cu_seqlens_k after them)."""

    def __init__(self, problem, grads, out_lead, workspace_bytes=0, delta_offset=0, zero=None, kernels=(),
                 fwd_blocks=(), bwd_block=None, reduces=(), zero_grads=False, maps=None, fallback=None):
        self.problem = problem
        self.pointer_names = ("do", "q", "k", "v", "o", "l", "m", "dq", "dk", "dv", "workspace") + (
            ("cu_seqlens_q", "cu_seqlens_k") if problem.varlen is not None else ())
        self.device_id = problem.device
        self.dtype = problem.dtype
        self.operands = problem.operands
        self.vectors = problem.dtype != "float32"
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
        self.varlen = problem.varlen is not None  # the launches read cu_seqlens_q / cu_seqlens_k
        self.ctx = _driver.device_context(problem.device)
        self.lock = threading.Lock()

    def run(self, pointers, stream):
        if self.vectors and (pointers[0] | pointers[1] | pointers[2] | pointers[3] | pointers[4]) & 15:
            self.check_alignment(pointers)
        with self.lock:
            if self.maps is None or self.maps.bind((pointers[1], pointers[2], pointers[3], pointers[0])):
                with Context(self.ctx) as drv:
                    self._launch(drv, pointers, stream)
                return
        self.fallback().run(pointers, stream)

    def _launch(self, drv, pointers, stream):
        do, q, k, v, o, l, m, dq, dk, dv, workspace = pointers[:11]
        outs = (dq, dk, dv)
        if self.zero_grads:
            for ptr, grad in zip(outs, self.grads):
                nbytes = math.prod(grad.shape) * _checks.itemsize(self.dtype)
                if nbytes:
                    _driver.check(drv.memset_async(ptr, nbytes, stream), "cudaMemsetAsync")
            return
        accs = [ptr if g.kind == "direct" else workspace + g.offset for ptr, g in zip(outs, self.grads)]
        lse2, delta = workspace, workspace + self.delta_offset
        inputs = pointers[1:7]  # q, k, v, o, l, m
        for block in self.fwd_blocks:
            block[0:6] = inputs
            if self.varlen:
                block[_params.CU_SEQLENS_WORD:_params.CU_SEQLENS_WORD + 2] = pointers[11:]
        self.bwd_block[0:9] = (do, o, l, m, lse2, delta, *accs)
        if self.zero is not None:
            _driver.check(drv.memset_async(accs[0], self.zero, stream), "cudaMemsetAsync")
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
    return _driver.words(struct.pack(_params.BWD_PARAM_FORMAT, *(0,) * 9, nq_pad, *do_lead, *o_lead, strides[0][-2],
                              strides[4][-2], int(dkv_in_dtype), int(zero_dq_acc), head_group))


def _reduce_kernels(grads, out_lead, dtype, device_id) -> list:
    """(Kernel, gradient index) of each gradient summed over broadcast or grouped heads on the GPU."""
    reduces = []
    for index, grad in enumerate(grads):
        if grad.kind != "reduce":
            continue
        variant = _variants.GradientReduce(dtype)
        inner = math.prod(grad.acc_shape[len(out_lead):])
        outer = math.prod(grad.shape[:-2])
        per_cta = variant.threads * variant.elements_per_thread
        grid = (max(1, min(-(-outer * inner // per_cta), 16 * _driver.sm_count(device_id))), 1, 1)
        block = _driver.words(struct.pack(_params.REDUCE_PARAM_FORMAT, 0, 0, grad.group, inner, outer))
        reduces.append((_driver.Kernel(variant, device_id, grid, [block]), index))
    return reduces


def build_backward(problem, ptrs) -> BackwardPlan:
    """Every check and choice of a backward problem (cuflash/_problem.py: dense, block-sparse or
    a packed varlen batch), bound into its plan; ``ptrs`` (do, q, k, v, o) of the call that asks
    first check the alignment and encode the tensor maps' templates."""
    do_shape, q_shape, k_shape, v_shape, o_shape = problem.shapes
    varlen, strides = problem.varlen, problem.strides
    if varlen is not None:
        _checks.check_varlen_shapes(q_shape, k_shape, v_shape)
    nq, nk, d, dv = _checks.check_head_dims(q_shape, k_shape, v_shape)
    for name, shape, st in problem.operands:
        _checks.check_last_dim_contiguous(name, shape, st)
    out_lead = broadcast_layout(*problem.qkv).out_lead_shape
    out_shape = out_lead + (nq, dv)
    _check_forward_outputs(do_shape, o_shape, out_shape)
    mask, window = _checks.check_sparsity(problem.mask, None, problem.window, nq, nk, out_lead)
    layout = _checks.layout_with_mask(problem.qkv, ((do_shape, strides[0]), (o_shape, strides[4])), mask)
    _check_stats(problem.stats, out_shape[:-1])
    scale = _checks.resolve_scale(problem.scale, d)
    heads = math.prod(layout.lead_shape)
    slices = heads * (varlen.num_seqs if varlen is not None else 1)  # a varlen slice: (sequence, head)
    grad_shapes = (q_shape, k_shape, v_shape)
    if slices == 0 or nq == 0 or nk == 0:  # no query sees a key: every gradient is 0
        grads = tuple(GradientOut("direct", 0, s, 1, s) for s in grad_shapes)
        return BackwardPlan(problem, grads, out_lead, zero_grads=True)
    _launch.check_vector_operands(problem.operands, ptrs, problem.dtype)
    # The rows a slice's grid covers: all of them, or the longest sequence the caller announces.
    longest_q, longest_k = (nq, nk) if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k)
    grouped = layout.kv_group > 1 and all(tuple(s[:-2]) == _grouped_lead(out_lead, layout.kv_group)
                                          for s in grad_shapes[1:])
    cc = _driver.compute_capability(problem.device)
    choice = _config.backward_choice(
        problem.dtype, d, dv, problem.causal, problem.deterministic, hopper=_config.is_hopper(cc),
        wgmma=_config.has_wgmma(cc), sparse=mask is not None, varlen=varlen is not None, nk=nk, slices=slices,
        kv_group=layout.kv_group if grouped else 1, key_tiles=lambda cols: _launch.grid_tiles(longest_k, nk, cols),
        sm_count=_driver.sm_count(problem.device))
    # The backward's statistics: per slice, its query rows padded to STATS_ROW_MULTIPLE (varlen:
    # each sequence's, at the offsets kernels/slice.cuh gives).
    r = _constants.STATS_ROW_MULTIPLE
    nq_pad = -(-nq // r) * r if varlen is None else _launch.varlen_stats_rows(nq, varlen.num_seqs)
    stats_rows = nq_pad if varlen is None else -(-min(longest_q, nq) // r) * r  # the preprocess's
    geometry = _launch.Geometry(problem, nq, nk, d, dv, layout, out_lead, scale, mask, window, slices, longest_q,
                                longest_k, heads, nq_pad, stats_rows)
    return _bound_backward(geometry, choice, ptrs)


def _bound_backward(g: _launch.Geometry, choice, ptrs, kernels=None) -> BackwardPlan:
    """The plan of ``choice`` (its kernels, or those given: its cp.async form)."""
    problem, kplan, group = g.problem, kernels or choice.kernels, choice.head_group
    strides, device, varlen = problem.strides, problem.device, problem.varlen
    row_strides = (strides[1][-2], strides[2][-2], strides[3][-2])
    maps = _backward_maps(kplan, g.nq, g.nk, g.d, g.layout, row_strides, strides[0][-2], ptrs)
    if maps is not None and not maps.ok:  # the copy engine cannot map these inputs
        return _bound_backward(g, choice, ptrs, choice.without_tensor_maps)
    grad_shapes = problem.shapes[1:4]
    grads, delta_offset, end = gradient_layout(grad_shapes, g.out_lead, g.layout.kv_group, problem.dtype, g.heads,
                                               g.nq_pad, group)
    kv_direct = grads[1].kind == "direct"
    # Atomic dQ adds into a zeroed accumulator: a dense batch's preprocess, which visits every
    # query row first, zeroes it (BwdParams.zero_dq_acc: one launch fewer than a memset); a
    # varlen batch's is cleared by a memset.
    zero_in_preprocess = kplan.atomic_dq and varlen is None
    zero = 4 * math.prod(grads[0].acc_shape) if kplan.atomic_dq and varlen is not None else None
    do_lead, o_lead = g.layout.extra_strides[:2]
    bwd_block = _backward_block(g.nq_pad, do_lead, o_lead, strides, kv_direct and problem.dtype != "float32",
                                zero_in_preprocess, group)
    mask_strides = g.layout.extra_strides[-1] if g.mask is not None else ()
    num_seqs = varlen.num_seqs if varlen is not None else 0
    fwd_blocks, kernels = [], []

    def add(variant, grid_x, transpose=False, slices=g.slices):
        tiled = g.mask if variant is not kplan.preprocess else None  # the preprocess walks no tiles
        with _driver.device(device):
            sparsity, lists = _launch.sparsity_fields(tiled, mask_strides, g.nq, g.nk, variant, transpose=transpose,
                                                      causal=problem.causal, window=g.window)
        block = _driver.words(_launch.forward_params(g.nq, g.nk, g.d, g.dv, g.layout, row_strides, g.scale, sparsity,
                                                     num_seqs))
        fwd_blocks.append(block)
        kernel = _driver.Kernel(variant, device, _launch.slice_grid(grid_x, slices),
                                _backward_params(variant, block, bwd_block, maps), g.d, g.dv)
        kernel.lists = lists
        kernels.append(kernel)

    add(kplan.preprocess, max(1, -(-g.stats_rows // kplan.preprocess.rows_a_cta(g.dv))))
    for variant in kplan.key_passes:  # one CTA per key tile (and group of heads): the transposed lists
        key_tiles = _launch.grid_tiles(g.longest_k, g.nk, variant.block_cols)
        if getattr(variant, "persistent", False):  # one CTA an SM walks every (key tile, slice)
            add(variant, min(key_tiles * g.slices, _driver.sm_count(device)), transpose=True, slices=1)
        else:
            add(variant, key_tiles, transpose=True, slices=g.slices // group)
    if kplan.dq is not None:  # one CTA per query tile
        add(kplan.dq, _launch.grid_tiles(g.longest_q, g.nq, kplan.dq.block_rows))
    fallback = None
    if maps is not None:  # the cp.async plan, for pointers the copy engine refuses; built on first need
        fallback = functools.lru_cache(maxsize=1)(lambda: _bound_backward(g, choice, ptrs,
                                                                          choice.without_tensor_maps))
    return BackwardPlan(problem, tuple(grads), g.out_lead, end, delta_offset, zero, tuple(kernels), tuple(fwd_blocks),
                        bwd_block, tuple(_reduce_kernels(grads, g.out_lead, problem.dtype, device)), maps=maps,
                        fallback=fallback)


def _backward_maps(kplan, nq, nk, d, layout, row_strides, do_row_stride, ptrs):
    """The tensor maps (q, k, v, dO) of a wgmma key pass that loads through them, else None;
    row_strides: of q, k, v; ptrs: of do, q, k, v, o. A packed batch's maps span every row of a
    head."""
    key_pass = kplan.key_passes[0]
    if not (isinstance(key_pass, _variants.HopperBackward) and key_pass.tma):
        return None
    do_strides = (*layout.extra_strides[0], do_row_stride)
    return _driver.Maps(_tma.backward_geometries(nq, nk, d, layout, row_strides, do_strides, key_pass.block_rows,
                                          key_pass.block_cols), (ptrs[1], ptrs[2], ptrs[3], ptrs[0]),
                 _tma.BWD_PARAM_BYTES)


def _backward_params(variant, block, bwd_block, maps):
    """A backward kernel's parameter blocks: FwdParams, BwdParams and, for the wgmma key pass,
    its tensor maps (zeros where it loads with cp.async)."""
    if not isinstance(variant, _variants.HopperBackward):
        return [block, bwd_block]
    return [block, bwd_block, maps.block if maps is not None else _driver.words(bytes(_tma.BWD_PARAM_BYTES))]


def _grouped_lead(out_lead, group) -> tuple:
    """The leading dims of k / v grouped ``group`` query heads a k/v head over the output's."""
    return out_lead[:-1] + (out_lead[-1] // group,) if group > 1 else out_lead


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
