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

import threading

from . import _config
from ._backward import BackwardPlan, _backward_signature_plan, _varlen_backward_signature_plan
from ._forward import ForwardPlan, _forward_signature_plan, _varlen_forward_signature_plan

# ---- the caches ------------------------------------------------------------------------------

_MAX_PLANS = 1024  # bounded: a plan may hold a block mask's device lists alive
_forward_plans: dict = {}
_backward_plans: dict = {}
_build_lock = threading.Lock()


def remember(cache: dict, key, plan):
    """Keep ``plan`` under ``key``, dropping the oldest entry past _MAX_PLANS (the front ends'
    caches of raw call signatures use it too)."""
    if len(cache) >= _MAX_PLANS:
        cache.pop(next(iter(cache)))
    cache[key] = plan


def _cached(cache, key, build):
    plan = cache.get(key)
    if plan is None:
        with _build_lock:
            plan = cache.get(key)
            if plan is None:
                plan = build()
                remember(cache, key, plan)
    return plan


def forward_plan(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id,
                 causal, scale, mask, window, ptrs) -> ForwardPlan:
    """The plan of a forward signature (strides in elements, dtype a name, mask a BlockMask or
    None, window normalised); ``ptrs`` (q, k, v) are used only when the plan is built."""
    key = (q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal), scale,
           mask, window, _config.GENERATION[0])
    return _cached(_forward_plans, key, lambda: _forward_signature_plan(
        q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal), scale,
        mask, window, ptrs))


def backward_plan(shapes, strides, dtype, stats, device_id, causal, scale, mask, window, deterministic,
                  ptrs) -> BackwardPlan:
    key = (shapes, strides, dtype, stats, device_id, bool(causal), scale, mask, window, bool(deterministic),
           _config.GENERATION[0])
    return _cached(_backward_plans, key, lambda: _backward_signature_plan(
        shapes, strides, dtype, stats, device_id, bool(causal), scale, mask, window, bool(deterministic), ptrs))


def varlen_forward_plan(q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, causal,
                        scale, window, num_seqs, max_seqlen_q, ptrs) -> ForwardPlan:
    """The plan of a varlen forward signature: forward_plan's, plus the number of sequences and
    max_seqlen_q (a host int); the cu_seqlens pointers are run's per-call arguments."""
    key = ("varlen", q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal),
           scale, window, num_seqs, max_seqlen_q, _config.GENERATION[0])
    return _cached(_forward_plans, key, lambda: _varlen_forward_signature_plan(
        q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, dtype, device_id, bool(causal), scale, window,
        num_seqs, max_seqlen_q, ptrs))


def varlen_backward_plan(shapes, strides, dtype, stats, device_id, causal, scale, window, deterministic, num_seqs,
                         max_seqlen_q, max_seqlen_k, ptrs) -> BackwardPlan:
    key = ("varlen", shapes, strides, dtype, stats, device_id, bool(causal), scale, window, bool(deterministic),
           num_seqs, max_seqlen_q, max_seqlen_k, _config.GENERATION[0])
    return _cached(_backward_plans, key, lambda: _varlen_backward_signature_plan(
        shapes, strides, dtype, stats, device_id, bool(causal), scale, window, bool(deterministic), num_seqs,
        max_seqlen_q, max_seqlen_k, ptrs))


def plan_counts() -> tuple:
    """(forward, backward) plans built so far and cached (for tests)."""
    return len(_forward_plans), len(_backward_plans)


def clear():
    with _build_lock:
        _forward_plans.clear()
        _backward_plans.clear()
