"""Launch plans: what a call's signature decides, decided once.

A signature is everything about a call but its data: shapes, strides, dtypes, device, flags,
scale, block mask and window. ``forward_plan`` and ``backward_plan`` look one up, or build it:
they validate (with the errors cuflash has always given), choose the kernels (cuflash/_config.py
decides, nothing here overrides it), and bind everything that follows from the signature: grids,
shared memory, the packed parameter blocks, the block-sparse tile lists, the tensor maps'
templates, the workspace layout and the outputs' shapes (cuflash/_forward.py and _backward.py
build them). A call with a known signature then checks what can change between such calls (the
pointers' alignment), writes its pointers into the bound parameter blocks and launches through
the driver (cuflash/_driver.py) on the caller's stream. The plans take raw pointers, so the CuPy
API, the torch adapter and the JAX adapter each allocate their outputs their own way and share
the plans.
"""

from __future__ import annotations

from ._backward import BackwardPlan, _backward_signature_plan, _varlen_backward_signature_plan
from ._cache import PLANS, clear, plan_counts  # noqa: F401  (the plans' cache, for callers of _plan)
from ._forward import ForwardPlan, _forward_signature_plan, _varlen_forward_signature_plan

# ---- the entry points ------------------------------------------------------------------------


def forward_plan(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id,
                 causal, scale, mask, window, ptrs) -> ForwardPlan:
    """The plan of a forward signature (strides in elements, dtype a name, mask a BlockMask or
    None, window normalised); ``ptrs`` (q, k, v) are used only when the plan is built."""
    key = ("forward", q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal),
           scale, mask, window, None)
    return PLANS.get_or_build(key, lambda: _forward_signature_plan(
        q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal), scale,
        mask, window, ptrs))


def backward_plan(shapes, strides, dtype, stats, device_id, causal, scale, mask, window, deterministic,
                  ptrs) -> BackwardPlan:
    key = ("backward", shapes, strides, dtype, stats, device_id, bool(causal), scale, mask, window,
           bool(deterministic), None)
    return PLANS.get_or_build(key, lambda: _backward_signature_plan(
        shapes, strides, dtype, stats, device_id, bool(causal), scale, mask, window, bool(deterministic), ptrs))


def varlen_forward_plan(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, causal,
                        scale, window, num_seqs, max_seqlen_q, ptrs) -> ForwardPlan:
    """The plan of a varlen forward signature: forward_plan's, plus the number of sequences and
    max_seqlen_q (a host int); the cu_seqlens pointers are run's per-call arguments."""
    key = ("forward", q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal),
           scale, None, window, (num_seqs, max_seqlen_q))
    return PLANS.get_or_build(key, lambda: _varlen_forward_signature_plan(
        q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal), scale, window,
        num_seqs, max_seqlen_q, ptrs))


def varlen_backward_plan(shapes, strides, dtype, stats, device_id, causal, scale, window, deterministic, num_seqs,
                         max_seqlen_q, max_seqlen_k, ptrs) -> BackwardPlan:
    key = ("backward", shapes, strides, dtype, stats, device_id, bool(causal), scale, None, window,
           bool(deterministic), (num_seqs, max_seqlen_q, max_seqlen_k))
    return PLANS.get_or_build(key, lambda: _varlen_backward_signature_plan(
        shapes, strides, dtype, stats, device_id, bool(causal), scale, window, bool(deterministic), num_seqs,
        max_seqlen_q, max_seqlen_k, ptrs))
