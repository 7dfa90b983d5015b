"""PyTorch adapter: differentiable cuflash attention for CUDA tensors.

    import cuflash.torch
    o = cuflash.torch.attention(q, k, v, causal=True)      # q, k, v: (B, H, N, d)
    o = cuflash.torch.attention(q, k, v, block_mask=cuflash.masks.butterfly(32), window=(512, 0))

Both passes are registered as custom operators (``torch.ops.cuflash.attention_fwd`` and
``torch.ops.cuflash.attention_bwd``) with fake (meta) implementations and an autograd
formula, so they work under ``torch.compile(fullgraph=True)``, ``torch.export`` and
``torch.library.opcheck``.  The kernels run on torch's current stream of the inputs' device
and allocate their outputs (and any scratch space) through torch's caching allocator.
"""

import collections
import threading
from typing import Optional, Tuple

import torch

import cuflash as _cf

from . import _views
from ._api import NO_WINDOW, AttentionOutput, as_block_mask, window_option
from .masks import BlockMask

__all__ = ["attention"]


def _out_lead_shape(q_shape, k_shape, v_shape):
    """Leading dims of o, l, m: cuflash's broadcasting with grouped heads.

    torch.broadcast_shapes (not NumPy's) so that fake tensors with symbolic sizes work.
    """
    lq = tuple(q_shape[:-2])
    lkv = tuple(torch.broadcast_shapes(tuple(k_shape[:-2]), tuple(v_shape[:-2])))
    if lq and lkv:
        hq, hk = lq[-1], lkv[-1]
        if hk > 1 and hk != hq and hq % hk == 0:  # grouped heads: k/v head h serves h*g..h*g+g-1
            lkv = lkv[:-1] + (hq,)
    return tuple(torch.broadcast_shapes(lq, lkv))


def _cupy_stream(device):
    import cupy

    stream = torch.cuda.current_stream(device)
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, device.index)


def _torch_allocator(device):
    """A CuPy allocator handing out torch caching-allocator memory on ``device``.

    With it, cuflash's outputs live in torch's pool (no second cache competing for GPU memory,
    counted by torch.cuda.memory_allocated) and follow torch's stream semantics: allocated on
    the current stream, which is where the kernels run.
    """
    import cupy

    def allocate(nbytes):
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # The UnownedMemory holds ``buf``: the block returns to torch when CuPy lets go of it.
        return cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(buf.data_ptr(), nbytes, buf, device.index), 0
        )

    return allocate


def _check_cuda(*tensors):
    device = tensors[0].device
    for t in tensors:
        if t.device.type != "cuda" or t.device != device:
            raise ValueError(
                f"cuflash.torch.attention needs CUDA tensors on one device, got devices "
                f"{', '.join(str(t.device) for t in tensors)}"
            )
    return device


def _run(device, fn, *tensors, **kwargs):
    """Call ``fn`` on CuPy views of ``tensors`` on torch's stream; results back as tensors."""
    import cupy

    with cupy.cuda.Device(device.index), cupy.cuda.using_allocator(_torch_allocator(device)):
        with _cupy_stream(device):  # made inside Device(): from_external records the current one
            # The kernels run on torch's current stream, so the inputs need no stream
            # hand-off: direct views (cuflash/_views.py), not DLPack's costlier exchange.
            results = fn(*(_views.torch_view(t, same_stream=True) for t in tensors), **kwargs)
            # .contiguous() is a no-op for cuflash's fresh outputs; it pins the layout to the
            # one the fake implementations promise.
            return tuple(torch.from_dlpack(r).contiguous() for r in results)


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


def _sparsity(block_mask: Optional[int], window_left: int, window_right: int) -> dict:
    """cuflash.attention's keyword arguments for the operators' mask token and window."""
    mask = None if block_mask is None else BlockMask.from_token(block_mask)
    return dict(block_mask=mask, window=(window_left, window_right))


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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = _check_cuda(q, k, v)
    return _run(device, _cf.attention, q, k, v, causal=causal, scale=scale,
                **_sparsity(block_mask, window_left, window_right))


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, scale, block_mask=None, window_left=-1, window_right=-1):
    lead = _out_lead_shape(q.shape, k.shape, v.shape)
    o = q.new_empty(lead + (q.shape[-2], v.shape[-1]))
    l = q.new_empty(lead + (q.shape[-2],), dtype=torch.float32)
    return o, l, torch.empty_like(l)


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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = _check_cuda(do, q, k, v, o, l, m)
    # The incoming gradient's layout is autograd's choice, not the user's: e.g. the gradient
    # of o.sum() is an expanded (stride-0) tensor, which cuflash cannot read. Copy then.
    if not _kernel_readable(do):
        do = do.contiguous()
    l, m = l.contiguous(), m.contiguous()  # no-ops for the forward's own outputs
    return _run(
        device, _cf.attention_backward, do, q, k, v, o, l, m,
        causal=causal, scale=scale, **_sparsity(block_mask, window_left, window_right),
        # torch.use_deterministic_algorithms(True) selects the bit-reproducible backward.
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )


@_attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, l, m, causal, scale, block_mask=None, window_left=-1, window_right=-1):
    # Contiguous like the real outputs (empty_like would copy a permuted input's strides).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs  # causal, scale, block_mask, window_left, window_right
    o, l, m = output
    ctx.save_for_backward(q, k, v, o, l, m)
    ctx.options = options
    # l and m are softmax statistics, returned for inspection; no gradient flows through them.
    ctx.mark_non_differentiable(l, m)


def _backward(ctx, do, _dl, _dm):
    q, k, v, o, l, m = ctx.saved_tensors
    dq, dk, dv = _attention_bwd(do, q, k, v, o, l, m, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


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
):
    """Exact scaled dot-product attention (FlashAttention) on CUDA tensors, differentiable.

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

    Returns:
        o (..., Nq, dv) in q's dtype; with ``return_stats=True`` an
        ``AttentionOutput(o, l, m)`` where, with S = scale * q k^T, m = max_j S and
        l = sum_j exp(S - m) (shape (..., Nq)); l and m are not differentiable.

    The backward pass is bit-reproducible when ``torch.use_deterministic_algorithms(True)``
    is in effect. A row with no allowed key (causal with Nq > Nk) gets o = 0 and zero
    gradients.
    """
    mask = as_block_mask(block_mask, block_size)
    left, right = window_option(window) or NO_WINDOW
    o, l, m = _attention_fwd(q, k, v, bool(causal), None if scale is None else float(scale),
                             _mask_token(mask), left, right)
    return AttentionOutput(o, l, m) if return_stats else o
