"""PyTorch adapter: differentiable cuflash attention for CUDA tensors.

    import cuflash.torch
    o = cuflash.torch.attention(q, k, v, causal=True)      # q, k, v: (B, H, N, d)
    o = cuflash.torch.attention(q, k, v, block_mask=cuflash.masks.butterfly(32), window=(512, 0))

Both passes are registered as custom operators (``torch.ops.cuflash.attention_fwd`` and
``torch.ops.cuflash.attention_bwd``) with fake (meta) implementations and an autograd
formula, so they work under ``torch.compile(fullgraph=True)``, ``torch.export`` and
``torch.library.opcheck``; eager calls go through an ``autograd.Function`` straight to the same
launch plans (cuflash/_spine.py), skipping the operators' dispatch.  The kernels run on torch's
current stream of the inputs' device; outputs and scratch space come from torch's caching
allocator, so the calls are capturable in CUDA graphs (those launches: cuflash/_torch_launch.py).
"""

import collections
import threading
from typing import Optional, Tuple

from . import _requirements

try:
    import torch
except ModuleNotFoundError as error:
    raise _requirements.framework_error(error, "cuflash.torch") from None
if not _requirements.installed("cupy"):
    raise _requirements.missing_cupy("cuflash.torch")

from . import _spine
from ._spine import NO_WINDOW, AttentionOutput, as_block_mask
from ._torch_launch import (_backward_impl, _decode_impl, _eager_backward, _forward_impl, _forward_with_plan,
                            _out_lead_shape, _split_stats, _varlen_boundaries, _varlen_forward_impl)
from .masks import BlockMask, window_option

__all__ = ["attention"]


# ---- block masks through the operators -----------------------------------------------------
#
# Operator arguments can only be tensors and numbers, so a BlockMask travels as its token
# (BlockMask.token, an int) and the operator looks the mask up again (BlockMask.from_token).
# Under torch.compile the token is read from the mask object at trace time like any attribute
# (guarded, and passed to the graph as an int), so the mask's lists are built and copied to the
# GPU once per mask, not per call, and the graph has no host-device traffic for them. The
# registry holds masks weakly; the adapter keeps the last few it was given alive, so that a
# mask made inline (``block_mask=cuflash.masks.butterfly(32)``) survives until its backward.
# A token means nothing outside this process: a torch.export'ed program that has one baked in
# runs only where that mask is alive.

_RECENT_MASKS: "collections.OrderedDict[int, BlockMask]" = collections.OrderedDict()
_RECENT_MASKS_LOCK = threading.Lock()
_KEEP_RECENT_MASKS = 64


def _mask_token(mask: Optional[BlockMask]) -> Optional[int]:
    if mask is None:
        return None
    if not torch.compiler.is_compiling():  # not traced: Dynamo would put this in the graph
        with _RECENT_MASKS_LOCK:
            _RECENT_MASKS.pop(mask.token, None)
            _RECENT_MASKS[mask.token] = mask
            while len(_RECENT_MASKS) > _KEEP_RECENT_MASKS:
                _RECENT_MASKS.popitem(last=False)
    return mask.token


def _sparsity(block_mask: Optional[int], window_left: int, window_right: int):
    """(BlockMask or None, window or None) for the operators' mask token and window."""
    mask = None if block_mask is None else BlockMask.from_token(block_mask)
    return mask, window_option((window_left, window_right))


@torch.library.custom_op("cuflash::attention_fwd", mutates_args=(), device_types="cuda")
def _attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: Optional[float],
    block_mask: Optional[int] = None,
    window_left: int = -1,
    window_right: int = -1,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: int = -1,
    max_seqlen_k: int = -1,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # cu_seqlens given: a packed variable-length batch; max_seqlen -1 = computed here (a host
    # sync inside the operator, which a compiled graph does not see).
    mask, window = _sparsity(block_mask, window_left, window_right)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _varlen_forward_impl(q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k)
    return _forward_impl(q, k, v, causal, scale, mask, window)


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, scale, block_mask=None, window_left=-1, window_right=-1,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1):
    # A varlen call's q (Hq, total_q, d) follows the dense rule with its heads as the one
    # leading dim: o (Hq, total_q, dv), l and m (Hq, total_q).
    lead = _out_lead_shape(q.shape, k.shape, v.shape)
    o = q.new_empty(lead + (q.shape[-2], v.shape[-1]))
    l = q.new_empty(lead + (q.shape[-2],), dtype=torch.float32)
    return o, l, torch.empty_like(l)


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=(), device_types="cuda")
def _attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    l: torch.Tensor,
    m: torch.Tensor,
    causal: bool,
    scale: Optional[float],
    block_mask: Optional[int] = None,
    window_left: int = -1,
    window_right: int = -1,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: int = -1,
    max_seqlen_k: int = -1,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask, window = _sparsity(block_mask, window_left, window_right)
    varlen = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # torch.use_deterministic_algorithms(True) selects the bit-reproducible backward.
    return _backward_impl(do, q, k, v, o, l, m, causal, scale, mask, window,
                          torch.are_deterministic_algorithms_enabled(), varlen)


@_attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, l, m, causal, scale, block_mask=None, window_left=-1, window_right=-1,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1):
    # Contiguous like the real outputs (empty_like would copy a permuted input's strides).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    # causal, scale, block_mask, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
    # max_seqlen_q, max_seqlen_k (what the call left out takes the operator's defaults)
    q, k, v, *options = inputs
    options += [None, None, -1, -1][len(options) - 5:]
    o, l, m = output
    ctx.save_for_backward(q, k, v, o, l, m, options[5], options[6])
    ctx.options = options[:5] + [None, None] + options[7:]
    ctx.n_inputs = len(inputs) - 3
    # l and m are softmax statistics, returned for inspection; no gradient flows through them.
    ctx.mark_non_differentiable(l, m)
    ctx.set_materialize_grads(False)  # no zero-filled dl, dm (or dO) made for the backward


def _backward(ctx, do, _dl, _dm):
    if do is None:  # o took no part in the loss
        return (None,) * (3 + ctx.n_inputs)
    q, k, v, o, l, m, cu_q, cu_k = ctx.saved_tensors
    options = list(ctx.options)
    options[5:7] = cu_q, cu_k
    dq, dk, dv = _attention_bwd(do, q, k, v, o, l, m, *options)
    return (dq, dk, dv) + (None,) * ctx.n_inputs


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    block_mask=None,
    block_size=None,
    window=None,
    return_stats: bool = False,
    page_table=None,
    seqlens_k=None,
    num_splits=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
):
    """Exact scaled dot-product attention (FlashAttention) on CUDA tensors, differentiable.

    The dense and block-sparse entry point. A packed variable-length batch has its own,
    :func:`cuflash.torch.attention_varlen`, and so does decoding against a dense or paged KV
    cache, :func:`cuflash.torch.attention_with_kvcache`: they take only their mode's arguments
    and call this function with the keywords of that mode below.

    Args:
        q: (..., Nq, d), e.g. SDPA's (B, H, Nq, d). k: (..., Nk, d). v: (..., Nk, dv).
            float16, bfloat16 or float32, one dtype, on one CUDA device; d and dv multiples of
            8 up to 256. Any strided views whose last dim is contiguous are read in place
            (e.g. ``x.view(B, N, H, d).transpose(1, 2)``). Leading dims broadcast; k/v with
            Hk heads where Hk divides q's Hq act as SDPA's ``enable_gqa=True``.
        causal: key j is masked for query i when j > i + (Nk - Nq): the diagonal is aligned
            to the bottom right. This equals SDPA's ``is_causal`` only when Nq == Nk (SDPA
            aligns it top left); for Nq != Nk pass SDPA
            ``attn_mask=torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq)`` to compare.
        scale: multiplies q k^T; defaults to 1 / sqrt(d).
        block_mask, block_size, window: block-sparse and sliding-window attention, as in
            :func:`cuflash.attention`: a :class:`cuflash.masks.BlockMask`, or a boolean
            array / tensor (..., Tq, Tk) with ``block_size``; ``window=(left, right)``.
            Under ``torch.compile`` pass a BlockMask built outside the compiled code (a
            boolean tensor is converted on the host, which a graph cannot do).
        return_stats: also return the float32 softmax statistics.
        page_table, seqlens_k, num_splits: decoding against a KV cache (paged, or dense with
            per-sequence lengths) on the split-KV kernels, forward only, as in
            :func:`cuflash.attention`; capturable in a CUDA graph with fixed buffers. Without
            them, a call that autograd does not record and that has 1-16 queries a head against
            at least 64 keys (16-bit, head dims up to 128, no
            block mask) runs on the same kernels, as :func:`cuflash.attention` routes it.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: a packed variable-length batch,
            as in :func:`cuflash.attention` (and flash_attn_varlen_func): q (Hq, total_q, d),
            k / v (Hk, total_k, d / dv), e.g. ``x.transpose(0, 1)`` of a (total, H, d) tensor;
            int32 CUDA tensors of length batch + 1 on q's device; host ints or None (None: one
            host sync computes them). Differentiable, under torch.compile too.

    Returns:
        o (..., Nq, dv) in q's dtype; with ``return_stats=True`` an
        ``AttentionOutput(o, l, m)`` where, with S = scale * q k^T, m = max_j S and
        l = sum_j exp(S - m) (shape (..., Nq)); l and m are not differentiable.

    The backward pass is bit-reproducible when ``torch.use_deterministic_algorithms(True)``
    is in effect. A row with no allowed key (causal with Nq > Nk) gets o = 0 and zero
    gradients.
    """
    mask = as_block_mask(block_mask, block_size)
    window = window_option(window)
    causal, scale = bool(causal), None if scale is None else float(scale)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        _spine.check_varlen_options(mask, page_table, seqlens_k, num_splits)
        if not torch.compiler.is_compiling():  # traced, the operator checks them when it runs
            _varlen_boundaries(q, cu_seqlens_q, cu_seqlens_k)
        max_q, max_k = (-1 if x is None else _spine.check_max_seqlen(name, x)
                        for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)))
        left, right = window or NO_WINDOW
        args = (cu_seqlens_q, cu_seqlens_k, max_q, max_k)
        if torch.compiler.is_compiling() or not (type(q) is type(k) is type(v) is torch.Tensor):
            o, l, m = _attention_fwd(q, k, v, causal, scale, None, left, right, *args)
        elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            stats = [] if return_stats else None
            o = _EagerAttention.apply(q, k, v, causal, scale, None, window, args, stats)
            return AttentionOutput(o, *stats) if return_stats else o
        else:
            o, l, m = _varlen_forward_impl(q, k, v, causal, scale, window, *args)
        return AttentionOutput(o, l, m) if return_stats else o
    if page_table is not None or seqlens_k is not None or num_splits is not None:
        if mask is not None or torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError("page_table, seqlens_k and num_splits select the split-KV decoding path, which "
                             "has no block_mask and no backward: call it on tensors that need no grad")
        o, stats = _decode_impl(q, k, v, causal, scale, window, page_table, seqlens_k, num_splits)
        return AttentionOutput(o, *_split_stats(stats, o.shape[:-1])) if return_stats else o
    if torch.compiler.is_compiling() or not (type(q) is type(k) is type(v) is torch.Tensor):
        # Traced (torch.compile, torch.export) or a tensor subclass: the custom operators.
        left, right = window or NO_WINDOW
        o, l, m = _attention_fwd(q, k, v, causal, scale, _mask_token(mask), left, right)
        return AttentionOutput(o, l, m) if return_stats else o
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        stats = [] if return_stats else None
        o = _EagerAttention.apply(q, k, v, causal, scale, mask, window, None, stats)
        return AttentionOutput(o, *stats) if return_stats else o
    o, stats, _ = _forward_with_plan(q, k, v, causal, scale, mask, window, route=True)
    return AttentionOutput(o, *_split_stats(stats, o.shape[:-1])) if return_stats else o


class _EagerAttention(torch.autograd.Function):
    """Eager calls run the same kernels without the dispatcher's per-call cost of a custom
    operator (tens of microseconds); torch.compile traces the operators above instead. The
    one output is o: l and m are not differentiable, and as outputs autograd would track them
    too; ``stats``, a list when the caller wants them, receives them instead."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, mask, window, varlen=None, stats=None):
        # varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a packed batch
        if varlen is None:
            o, buffer, ctx.plan = _forward_with_plan(q, k, v, causal, scale, mask, window)
            ctx.save_for_backward(q, k, v, o, buffer)
            if stats is not None:
                stats.extend(_split_stats(buffer, o.shape[:-1]))
        else:
            o, l, m = _varlen_forward_impl(q, k, v, causal, scale, window, *varlen)
            ctx.save_for_backward(q, k, v, o, l, m, *varlen[:2])
            ctx.max_seqlens = varlen[2:]
            if stats is not None:
                stats.extend((l, m))
        ctx.options = (causal, scale, mask, window)
        ctx.varlen = varlen is not None
        ctx.set_materialize_grads(False)  # no zero-filled dO made for a loss that does not use o
        return o

    @staticmethod
    def backward(ctx, do):
        if do is None:  # o took no part in the loss
            return (None,) * 9
        deterministic = torch.are_deterministic_algorithms_enabled()
        if ctx.varlen:
            q, k, v, o, l, m, cu_q, cu_k = ctx.saved_tensors
            dq, dk, dv = _backward_impl(do, q, k, v, o, l, m, *ctx.options, deterministic,
                                        (cu_q, cu_k, *ctx.max_seqlens))
        else:
            q, k, v, o, buffer = ctx.saved_tensors
            dq, dk, dv = _eager_backward(ctx.plan, do, q, k, v, o, buffer, *ctx.options, deterministic)
        return dq, dk, dv, None, None, None, None, None, None


# ---- one entry point a mode ------------------------------------------------------------------
#
# The packed-batch and KV-cache modes of `attention`, each with only its own arguments (as
# cuflash.attention_varlen and cuflash.attention_with_kvcache are for CuPy arrays).

from ._entry_points import check_boundaries_given  # noqa: E402  (the block stands apart at the end)

__all__ += ["attention_varlen", "attention_with_kvcache"]


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], *,
                     causal: bool = False, scale: Optional[float] = None, window=None, return_stats: bool = False):
    """Attention over a packed batch of sequences of different lengths, differentiable
    (flash_attn_varlen_func).

    Args:
        q: (Hq, total_q, d), k: (Hk, total_k, d), v: (Hk, total_k, dv) CUDA tensors, the
            sequences concatenated along the token dim, heads first: flash-attn's (total, H, d)
            tensors pass as ``x.transpose(0, 1)``, a view. Dtypes, head dims and grouped heads
            as :func:`attention`'s.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) CUDA tensors on q's device: sequence b
            owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], ...)
            of k and v, clamped into [0, total] by the kernels (never read by the host).
            With ``CUFLASH_VALIDATE=1`` eager calls and their backward check them first and
            raise a ValueError naming the first boundary out of range or falling.
        max_seqlen_q, max_seqlen_k: host ints sizing the grid; None computes them from the
            boundaries (one host sync; under torch.compile inside the operator).
        causal, window: aligned at each sequence's bottom right. scale: default 1 / sqrt(d).
        return_stats: also return the float32 softmax statistics.

    Returns:
        o (Hq, total_q, dv) in q's dtype; with ``return_stats=True`` an
        ``AttentionOutput(o, l, m)``, l and m (Hq, total_q) float32 and not differentiable.
        Rows that no sequence covers are unspecified, and so are their gradients. The backward
        is bit-reproducible under ``torch.use_deterministic_algorithms(True)``; the call works
        under torch.compile.

    Example:
        >>> cu = torch.tensor([0, 17, 130, 131], dtype=torch.int32, device="cuda")   # 3 sequences
        >>> q = torch.randn(8, 131, 64, device="cuda", dtype=torch.float16, requires_grad=True)
        >>> cuflash.torch.attention_varlen(q, q, q, cu, cu, 113, 113, causal=True).sum().backward()
    """
    check_boundaries_given("cuflash.torch.attention_varlen", cu_seqlens_q, cu_seqlens_k)
    return attention(q, k, v, causal=causal, scale=scale, window=window, return_stats=return_stats,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k)


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           page_table: Optional[torch.Tensor] = None, seqlens_k: Optional[torch.Tensor] = None,
                           num_splits: Optional[int] = None, causal: bool = False, scale: Optional[float] = None,
                           window=None, return_stats: bool = False):
    """Decoding: a few new queries a sequence against a dense or paged KV cache, split over the keys.

    Args:
        q: (batch..., Hq, Nq, d) CUDA tensor (flash-attn's (B, Nq, Hq, d) as ``q.transpose(1, 2)``).
        k_cache, v_cache: dense (batch..., Hk, Nk, d) / (..., dv) with q's batch dims, or, with
            ``page_table``, paged (num_pages, Hk, page_size, d) / (..., dv), page_size a power
            of two in 16..256; vLLM's (num_pages, page_size, Hk, d) passes as
            ``.transpose(1, 2)``, a view. Hk divides Hq.
        page_table: int32 (batch, max_pages), contiguous, on q's device; a page index outside
            [0, num_pages) is never read (its keys are masked).
        seqlens_k: int32 (batch,) on q's device; required with ``page_table``, optional for a
            dense cache (default Nk); clamped into [0, capacity] by the kernels. With
            ``CUFLASH_VALIDATE=1`` eager calls check both first and raise a ValueError naming
            the first length past the capacity or page index in use outside the pool.
        num_splits: key splits of each (batch, k/v head), 1 to
            ``cuflash._constants.MAX_DECODE_SPLITS``; None chooses from the shapes and the GPU.
        causal, window: aligned at each sequence's end. scale: default 1 / sqrt(d).
        return_stats: also return the float32 softmax statistics.

    With any of ``page_table``, ``seqlens_k``, ``num_splits`` the call runs the split-KV
    decoding kernels, forward only (on tensors that need no grad), capturable in a CUDA graph
    with fixed buffers: 1 to 16 queries a head, float16 or bfloat16, head dims up to 128.
    Without them it is :func:`attention` over a whole dense cache.

    Returns:
        o (batch..., Hq, Nq, dv) in q's dtype; with ``return_stats=True`` an
        ``AttentionOutput(o, l, m)``, l and m (batch..., Hq, Nq) float32.

    Example (vLLM's cache layout, one new token a sequence):
        >>> k_cache = torch.zeros(num_pages, 64, 8, 128, dtype=torch.float16, device="cuda")
        >>> o = cuflash.torch.attention_with_kvcache(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2),
        ...                                          page_table=block_tables, seqlens_k=context_lens)
    """
    return attention(q, k_cache, v_cache, causal=causal, scale=scale, window=window, return_stats=return_stats,
                     page_table=page_table, seqlens_k=seqlens_k, num_splits=num_splits)
