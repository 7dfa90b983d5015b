"""The spine of a call: problem -> choice -> plan -> launch.

A front end (the CuPy API in cuflash/_api.py, cuflash/torch.py, cuflash/jax.py) turns its
arrays into a :class:`~cuflash._problem.Problem` with the functions here (which run the checks
every front end shares), asks for its plan (:func:`forward` / :func:`backward`, or a decoding
call's: :func:`routed`, :func:`decode_plan`), allocates the outputs its own way and calls the
plan's ``run(pointers, stream)``: every plan is a :class:`~cuflash._launch.Plan`, its pointers
named by its ``pointer_names``. Everything a signature decides is decided once, when its plan is built: the plans
(cuflash/_forward.py, _backward.py, _decode.py) validate, ask cuflash/_config.py for the kernels
(the fallbacks named in its answer) and bind every launch; the one plan cache
(cuflash/_cache.py) keeps them. This module is the front ends' one door to that: what they need
of the layers below is named here.
"""

from __future__ import annotations

from . import _checks, _driver
from ._arrays import AttentionGradients, AttentionOutput, align, contiguous_strides, longest_sequence
from ._backward import BackwardPlan, build_backward
from ._broadcast import out_lead_shape
from ._cache import PLANS, clear, plan_counts
from ._checks import (NO_WINDOW, as_block_mask, check_cu_seqlens, check_dtypes, check_like_q,
                      check_max_seqlen, check_varlen_options, check_varlen_shapes, dtype_name, vector_alignment_error)
from ._decode import DecodeChoice, DecodePlan, bound_plan, check_num_splits, plan_decode, routes_short_queries
from ._forward import ForwardPlan, build_forward
from ._launch import Plan
from ._problem import Problem, Varlen
from ._validate import check_decode_choice, check_varlen_inputs
from ._validate import enabled as validation_enabled
from .masks import window_option

# What the front ends take from here: the functions below, and these names of the layers below.
__all__ = [
    "forward_problem", "backward_problem", "check_traced", "forward", "backward", "routed", "decode_plan",
    "sm_count", "on_device", "Problem", "Varlen", "Plan", "ForwardPlan", "BackwardPlan", "DecodeChoice", "DecodePlan",
    "PLANS", "clear",
    "plan_counts", "AttentionOutput", "AttentionGradients", "align", "contiguous_strides", "longest_sequence",
    "NO_WINDOW", "as_block_mask", "window_option", "check_cu_seqlens", "check_dtypes", "check_like_q",
    "check_max_seqlen", "check_varlen_options", "check_varlen_shapes", "dtype_name", "vector_alignment_error",
    "bound_plan", "check_num_splits", "plan_decode", "routes_short_queries", "check_decode_choice",
    "check_varlen_inputs", "validation_enabled",
]
# ---- problems ----------------------------------------------------------------------------------


def forward_problem(shapes, strides, dtypes, device: int, *, causal=False, scale=None, mask=None, window=None,
                    varlen=None) -> Problem:
    """The forward problem of q, k, v: their shapes, element strides and dtypes (any framework's),
    the device's ordinal, the options normalised (mask a BlockMask or None, window (left, right)
    or None) and a packed batch's :class:`Varlen`. Raises TypeError for dtypes that differ or
    are not supported."""
    dtype = _checks.check_dtypes(*dtypes)
    if varlen is not None and varlen.max_seqlen_k:  # the forward's grids do not depend on it: one plan
        varlen = Varlen(varlen.num_seqs, varlen.max_seqlen_q)
    return Problem("forward", tuple(tuple(s) for s in shapes), tuple(tuple(s) for s in strides), dtype, device,
                   bool(causal), scale, mask, window, varlen)


def backward_problem(shapes, strides, dtypes, stats, device: int, *, causal=False, scale=None, mask=None,
                     window=None, deterministic=False, varlen=None) -> Problem:
    """The backward problem of do, q, k, v, o (shapes, element strides, dtypes) with the
    forward's statistics ``stats``: (shape, element strides, dtype) of l and m."""
    do_dtype, q_dtype, k_dtype, v_dtype, o_dtype = dtypes
    dtype = _checks.check_dtypes(q_dtype, k_dtype, v_dtype)
    _checks.check_like_q(dtype, do=do_dtype, o=o_dtype)
    stats = tuple((tuple(shape), tuple(st), _checks.dtype_name(t)) for shape, st, t in stats)
    return Problem("backward", tuple(tuple(s) for s in shapes), tuple(tuple(s) for s in strides), dtype, device,
                   bool(causal), scale, mask, window, varlen, stats, bool(deterministic))


def check_traced(shapes, dtypes, scale, mask, window) -> tuple:
    """The checks of a forward's q, k, v shapes, dtypes and options that need no device and no
    pointer (a traced call's, whose errors then surface where it is traced); the output's
    leading dims."""
    q_shape, k_shape, v_shape = shapes
    _checks.check_dtypes(*dtypes)
    _checks.check_head_dims(q_shape, k_shape, v_shape)
    _checks.resolve_scale(scale, q_shape[-1])
    lead = out_lead_shape(q_shape, k_shape, v_shape)
    _checks.check_sparsity(mask, None, window, q_shape[-2], k_shape[-2], lead)
    return lead


# ---- plans -------------------------------------------------------------------------------------


def forward(problem: Problem, ptrs) -> ForwardPlan:
    """The plan of a forward problem, built the first time (``ptrs``: q, k, v of that call)."""
    return PLANS.get_or_build(("forward", problem), build_forward, problem, ptrs)


def backward(problem: Problem, ptrs) -> BackwardPlan:
    """The plan of a backward problem, built the first time (``ptrs``: do, q, k, v, o of that call)."""
    return PLANS.get_or_build(("backward", problem), build_backward, problem, ptrs)


def routed(q, k, v, problem: Problem):
    """The decoding plan that runs a forward problem of a few queries a head against many keys
    (:func:`cuflash._decode.routes_short_queries`, the rule of _config), or None.
    q, k, v: what cuflash/_decode.py reads of arrays (shape, byte strides, dtype, ``data.ptr``,
    ``device.id``)."""
    if problem.varlen is not None or not routes_short_queries(q, k, v, problem.mask):
        return None
    choice = plan_decode(q, k, v, causal=problem.causal, scale=problem.scale, window=problem.window,
                         sm_count=_driver.sm_count(problem.device))
    return bound_plan(choice, problem.device)


def decode_plan(q, k, v, page_table, seqlens_k, *, causal, scale, window, num_splits, device: int) -> DecodePlan:
    """The decoding plan of a call with decoding arguments (arrays as :func:`routed` reads them;
    page_table and seqlens_k None where not given)."""
    choice = plan_decode(q, k, v, causal=causal, scale=scale, window=window, page_table=page_table,
                         seqlens_k=seqlens_k, num_splits=num_splits, sm_count=_driver.sm_count(device))
    return bound_plan(choice, device)


def sm_count(device: int) -> int:
    """The SMs of a device (what the decoding plans split the keys for)."""
    return _driver.sm_count(device)


def on_device(device: int):
    """A context in which ``device`` is CuPy's current device."""
    return _driver.device(device)
