"""The forward's plan: what a forward signature decides (validation, the kernel, its grid,
shared memory, parameter blocks, block-sparse tile lists and tensor maps), bound once, and
``run`` on raw pointers."""

from __future__ import annotations

import functools
import math
import threading

from . import _checks, _config, _driver, _launch, _params, _tma, _variants
from ._broadcast import broadcast_layout
from ._driver import Context


class ForwardPlan(_launch.Plan):
    """One forward problem's launch: ``run((q, k, v, o, l, m), stream)`` on raw pointers (a
    varlen batch's with cu_seqlens_q, cu_seqlens_k after them)."""

    def __init__(self, problem, o_shape, stats_shape, kernel=None, maps=None, fallback=None):
        self.problem = problem
        self.pointer_names = ("q", "k", "v", "o", "l", "m") + (
            ("cu_seqlens_q", "cu_seqlens_k") if problem.varlen is not None else ())
        self.device_id = problem.device
        self.dtype = problem.dtype
        self.o_shape, self.stats_shape = o_shape, stats_shape
        self.stats_rows = math.prod(stats_shape)  # of l (and of m)
        self.operands = problem.operands  # ((name, shape, element strides), ...) of q, k, v for errors
        self.vectors = problem.dtype != "float32"  # 16-byte vector loads need 16-byte aligned pointers
        self.kernel = kernel  # None: nothing to compute (no query or no slice)
        self.maps = maps
        self.fallback = fallback  # builds the cp.async plan, for pointers the copy engine refuses
        self.ctx = _driver.device_context(problem.device)
        self.lock = threading.Lock()
        self.varlen = problem.varlen is not None  # the launch reads cu_seqlens_q / cu_seqlens_k

    @property
    def variant(self):
        return None if self.kernel is None else self.kernel.variant

    def run(self, pointers, stream):
        if self.vectors and (pointers[0] | pointers[1] | pointers[2]) & 15:
            self.check_alignment(pointers)
        kernel = self.kernel
        if kernel is None:
            return
        with self.lock:
            if self.maps is not None and not self.maps.bind(pointers[:3]):
                return self.fallback().run(pointers, stream)
            if self.varlen:
                kernel.params[0][0:6] = pointers[:6]
                kernel.params[0][_params.CU_SEQLENS_WORD:_params.CU_SEQLENS_WORD + 2] = pointers[6:]
            else:
                kernel.params[0][0:6] = pointers
            with Context(self.ctx) as drv:
                kernel.launch(drv, stream)


def build_forward(problem, ptrs) -> ForwardPlan:
    """Every check and choice of a forward problem (cuflash/_problem.py: dense, block-sparse or
    a packed varlen batch), bound into its plan; ``ptrs`` (q, k, v) of the call that asks first
    check the alignment and encode the tensor maps' templates."""
    (q_shape, k_shape, v_shape), varlen = problem.shapes, problem.varlen
    if varlen is not None:
        _checks.check_varlen_shapes(q_shape, k_shape, v_shape)
    nq, nk, d, dv = _checks.check_head_dims(q_shape, k_shape, v_shape)
    for name, shape, strides in problem.operands:
        _checks.check_last_dim_contiguous(name, shape, strides)
    layout = broadcast_layout(*problem.qkv)
    scale = _checks.resolve_scale(problem.scale, d)
    mask, window = _checks.check_sparsity(problem.mask, None, problem.window, nq, nk, layout.out_lead_shape)
    if mask is not None:
        layout = _checks.layout_with_mask(problem.qkv, (), mask)
    # A varlen launch's slices are (sequence, head): each owns one sequence of one head.
    slices = math.prod(layout.lead_shape) * (varlen.num_seqs if varlen is not None else 1)
    if slices == 0 or nq == 0:
        return ForwardPlan(problem, layout.out_lead_shape + (nq, dv), layout.out_lead_shape + (nq,))
    _launch.check_vector_operands(problem.operands, ptrs, problem.dtype)
    longest = nq if varlen is None else min(varlen.max_seqlen_q, nq)  # the query rows a slice's grid covers
    row_tiles = None  # block-sparse: the mask's tile lists count the key tiles a query tile visits
    if mask is not None:
        row_tiles = functools.partial(_launch.sparse_row_tiles, mask, nq, nk, causal=problem.causal, window=window)
    choice = _config.forward_choice(problem.dtype, d, dv, problem.causal,
                                    wgmma=_config.has_wgmma(_driver.compute_capability(problem.device)),
                                    nq=longest, slices=slices, varlen=varlen is not None, row_tiles=row_tiles)
    geometry = _launch.Geometry(problem, nq, nk, d, dv, layout, layout.out_lead_shape, scale, mask, window, slices,
                                longest, nk)
    return _bound_forward(geometry, choice, ptrs)


def _bound_forward(g: _launch.Geometry, choice, ptrs, variant=None) -> ForwardPlan:
    """The plan of ``choice`` (its variant, or the one given: its cp.async form)."""
    problem, variant = g.problem, variant or choice.variant
    row_strides = tuple(strides[-2] for strides in problem.strides)
    maps = None
    if getattr(variant, "tma", False):
        # A varlen batch's maps span every packed row of a head; a sequence's tiles start at its first row.
        maps = _driver.Maps(_tma.geometries(g.nq, g.nk, g.d, g.layout, row_strides, variant.block_rows,
                                            variant.block_cols), ptrs)
        if not maps.ok:  # the copy engine cannot map these inputs
            return _bound_forward(g, choice, ptrs, choice.without_tensor_maps)
    with _driver.device(problem.device):
        mask_strides = g.layout.extra_strides[-1] if g.mask is not None else ()
        sparsity, lists = _launch.sparsity_fields(g.mask, mask_strides, g.nq, g.nk, variant, transpose=False,
                                                  causal=problem.causal, window=g.window)
    varlen = problem.varlen
    grid_x = _launch.grid_tiles(g.longest_q, g.nq, variant.block_rows)
    num_seqs = varlen.num_seqs if varlen is not None else 0
    # A persistent varlen walk's items span grid_x tiles a slice (a dense one's, every tile).
    varlen_tiles = grid_x if varlen is not None and getattr(variant, "persistent", False) else 0
    params = [_driver.words(_launch.forward_params(g.nq, g.nk, g.d, g.dv, g.layout, row_strides, g.scale, sparsity,
                                                   num_seqs, varlen_tiles))]
    if isinstance(variant, _variants.HopperForward):
        params.append(maps.block if maps is not None else _driver.words(bytes(_tma.PARAM_BYTES)))
    kernel = _driver.Kernel(variant, problem.device, _launch.forward_grid(variant, grid_x, g.slices, problem.device),
                            params, g.d, g.dv)
    kernel.lists = lists
    fallback = None
    if maps is not None:  # the cp.async plan, for pointers the copy engine refuses; built on first need
        fallback = functools.lru_cache(maxsize=1)(lambda: _bound_forward(g, choice, ptrs, choice.without_tensor_maps))
    return ForwardPlan(problem, g.out_lead + (g.nq, g.dv), g.out_lead + (g.nq,), kernel, maps, fallback)
