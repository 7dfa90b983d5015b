"""The forward's plan: what a forward signature decides (validation, the kernel, its grid,
shared memory, parameter blocks, block-sparse tile lists and tensor maps), bound once, and
``run`` on raw pointers."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading

from . import _checks, _config, _driver, _launch, _params, _tma, _variants
from ._broadcast import broadcast_layout

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
        self.ctx = _driver.device_context(device_id)
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
            with _driver.Context(self.ctx) as drv:
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
    _launch.check_vector_operands(operands, ptrs, dtype)
    cc = _driver.compute_capability(device_id)
    variant = _config.forward_config(dtype, d, dv, causal, sparse=mask is not None, wgmma=_config.has_wgmma(cc),
                                     nq=nq, slices=num_batch, tma=tma)
    row_tiles = None
    if mask is not None and isinstance(variant, _variants.HopperForward):  # its tiles decide the form
        row_tiles = _launch.sparse_row_tiles(mask, nq, nk, variant, causal, window)
        variant = _config.forward_config(dtype, d, dv, causal, sparse=True, wgmma=True, nq=nq, slices=num_batch,
                                         tma=tma, row_tiles=row_tiles)
    row_strides = (q_strides[-2], k_strides[-2], v_strides[-2])
    maps = None
    if isinstance(variant, _variants.HopperForward) and variant.tma:
        maps = _driver.Maps(_tma.geometries(nq, nk, d, layout, row_strides, variant.block_rows, variant.block_cols), ptrs)
        if not maps.ok:  # the copy engine cannot map these inputs: the cp.async form
            maps = None
            variant = _config.forward_config(dtype, d, dv, causal, sparse=mask is not None, wgmma=True, nq=nq,
                                             slices=num_batch, tma=False, row_tiles=row_tiles)
    with _driver.device(device_id):
        sparsity, lists = _launch.sparsity_fields(mask, layout.extra_strides[-1] if mask is not None else (), nq, nk,
                                          variant, transpose=False, causal=causal, window=window)
    params = [_driver.words(_launch.forward_params(nq, nk, d, dv, layout, row_strides, scale, sparsity))]
    if isinstance(variant, _variants.HopperForward):
        params.append(maps.block if maps is not None else _driver.words(bytes(_tma.PARAM_BYTES)))
    kernel = _driver.Kernel(variant, device_id, _launch.forward_grid(variant, -(-nq // variant.block_rows), num_batch, device_id),
                    params, d, dv)
    kernel.lists = lists

    def fallback():
        return _forward_signature_plan(*qkv, dtype, device_id, causal, scale, mask, window, ptrs, tma=False)

    return ForwardPlan(device_id, dtype, o_shape, stats_shape, operands, kernel, maps,
                       functools.lru_cache(maxsize=1)(fallback) if maps is not None else None)


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
    _launch.check_vector_operands(operands, ptrs, dtype)
    cc = _driver.compute_capability(device_id)
    variant = _config.forward_config(dtype, d, dv, causal, wgmma=_config.has_wgmma(cc), nq=min(max_seqlen_q, total_q),
                                     tma=tma, slices=heads * num_seqs, varlen=True)
    row_strides = (q_strides[-2], k_strides[-2], v_strides[-2])
    maps = None
    if isinstance(variant, _variants.HopperForward) and variant.tma:
        # The maps span every packed row of a head; a sequence's tiles start at its first row.
        maps = _driver.Maps(_tma.geometries(total_q, total_k, d, layout, row_strides, variant.block_rows,
                                     variant.block_cols), ptrs)
        if not maps.ok:
            maps = None
            variant = dataclasses.replace(variant, tma=False)
    sparsity = (*(window or _checks.NO_WINDOW), *_launch.DENSE_TILES)
    grid_x = _launch.varlen_grid_x(max_seqlen_q, total_q, variant.block_rows)
    varlen_tiles = grid_x if getattr(variant, "persistent", False) else 0  # the x a persistent walk's items span
    params = [_driver.words(_launch.forward_params(total_q, total_k, d, dv, layout, row_strides, scale, sparsity, num_seqs,
                                    varlen_tiles))]
    if isinstance(variant, _variants.HopperForward):
        params.append(maps.block if maps is not None else _driver.words(bytes(_tma.PARAM_BYTES)))
    kernel = _driver.Kernel(variant, device_id, _launch.forward_grid(variant, grid_x, heads * num_seqs, device_id), params, d, dv)

    def fallback():
        return _varlen_forward_signature_plan(*qkv, dtype, device_id, causal, scale, window, num_seqs, max_seqlen_q,
                                              ptrs, tma=False)

    plan = ForwardPlan(device_id, dtype, o_shape, stats_shape, operands, kernel, maps,
                       functools.lru_cache(maxsize=1)(fallback) if maps is not None else None)
    plan.varlen = True
    return plan
