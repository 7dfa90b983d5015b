"""Bad input at every public entry point: each argument tried with a wrong shape, dtype, device,
stride, negative or out-of-range value must raise TypeError / ValueError whose message names the
argument and quotes what was given or expected, and must leave the caller's out= buffers as
they were.

The checks that run before any GPU work are tried everywhere. Without a GPU their arrays are
CuPy arrays over host memory (:func:`host_backed`): metadata only, so a bad input that got
past its checks fails the test at the call's first CUDA call (CUDARuntimeError) instead of
being accepted without a word. With a GPU they are device arrays. The checks that run after the call
has entered its device (decoding, out=) and the adapters (torch, JAX) need a GPU.
"""

from __future__ import annotations

import functools
import re
from typing import Callable, NamedTuple

import numpy as np
import pytest

import cuflash
from conftest import HAS_GPU, jax_has_gpu, requires_gpu
from cuflash import masks

F16, F32, I32 = np.float16, np.float32, np.int32
Q, KV, STATS = (2, 4, 16, 64), (2, 2, 32, 64), (2, 4, 16)  # grouped heads: 4 query heads on 2 k/v heads
VQ, VKV, VSTATS = (4, 100, 64), (2, 80, 64), (4, 100)  # packed: (heads, total rows, head dim)
PAGED_Q, PAGES = (3, 8, 1, 128), (20, 2, 16, 128)  # 3 sequences, 20 pages of 16 keys


def host_backed(shape, dtype, device: int = 0):
    """A cupy.ndarray whose memory is a zeroed host buffer, claiming to live on ``device``:
    enough for every host-side check (shape, strides, dtype, address, device), and a call
    that reaches the GPU with it fails there."""
    import cupy

    host = np.zeros(shape, dtype)
    memory = cupy.cuda.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=device)
    return cupy.ndarray(host.shape, host.dtype, cupy.cuda.MemoryPointer(memory, 0))


def make(shape, dtype=F16, device: int = 0):
    """The array a case passes: device zeros with a GPU (a host-backed array claiming another
    device where this machine has no second GPU: the device checks come before any launch),
    host-backed without one."""
    if not HAS_GPU:
        return host_backed(shape, dtype, device)
    import cupy

    if device >= cupy.cuda.runtime.getDeviceCount():
        return host_backed(shape, dtype, device)
    with cupy.cuda.Device(device):
        return cupy.zeros(shape, dtype)


class Bad(NamedTuple):
    function: str  # the entry point: cuflash.<function>, or masks.<function>
    argument: str  # the argument that is wrong
    label: str
    call: Callable  # () -> anything: the call with the bad argument
    error: type
    match: str  # a regex the message must contain: the argument's name and what was given


def attention(q=Q, k=KV, v=KV, dtypes=(F16, F16, F16), **kwargs):
    """cuflash.attention on new arrays of these shapes (an array passes as itself)."""
    q, k, v = (make(x, t) if isinstance(x, tuple) else x for x, t in zip((q, k, v), dtypes))
    return cuflash.attention(q, k, v, **kwargs)


def backward(do=Q, o=Q, l=STATS, m=STATS, q=Q, k=KV, v=KV, **kwargs):
    """cuflash.attention_backward on new arrays of these shapes (float16, statistics float32)."""
    arrays = [make(x, t) if isinstance(x, tuple) else x
              for x, t in zip((do, q, k, v, o, l, m), (F16,) * 5 + (F32, F32))]
    return cuflash.attention_backward(*arrays, **kwargs)


def varlen(q=VQ, k=VKV, v=VKV, cu_q=(3,), cu_k=(3,), entry="attention", **kwargs):
    """cuflash.attention, or with ``entry`` cuflash.attention_varlen, on a packed batch of two
    sequences (int32 boundaries)."""
    kwargs.setdefault("max_seqlen_q", 50)
    kwargs.setdefault("max_seqlen_k", 40)
    q, k, v = (make(x) if isinstance(x, tuple) else x for x in (q, k, v))
    cu_q, cu_k = (make(c, I32) if isinstance(c, tuple) else c for c in (cu_q, cu_k))
    if entry == "attention_varlen":
        return cuflash.attention_varlen(q, k, v, cu_q, cu_k, kwargs.pop("max_seqlen_q"), kwargs.pop("max_seqlen_k"),
                                        **kwargs)
    return cuflash.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kwargs)


def varlen_backward(l=VSTATS, cu_q=(3,), cu_k=(3,), **kwargs):
    """cuflash.attention_backward on a packed batch of two sequences."""
    kwargs.setdefault("max_seqlen_q", 50)
    kwargs.setdefault("max_seqlen_k", 40)
    cu_q, cu_k = (make(c, I32) if isinstance(c, tuple) else c for c in (cu_q, cu_k))
    return cuflash.attention_backward(make(VQ), make(VQ), make(VKV), make(VKV), make(VQ), make(l, F32),
                                      make(VSTATS, F32), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kwargs)


# ---- checked before any GPU work -------------------------------------------------------------


def forward_case(argument, label, call, error, match):
    return Bad("attention", argument, label, call, error, match)


def backward_case(argument, label, call, error, match):
    return Bad("attention_backward", argument, label, call, error, match)


DENSE = [
    forward_case("q", "float64", lambda: attention(dtypes=(np.float64, F16, F16)), TypeError,
                 r"q, k and v must share one dtype, got q float64, k float16, v float16"),
    forward_case("v", "float32", lambda: attention(dtypes=(F16, F16, F32)), TypeError,
                 r"got q float16, k float16, v float32"),
    forward_case("q", "int32 inputs", lambda: attention(dtypes=(I32,) * 3), TypeError, r"dtype int32 is not supported"),
    forward_case("q", "numpy", lambda: attention(q=np.zeros(Q, F16)), TypeError,
                 r"q is a NumPy array .*\(2, 4, 16, 64\)"),
    forward_case("k", "a list", lambda: attention(k=[1.0, 2.0]), TypeError, r"k must be a GPU array.*list"),
    forward_case("q", "1-D", lambda: attention(q=(64,)), ValueError,
                 r"q must have shape \(\.\.\., N, head_dim\), got \(64,\)"),
    forward_case("k", "0-D", lambda: attention(k=()), ValueError,
                 r"k must have shape \(\.\.\., N, head_dim\), got \(\)"),
    forward_case("k", "head dim unlike q's", lambda: attention(k=(2, 2, 32, 32), v=(2, 2, 32, 32)), ValueError,
                 r"q and k head dims differ: q \(2, 4, 16, 64\), k \(2, 2, 32, 32\)"),
    forward_case("v", "length unlike k's", lambda: attention(v=(2, 2, 33, 64)), ValueError,
                 r"k and v sequence lengths differ: k \(2, 2, 32, 64\), v \(2, 2, 33, 64\)"),
    forward_case("q", "head dim 12", lambda: attention(q=(2, 4, 16, 12), k=(2, 2, 32, 12), v=(2, 2, 32, 12)),
                 ValueError, r"head dim of q/k must be a multiple of 8 between 8 and 256, got 12"),
    forward_case("q", "head dim 0", lambda: attention(q=(2, 4, 16, 0), k=(2, 2, 32, 0), v=(2, 2, 32, 0)), ValueError,
                 r"head dim of q/k .* got 0"),
    forward_case("v", "head dim 264", lambda: attention(v=(2, 2, 32, 264)), ValueError, r"head dim of v .* got 264"),
    forward_case("q", "3 heads on 2", lambda: attention(q=(2, 3, 16, 64)), ValueError,
                 r"do not broadcast: q \(2, 3, 16, 64\), k \(2, 2, 32, 64\)"),
    forward_case("q", "batch 3 on 2", lambda: attention(q=(3, 4, 16, 64)), ValueError,
                 r"do not broadcast: q \(3, 4, 16, 64\)"),
    forward_case("k", "last dim strided", lambda: attention(k=make((2, 2, 64, 32)).swapaxes(-1, -2)), ValueError,
                 r"last dim of k must be contiguous .*element strides \(4096, 2048, 1, 32\)"),
    forward_case("v", "misaligned", lambda: attention(v=make((2, 2, 32, 72))[..., 3:67]), ValueError,
                 r"v must be 16-byte aligned .*element strides \(4608, 2304, 72, 1\)"),
    forward_case("q", "on device 1", lambda: attention(q=make(Q, F16, device=1)), ValueError,
                 r"q, k and v must be on one device, got devices \[1, 0, 0\]"),
    forward_case("scale", "0", lambda: attention(scale=0.0), ValueError, r"scale must be finite and positive, got 0.0"),
    forward_case("scale", "-1", lambda: attention(scale=-1), ValueError, r"scale must be finite and positive, got -1"),
    forward_case("scale", "inf", lambda: attention(scale=float("inf")), ValueError, r"scale must be finite .*got inf"),
    forward_case("scale", "nan", lambda: attention(scale=float("nan")), ValueError, r"scale must be finite .*got nan"),
    forward_case("scale", "a string", lambda: attention(scale="big"), TypeError,
                 r"scale must be a real number, got 'big'"),
    forward_case("scale", "True", lambda: attention(scale=True), TypeError, r"scale must be a real number, got True"),
    forward_case("window", "an int", lambda: attention(window=5), ValueError,
                 r"window must be a \(left, right\) pair, got 5"),
    forward_case("window", "of 3", lambda: attention(window=(1, 2, 3)), ValueError,
                 r"window must be .* pair, got \(1, 2, 3\)"),
    forward_case("window", "a float side", lambda: attention(window=(1.5, 2)), TypeError,
                 r"window left must be an integer, got 1.5"),
    forward_case("window", "a side -3", lambda: attention(window=(0, -3)), ValueError,
                 r"window right must be >= -1, got -3"),
    forward_case("block_mask", "grid", lambda: attention(block_mask=np.ones((3, 3), bool), block_size=16), ValueError,
                 r"block mask of shape \(3, 3\) with block_size \(16, 16\) does not fit Nq=16, Nk=32"),
    forward_case("block_mask", "3 on 2 batches", lambda: attention(block_mask=np.ones((3, 1, 1, 2), bool),
                                                                   block_size=16), ValueError, r"\(3, 1, 1, 2\)"),
    forward_case("block_mask", "float", lambda: attention(block_mask=np.ones((1, 1), F32)), TypeError,
                 r"block_mask must be a cuflash.masks.BlockMask or a boolean array .*dtype float32"),
    forward_case("block_size", "0", lambda: attention(block_mask=np.ones((1, 1), bool), block_size=0), ValueError,
                 r"block_size must be >= 1, got 0"),
    forward_case("block_size", "alone", lambda: attention(block_size=16), ValueError,
                 r"block_size=16 was given without a block_mask"),
    forward_case("block_size", "against a BlockMask's",
                 lambda: attention(block_mask=masks.dense(1, n_k_blocks=2, block_size=16), block_size=32), ValueError,
                 r"block_size=32 differs from the block size \(16, 16\)"),
    forward_case("page_table", "with block_mask", lambda: attention(block_mask=np.ones((1, 1), bool),
                                                                   page_table=make((2, 2), I32)), ValueError,
                 r"block_mask cannot be combined with page_table"),
]

BACKWARD = [
    backward_case("do", "shape", lambda: backward(do=(2, 4, 15, 64)), ValueError,
                  r"do must have the forward output's shape \(2, 4, 16, 64\), got \(2, 4, 15, 64\)"),
    backward_case("do", "float32", lambda: backward(do=make(Q, F32)), TypeError,
                  r"do must have q's dtype float16, got float32"),
    backward_case("q", "float32", lambda: backward(q=make(Q, F32)), TypeError,
                  r"q, k and v must share one dtype, got q float32, k float16, v float16"),
    backward_case("k", "3 heads", lambda: backward(k=(2, 3, 32, 64), v=(2, 3, 32, 64)), ValueError,
                  r"do not broadcast: q \(2, 4, 16, 64\), k \(2, 3, 32, 64\)"),
    backward_case("v", "head dim 12", lambda: backward(v=(2, 2, 32, 12)), ValueError, r"head dim of v .* got 12"),
    backward_case("o", "float32", lambda: backward(o=make(Q, F32)), TypeError,
                  r"o must have q's dtype float16, got float32"),
    backward_case("o", "shape", lambda: backward(o=(2, 4, 16, 32)), ValueError,
                  r"o must have the forward output's shape \(2, 4, 16, 64\), got \(2, 4, 16, 32\)"),
    backward_case("l", "float16", lambda: backward(l=make(STATS, F16)), ValueError,
                  r"l must be the forward's C-contiguous float32 array of shape \(2, 4, 16\), got .*dtype float16"),
    backward_case("l", "shape", lambda: backward(l=(2, 4, 15)), ValueError, r"l must be .* got shape \(2, 4, 15\)"),
    backward_case("m", "strided", lambda: backward(m=make((2, 16, 4), F32).swapaxes(1, 2)), ValueError,
                  r"m must be .*C-contiguous.* contiguous False"),
    backward_case("l", "numpy", lambda: backward(l=np.zeros(STATS, F32)), TypeError, r"l is a NumPy array"),
    backward_case("do", "last dim strided", lambda: backward(do=make((2, 4, 64, 16)).swapaxes(-1, -2)), ValueError,
                  r"last dim of do must be contiguous"),
    backward_case("do", "misaligned", lambda: backward(do=make((2, 4, 16, 72))[..., 3:67]), ValueError,
                  r"do must be 16-byte aligned"),
    backward_case("o", "on device 1", lambda: backward(o=make(Q, F16, device=1)), ValueError,
                  r"all arguments must be on one device, got devices \[0, 0, 0, 0, 1, 0, 0\]"),
    backward_case("scale", "0", lambda: backward(scale=0.0), ValueError, r"scale must be finite and positive"),
    backward_case("window", "a side -3", lambda: backward(window=(0, -3)), ValueError,
                  r"window right must be >= -1, got -3"),
    backward_case("block_mask", "grid", lambda: backward(block_mask=np.ones((2, 2), bool), block_size=16), ValueError,
                  r"does not fit Nq=16, Nk=32"),
    backward_case("block_size", "alone", lambda: backward(block_size=(16, 32)), ValueError,
                  r"block_size=\(16, 32\) was given without a block_mask"),
    backward_case("cu_seqlens_q", "int64", lambda: varlen_backward(cu_q=make((3,), np.int64)), ValueError,
                  r"cu_seqlens_q must be a 1-D int32 array of length batch \+ 1, got shape \(3,\), dtype int64"),
    backward_case("cu_seqlens_k", "alone", lambda: varlen_backward(cu_q=None), ValueError,
                  r"only cu_seqlens_k was given"),
    backward_case("l", "packed shape", lambda: varlen_backward(l=(4, 99)), ValueError,
                  r"l must be the forward's C-contiguous float32 array of shape \(4, 100\), got shape \(4, 99\)"),
    backward_case("max_seqlen_q", "float", lambda: varlen_backward(max_seqlen_q=5.0), TypeError,
                  r"max_seqlen_q must be a host int \(or None\), got float 5.0"),
    backward_case("max_seqlen_k", "-2", lambda: varlen_backward(max_seqlen_k=-2), ValueError,
                  r"max_seqlen_k must be >= 0, got -2"),
]

VARLEN = [
    forward_case("cu_seqlens_q", "alone", lambda: varlen(cu_k=None), ValueError,
                 r"cu_seqlens_q and cu_seqlens_k must be given together; only cu_seqlens_q was given"),
    forward_case("cu_seqlens_q", "int64", lambda: varlen(cu_q=make((3,), np.int64)), ValueError,
                 r"cu_seqlens_q must be a 1-D int32 array of length batch \+ 1, got shape \(3,\), dtype int64"),
    forward_case("cu_seqlens_k", "2-D", lambda: varlen(cu_k=make((3, 1), I32)), ValueError,
                 r"cu_seqlens_k must be a 1-D int32 array .*got shape \(3, 1\)"),
    forward_case("cu_seqlens_q", "empty", lambda: varlen(cu_q=(0,), cu_k=(0,)), ValueError,
                 r"cu_seqlens_q must be a 1-D int32 array of length batch \+ 1, got shape \(0,\)"),
    forward_case("cu_seqlens_k", "length unlike cu_seqlens_q's", lambda: varlen(cu_q=(4,)), ValueError,
                 r"cu_seqlens_q and cu_seqlens_k must have one length \(batch \+ 1\), got shapes \(4,\) and \(3,\)"),
    forward_case("cu_seqlens_q", "on device 1", lambda: varlen(cu_q=make((3,), I32, device=1)), ValueError,
                 r"cu_seqlens_q must be on q's device 0, got device 1"),
    forward_case("cu_seqlens_q", "numpy", lambda: varlen(cu_q=np.zeros(3, I32)), TypeError,
                 r"cu_seqlens_q is a NumPy array"),
    forward_case("cu_seqlens_k", "a list", lambda: varlen(cu_k=[0, 1, 2]), TypeError,
                 r"cu_seqlens_k must be a GPU array"),
    forward_case("max_seqlen_q", "-1", lambda: varlen(max_seqlen_q=-1), ValueError,
                 r"max_seqlen_q must be >= 0, got -1"),
    forward_case("max_seqlen_k", "float", lambda: varlen(max_seqlen_k=2.5), TypeError,
                 r"max_seqlen_k must be a host int \(or None\), got float 2.5"),
    forward_case("max_seqlen_q", "True", lambda: varlen(max_seqlen_q=True), TypeError,
                 r"max_seqlen_q must be a host int"),
    forward_case("q", "packed 4-D", lambda: varlen(q=Q), ValueError,
                 r"with cu_seqlens, q must have shape \(heads, total_tokens, head_dim\) .*got \(2, 4, 16, 64\)"),
    forward_case("q", "packed 3 heads on 2", lambda: varlen(q=(3, 100, 64)), ValueError,
                 r"do not broadcast: q \(3, 100, 64\)"),
    forward_case("v", "packed rows unlike k's", lambda: varlen(v=(2, 81, 64)), ValueError,
                 r"k and v sequence lengths differ"),
    forward_case("block_mask", "packed", lambda: varlen(block_mask=np.ones((1, 1), bool)), ValueError,
                 r"block_mask cannot be combined with cu_seqlens_q / cu_seqlens_k"),
    forward_case("page_table", "packed", lambda: varlen(page_table=make((2, 2), I32)), ValueError,
                 r"page_table \(the split-KV decoding path\) cannot be combined with cu_seqlens_q"),
]


def varlen_case(argument, label, call, error, match):
    return Bad("attention_varlen", argument, label, call, error, match)


VARLEN_ENTRY = [
    varlen_case("q", "4-D", lambda: varlen(q=Q, entry="attention_varlen"), ValueError,
                r"with cu_seqlens, q must have shape \(heads, total_tokens, head_dim\)"),
    varlen_case("k", "3 heads", lambda: varlen(k=(3, 80, 64), v=(3, 80, 64), entry="attention_varlen"), ValueError,
                r"do not broadcast: q \(4, 100, 64\), k \(3, 80, 64\)"),
    varlen_case("v", "rows unlike k's", lambda: varlen(v=(2, 81, 64), entry="attention_varlen"), ValueError,
                r"k and v sequence lengths differ"),
    varlen_case("cu_seqlens_q", "None", lambda: varlen(cu_q=None, entry="attention_varlen"), TypeError,
                r"attention_varlen needs cu_seqlens_q, an int32 array of length batch \+ 1 .*got None"),
    varlen_case("cu_seqlens_k", "int64", lambda: varlen(cu_k=make((3,), np.int64), entry="attention_varlen"),
                ValueError, r"cu_seqlens_k must be a 1-D int32 array .*dtype int64"),
    varlen_case("max_seqlen_q", "-1", lambda: varlen(max_seqlen_q=-1, entry="attention_varlen"), ValueError,
                r"max_seqlen_q must be >= 0, got -1"),
    varlen_case("max_seqlen_k", "float", lambda: varlen(max_seqlen_k=2.5, entry="attention_varlen"), TypeError,
                r"max_seqlen_k must be a host int \(or None\), got float 2.5"),
    varlen_case("scale", "0", lambda: varlen(scale=0.0, entry="attention_varlen"), ValueError,
                r"scale must be finite and positive, got 0.0"),
    varlen_case("window", "a side -3", lambda: varlen(window=(0, -3), entry="attention_varlen"), ValueError,
                r"window right must be >= -1, got -3"),
]


def _parts(o=(2, 3, 8), l=(2, 3), o_dtype=F32, l_dtype=F32, m_dtype=F32):
    return np.zeros(o, o_dtype), np.zeros(l, l_dtype), np.zeros(l, m_dtype)


def merge_case(argument, label, call, error, match):
    return Bad("merge", argument, label, call, error, match)


def stacked_case(argument, label, call, error, match):
    return Bad("merge_stacked", argument, label, call, error, match)


MERGE = [
    merge_case("l_b", "shape", lambda: cuflash.merge(*_parts(), *_parts(l=(2, 4))), ValueError,
               r"l_b must have shape \(2, 3\).* got o_a \(2, 3, 8\), l_a \(2, 3\), .*l_b \(2, 4\)"),
    merge_case("o_b", "head dim", lambda: cuflash.merge(*_parts(), *_parts(o=(2, 3, 4))), ValueError,
               r"o_b must have shape \(2, 3, 8\)"),
    merge_case("l_a", "float16", lambda: cuflash.merge(*_parts(l_dtype=F16), *_parts()), TypeError,
               r"l_a, m_a, l_b, m_b must share one dtype out of float32, float64, got l_a float16"),
    merge_case("m_b", "int32", lambda: cuflash.merge(*_parts(), *_parts(m_dtype=I32)), TypeError,
               r"got l_a float32, m_a float32, l_b float32, m_b int32"),
    merge_case("m_a", "shape", lambda: cuflash.merge(np.zeros((2, 3, 8), F32), np.zeros((2, 3), F32),
                                                     np.zeros((3, 2), F32), *_parts()), ValueError,
               r"m_a must have shape \(2, 3\)"),
    merge_case("o_a", "int32", lambda: cuflash.merge(*_parts(o_dtype=I32), *_parts(o_dtype=I32)), TypeError,
               r"o_a, o_b must share one dtype out of float16, bfloat16, float32, float64, got o_a int32"),
    merge_case("o_b", "float16 against float32", lambda: cuflash.merge(*_parts(), *_parts(o_dtype=F16)), TypeError,
               r"got o_a float32, o_b float16"),
    merge_case("o_a", "a list", lambda: cuflash.merge([1.0], *_parts()[1:], *_parts()), TypeError,
               r"cuflash.merge takes NumPy, CuPy, torch or JAX arrays, got builtins.list"),
    merge_case("o_a", "another framework", lambda: cuflash.merge(host_backed((2, 3, 8), F32), *_parts()[1:],
                                                                 *_parts()), TypeError,
               r"cuflash.merge needs all arrays from one framework, got o_a cupy, l_a numpy"),
    stacked_case("l", "0-D", lambda: cuflash.merge_stacked(np.zeros((3, 2, 8), F32), np.zeros((), F32),
                                                           np.zeros((), F32)), ValueError,
                 r"l must have shape \(P, \.\.\., Nq\) with the parts along axis 0, got \(\)"),
    stacked_case("m", "shape", lambda: cuflash.merge_stacked(np.zeros((3, 2, 8), F32), np.zeros((3, 2), F32),
                                                             np.zeros((3, 3), F32)), ValueError,
                 r"m must have shape \(3, 2\).*m \(3, 3\)"),
    stacked_case("o", "float64 statistics with int o", lambda: cuflash.merge_stacked(
        np.zeros((3, 2, 8), I32), np.zeros((3, 2)), np.zeros((3, 2))), TypeError,
                 r"o must share one dtype .*got o int32"),
]


def masks_case(function, argument, label, call, error, match):
    return Bad(f"masks.{function}", argument, label, call, error, match)


MASKS = [
    masks_case("butterfly", "n_blocks", "0", lambda: masks.butterfly(0), ValueError, r"n_blocks must be >= 1, got 0"),
    masks_case("butterfly", "n_blocks", "3", lambda: masks.butterfly(3), ValueError,
               r"butterfly needs n_blocks to be a power of two, got 3"),
    masks_case("butterfly", "n_blocks", "2.0", lambda: masks.butterfly(2.0), TypeError,
               r"n_blocks must be an integer, got 2.0"),
    masks_case("fixed", "c", "past block", lambda: masks.fixed(8, 4, 5), ValueError,
               r"fixed needs 0 <= c <= block, got c=5, block=4"),
    masks_case("fixed", "block", "0", lambda: masks.fixed(8, 0, 1), ValueError, r"block must be >= 1, got 0"),
    masks_case("strided", "stride", "0", lambda: masks.strided(8, 0), ValueError, r"stride must be >= 1, got 0"),
    masks_case("local", "window_blocks", "-1", lambda: masks.local(8, -1), ValueError,
               r"window_blocks must be >= 0, got -1"),
    masks_case("causal", "n_blocks", "-2", lambda: masks.causal(-2), ValueError, r"n_blocks must be >= 1, got -2"),
    masks_case("global_tokens", "n_global", "-1", lambda: masks.global_tokens(8, -1), ValueError,
               r"n_global must be >= 0, got -1"),
    masks_case("random", "density", "2", lambda: masks.random(8, 2.0), ValueError,
               r"density must lie in \[0, 1\], got 2.0"),
    masks_case("dense", "n_k_blocks", "0", lambda: masks.dense(4, n_k_blocks=0), ValueError,
               r"n_k_blocks must be >= 1, got 0"),
    masks_case("dense", "block_size", "(0, 16)", lambda: masks.dense(4, block_size=(0, 16)), ValueError,
               r"block_size\[0\] \(bq\) must be >= 1, got 0"),
    masks_case("dense", "block_size", "(16,)", lambda: masks.dense(4, block_size=(16,)), ValueError,
               r"block_size must be an int or a \(bq, bk\) pair, got \(16,\)"),
    masks_case("dense", "block_size", "True", lambda: masks.dense(4, block_size=True), TypeError,
               r"block_size must be an integer, got True"),
    masks_case("BlockMask.from_dense", "blocks", "1-D", lambda: masks.BlockMask.from_dense(np.ones(4, bool)),
               ValueError, r"blocks must have shape \(\.\.\., Tq, Tk\), got shape \(4,\)"),
    masks_case("BlockMask.from_dense", "blocks", "2s", lambda: masks.BlockMask.from_dense(np.full((2, 2), 2)),
               TypeError, r"blocks must be a boolean array \(True = tile present\), got dtype int64"),
    masks_case("BlockMask", "kv_indices", "past the grid", lambda: masks.BlockMask(np.array([1]), np.array([[5]]), 4),
               ValueError, r"kv_indices must lie in \[0, n_k_blocks=4\) where valid"),
    masks_case("BlockMask", "kv_indices", "decreasing", lambda: masks.BlockMask(np.array([2]), np.array([[2, 1]]), 4),
               ValueError, r"kv_indices must be strictly increasing"),
    masks_case("BlockMask", "kv_num_blocks", "float", lambda: masks.BlockMask(np.array([1.0]), np.array([[0]]), 4),
               TypeError, r"kv_num_blocks must be an integer array, got dtype float64"),
    masks_case("BlockMask", "kv_num_blocks", "past the width",
               lambda: masks.BlockMask(np.array([3]), np.array([[0, 1]]), 4), ValueError,
               r"kv_num_blocks must lie in \[0, min\(W=2, n_k_blocks=4\)\], got values in \[3, 3\]"),
    masks_case("BlockMask", "kv_indices", "shape", lambda: masks.BlockMask(np.array([1, 1]), np.array([[0]]), 4),
               ValueError, r"kv_indices must have shape kv_num_blocks.shape \+ \(W,\): kv_num_blocks.shape=\(2,\), "
               r"kv_indices.shape=\(1, 1\)"),
    masks_case("BlockMask", "n_k_blocks", "-1", lambda: masks.BlockMask(np.array([0]), np.array([[0]]), -1),
               ValueError, r"n_k_blocks must be >= 0, got -1"),
    masks_case("sliding_window", "left", "-2", lambda: masks.sliding_window(8, 8, -2, 0), ValueError,
               r"left must be >= -1, got -2"),
    masks_case("sliding_window", "nq", "-1", lambda: masks.sliding_window(-1, 8, 1, 0), ValueError,
               r"nq must be >= 0, got -1"),
    masks_case("window_block_mask", "right", "a pair", lambda: masks.window_block_mask(8, 8, 1, (1, 0)), TypeError,
               r"right must be an integer, got \(1, 0\)"),
    masks_case("BlockMask.__or__", "other", "block size", lambda: masks.dense(2, block_size=16) | masks.dense(
        2, block_size=32), ValueError, r"cannot combine block masks with different block sizes"),
    masks_case("BlockMask.__and__", "other", "grid", lambda: masks.dense(2) & masks.dense(3), ValueError,
               r"cannot combine block masks with different block grids"),
    masks_case("BlockMask.check", "nq", "past the grid", lambda: masks.dense(2, block_size=16).check(100, 10),
               ValueError,
               r"does not fit Nq=100, Nk=10: Nq=100 needs ceil\(100/16\) = 7 query blocks, the mask has Tq=2"),
]

BEFORE_THE_GPU = DENSE + BACKWARD + VARLEN + VARLEN_ENTRY + MERGE + MASKS


def case_id(bad: Bad) -> str:
    return f"{bad.function}-{bad.argument}-{bad.label}"


def raises_naming(bad: Bad):
    """Run a case: the error must be bad.error with bad.match in its message. A CUDA error
    means the call passed every check and went on to the GPU."""
    try:
        bad.call()
    except bad.error as exc:
        assert re.search(bad.match, str(exc)), f"{case_id(bad)}: unclear message {str(exc)!r}"
        return
    except Exception as exc:  # noqa: BLE001 - anything else, the GPU's error included, is a failure
        pytest.fail(f"{case_id(bad)}: {type(exc).__name__} instead of {bad.error.__name__}: {exc}")
    pytest.fail(f"{case_id(bad)}: accepted")


@pytest.mark.parametrize("bad", BEFORE_THE_GPU, ids=case_id)
def test_checked_before_any_gpu_work(bad):
    raises_naming(bad)


# Arguments that take any value: each is read as a bool (bool("no") is True), so no value is
# refused. Listed so that the test below names every other argument.
TAKEN_AS_BOOL = {"causal", "deterministic"}


def test_every_argument_of_every_entry_point_has_a_bad_case():
    """Each argument of each public function has a case: a new argument without one fails."""
    import inspect

    functions = {name: getattr(cuflash, name) for name in (
        "attention", "attention_varlen", "attention_with_kvcache", "attention_backward", "merge", "merge_stacked")}
    assert set(functions) == {name for name in cuflash.__all__ if inspect.isfunction(getattr(cuflash, name))}
    tried = {}
    for bad in BEFORE_THE_GPU + GPU_ONLY:
        tried.setdefault(bad.function, set()).add(bad.argument)
    for name, function in functions.items():
        assert tried[name] == set(inspect.signature(function).parameters) - TAKEN_AS_BOOL, name
    patterns = {f"masks.{name}" for name in masks.__all__ if inspect.isfunction(getattr(masks, name))}
    assert patterns <= set(tried), patterns - set(tried)


# ---- checked after the call has entered its device: GPU only ---------------------------------

def decode(q=PAGED_Q, k=PAGES, v=PAGES, page_table=(3, 4), seqlens_k=(3,), entry="attention", **kwargs):
    """cuflash.attention, or with ``entry`` cuflash.attention_with_kvcache, against a paged cache
    of 20 pages of 16 keys, 3 sequences."""
    q, k, v = (make(x) if isinstance(x, tuple) else x for x in (q, k, v))
    page_table, seqlens_k = (make(x, I32) if isinstance(x, tuple) else x for x in (page_table, seqlens_k))
    return getattr(cuflash, entry)(q, k, v, page_table=page_table, seqlens_k=seqlens_k, **kwargs)


def forward_out(o=Q, l=STATS, m=STATS, o_dtype=F16, stats_dtype=F32):
    return tuple(make(x, t) if isinstance(x, tuple) else x for x, t in ((o, o_dtype), (l, stats_dtype),
                                                                          (m, stats_dtype)))


GPU_ONLY = [
    forward_case("seqlens_k", "missing with a page table", lambda: decode(seqlens_k=None), ValueError,
                 r"a paged cache needs seqlens_k \(int32, \(batch,\)\)"),
    forward_case("page_table", "int64", lambda: decode(page_table=make((3, 4), np.int64)), TypeError,
                 r"page_table must be int32, got shape \(3, 4\), dtype int64"),
    forward_case("page_table", "batch", lambda: decode(page_table=(2, 4)), ValueError,
                 r"page_table must have shape \(batch, max_pages\) = \(3, >= 1\) .*got shape \(2, 4\)"),
    forward_case("page_table", "1-D", lambda: decode(page_table=(12,)), ValueError,
                 r"page_table must have shape .*\(12,\)"),
    forward_case("page_table", "no pages", lambda: decode(page_table=(3, 0)), ValueError,
                 r"page_table must have shape .*got shape \(3, 0\)"),
    forward_case("page_table", "strided", lambda: decode(page_table=make((4, 3), I32).T), ValueError,
                 r"page_table must be C-contiguous, got shape \(3, 4\), dtype int32 with strides \(4, 12\)"),
    forward_case("seqlens_k", "shape", lambda: decode(seqlens_k=(2,)), ValueError,
                 r"seqlens_k must have shape \(3,\), got shape \(2,\)"),
    forward_case("seqlens_k", "int64", lambda: decode(seqlens_k=make((3,), np.int64)), TypeError,
                 r"seqlens_k must be int32, got shape \(3,\), dtype int64"),
    forward_case("seqlens_k", "numpy", lambda: decode(seqlens_k=np.zeros(3, I32)), TypeError,
                 r"seqlens_k is a NumPy array"),
    forward_case("k", "page size 24", lambda: decode(k=(20, 2, 24, 128), v=(20, 2, 24, 128)), ValueError,
                 r"page size \(k.shape\[2\]\) must be one of \(16, 32, 64, 128, 256\), got k shape \(20, 2, 24, 128\)"),
    forward_case("q", "17 queries against a cache", lambda: decode(q=(3, 8, 17, 128)), ValueError,
                 r"decoding takes 1 to 16 queries a head, got q shape \(3, 8, 17, 128\)"),
    forward_case("q", "head dim 256 against a cache",
                 lambda: decode(q=(3, 8, 1, 256), k=(20, 2, 16, 256), v=(20, 2, 16, 256)), ValueError,
                 r"decoding takes head dims up to 128, got q shape \(3, 8, 1, 256\)"),
    forward_case("q", "float32 against a cache", lambda: cuflash.attention(
        make(PAGED_Q, F32), make(PAGES, F32), make(PAGES, F32), page_table=make((3, 4), I32),
        seqlens_k=make((3,), I32)), TypeError,
                 r"decoding takes float16 or bfloat16, got q shape \(3, 8, 1, 128\), dtype float32"),
    forward_case("k", "3 heads in a cache", lambda: decode(k=(20, 3, 16, 128), v=(20, 3, 16, 128)), ValueError,
                 r"the k/v heads must divide the query heads: q shape \(3, 8, 1, 128\).*k shape \(20, 3, 16, 128\)"),
    forward_case("v", "pages unlike k's", lambda: decode(v=(21, 2, 16, 128)), ValueError,
                 r"k and v must agree in every dim but the last"),
    forward_case("k", "3-D cache", lambda: decode(k=(2, 16, 128), v=(2, 16, 128)), ValueError,
                 r"k must have shape \(num_pages, Hk, page_size, head_dim\), got shape \(2, 16, 128\)"),
    forward_case("num_splits", "0", lambda: decode(num_splits=0), ValueError,
                 r"num_splits must be between 1 and 256, got 0"),
    forward_case("num_splits", "257", lambda: decode(num_splits=257), ValueError,
                 r"num_splits must be between 1 and 256"),
    forward_case("num_splits", "1.5", lambda: decode(num_splits=1.5), TypeError,
                 r"num_splits must be an int or None, got 1.5"),
    forward_case("num_splits", "True", lambda: decode(num_splits=True), TypeError,
                 r"num_splits must be an int .*got True"),
    forward_case("num_splits", "with 200 queries", lambda: cuflash.attention(
        make((3, 8, 200, 128)), make((3, 2, 100, 128)), make((3, 2, 100, 128)), num_splits=2), ValueError,
                 r"decoding takes 1 to 16 queries a head, got q shape \(3, 8, 200, 128\)"),
    forward_case("window", "a float side against a cache", lambda: decode(window=(1.5, 0)), TypeError,
                 r"window left must be an integer, got 1.5"),
    forward_case("scale", "0 against a cache", lambda: decode(scale=0), ValueError,
                 r"scale must be finite and positive, got 0"),
    forward_case("q", "misaligned against a cache", lambda: decode(q=make((3, 8, 1, 136))[..., 3:131]), ValueError,
                 r"q must be 16-byte aligned"),
    forward_case("k", "last dim strided in a cache", lambda: decode(k=make((20, 2, 128, 16)).swapaxes(-1, -2)),
                 ValueError, r"last dim of k must be contiguous"),
    forward_case("seqlens_k", "batch unlike q's", lambda: cuflash.attention(
        make((3, 8, 1, 128)), make((2, 2, 100, 128)), make((2, 2, 100, 128)), seqlens_k=make((3,), I32)),
                 ValueError, r"the batch dims of q and k must be equal: q shape \(3, 8, 1, 128\)"),
    forward_case("out", "o shape", lambda: attention(out=forward_out(o=(2, 4, 16, 32))), ValueError,
                 r"out's o must be a C-contiguous float16 array of shape \(2, 4, 16, 64\), got shape \(2, 4, 16, 32\)"),
    forward_case("out", "o float32", lambda: attention(out=forward_out(o_dtype=F32)), ValueError,
                 r"out's o must be a C-contiguous float16 array .*dtype float32"),
    forward_case("out", "m float16", lambda: attention(out=forward_out(m=make(STATS, F16))), ValueError,
                 r"out's m must be a C-contiguous float32 array of shape \(2, 4, 16\), got .*dtype float16"),
    forward_case("out", "of 2", lambda: attention(out=forward_out()[:2]), TypeError,
                 r"out must be a tuple \(o, l, m\) of 3 arrays, got tuple of 2"),
    forward_case("out", "an array", lambda: attention(out=make(Q)), TypeError,
                 r"out must be a tuple \(o, l, m\) of 3 arrays"),
    forward_case("out", "numpy", lambda: attention(out=(np.zeros(Q, F16),) + forward_out()[1:]), TypeError,
                 r"out's o is a NumPy array"),
    forward_case("out", "strided", lambda: attention(out=forward_out(o=make((2, 16, 4, 64)).swapaxes(1, 2))),
                 ValueError, r"out's o must be a C-contiguous .*strides \(8192, 128, 512, 2\)"),
    forward_case("out", "overlapping q", lambda: (lambda q: attention(q=q, out=forward_out(o=q)))(make(Q)),
                 ValueError, r"out's o overlaps q"),
    forward_case("out", "l as m", lambda: (lambda l: attention(out=forward_out(l=l, m=l)))(make(STATS, F32)),
                 ValueError, r"out's l overlaps out's m"),
    forward_case("out", "o shape against a cache", lambda: decode(out=(
        make((3, 8, 1, 64)), make((3, 8, 1), F32), make((3, 8, 1), F32))), ValueError,
                 r"out's o must be a C-contiguous float16 array of shape \(3, 8, 1, 128\)"),
    forward_case("out", "packed l shape", lambda: varlen(out=(make(VQ), make((4, 99), F32), make(VSTATS, F32))),
                 ValueError, r"out's l must be a C-contiguous float32 array of shape \(4, 100\)"),
    backward_case("out", "dk shape", lambda: backward(out=(make(Q), make((2, 2, 32, 32)), make(KV))), ValueError,
                  r"out's dk must be a C-contiguous float16 array of shape \(2, 2, 32, 64\), "
                  r"got shape \(2, 2, 32, 32\)"),
    backward_case("out", "of 1", lambda: backward(out=(make(Q),)), TypeError,
                  r"out must be a tuple \(dq, dk, dv\) of 3 arrays, got tuple of 1"),
    varlen_case("out", "l shape", lambda: varlen(out=(make(VQ), make((4, 99), F32), make(VSTATS, F32)),
                                                 entry="attention_varlen"), ValueError,
                r"out's l must be a C-contiguous float32 array of shape \(4, 100\)"),
]


def kvcache_case(argument, label, call, error, match):
    return Bad("attention_with_kvcache", argument, label, call, error, match)


GPU_ONLY += [
    kvcache_case("q", "17 queries", lambda: decode(q=(3, 8, 17, 128), entry="attention_with_kvcache"), ValueError,
                 r"decoding takes 1 to 16 queries a head, got q shape \(3, 8, 17, 128\)"),
    kvcache_case("k_cache", "page size 24", lambda: decode(k=(20, 2, 24, 128), v=(20, 2, 24, 128),
                                                           entry="attention_with_kvcache"), ValueError,
                 r"page size \(k.shape\[2\]\) must be one of .*got k shape \(20, 2, 24, 128\)"),
    kvcache_case("v_cache", "pages unlike k_cache's", lambda: decode(v=(21, 2, 16, 128),
                                                                     entry="attention_with_kvcache"), ValueError,
                 r"k and v must agree in every dim but the last"),
    kvcache_case("page_table", "int64", lambda: decode(page_table=make((3, 4), np.int64),
                                                       entry="attention_with_kvcache"), TypeError,
                 r"page_table must be int32, got shape \(3, 4\), dtype int64"),
    kvcache_case("seqlens_k", "shape", lambda: decode(seqlens_k=(2,), entry="attention_with_kvcache"), ValueError,
                 r"seqlens_k must have shape \(3,\), got shape \(2,\)"),
    kvcache_case("num_splits", "0", lambda: decode(num_splits=0, entry="attention_with_kvcache"), ValueError,
                 r"num_splits must be between 1 and 256, got 0"),
    kvcache_case("scale", "0", lambda: decode(scale=0, entry="attention_with_kvcache"), ValueError,
                 r"scale must be finite and positive, got 0"),
    kvcache_case("window", "a float side", lambda: decode(window=(1.5, 0), entry="attention_with_kvcache"),
                 TypeError, r"window left must be an integer, got 1.5"),
    kvcache_case("out", "o shape", lambda: decode(out=(make((3, 8, 1, 64)), make((3, 8, 1), F32),
                                                       make((3, 8, 1), F32)), entry="attention_with_kvcache"),
                 ValueError, r"out's o must be a C-contiguous float16 array of shape \(3, 8, 1, 128\)"),
]


@requires_gpu
@pytest.mark.parametrize("bad", GPU_ONLY, ids=case_id)
def test_checked_on_the_gpu(bad):
    raises_naming(bad)


POISON = 0xFF  # every byte: NaN in float16, bfloat16 and float32


def poisoned(shape, dtype):
    array = make(shape, dtype)
    array.view(np.uint8)[...] = POISON
    return array


# Each entry point that takes out=: the call, and the shapes and dtypes of its three outputs.
OUT_CALLS = {
    "attention": (attention, ((Q, F16), (STATS, F32), (STATS, F32))),
    "attention_backward": (backward, ((Q, F16), (KV, F16), (KV, F16))),
    "attention against a cache": (decode, ((PAGED_Q, F16), (PAGED_Q[:-1], F32), (PAGED_Q[:-1], F32))),
    "attention on a packed batch": (varlen, ((VQ, F16), (VSTATS, F32), (VSTATS, F32))),
    "attention_varlen": (functools.partial(varlen, entry="attention_varlen"),
                         ((VQ, F16), (VSTATS, F32), (VSTATS, F32))),
    "attention_with_kvcache": (functools.partial(decode, entry="attention_with_kvcache"),
                               ((PAGED_Q, F16), (PAGED_Q[:-1], F32), (PAGED_Q[:-1], F32))),
}


@requires_gpu
@pytest.mark.parametrize("entry", OUT_CALLS)
@pytest.mark.parametrize("fault", ("scale", "last output"))
def test_an_error_writes_nothing_to_the_callers_buffers(entry, fault):
    """The caller's out= buffers, poisoned, are bit for bit unchanged after a call that fails:
    with a bad scale (found while planning), or with the last of three outputs misshapen
    (found after the call has taken the first two)."""
    import cupy

    call, specs = OUT_CALLS[entry]
    out = [poisoned(shape, dtype) for shape, dtype in specs]
    given, kwargs = list(out), {}
    if fault == "scale":
        kwargs["scale"] = -1.0
    else:
        given[-1] = poisoned((7,), specs[-1][1])
    with pytest.raises((TypeError, ValueError)):
        call(out=tuple(given), **kwargs)
    cupy.cuda.Device().synchronize()
    for index, array in enumerate(out):
        assert bool((array.view(np.uint8) == POISON).all()), f"out[{index}] was written"


# ---- the adapters -----------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_torch_adapter_names_bad_arguments():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    def t(shape, dtype=torch.float16, device="cuda"):
        return torch.zeros(shape, dtype=dtype, device=device)

    cases = [
        (lambda: ct.attention(t(Q, device="cpu"), t(KV), t(KV)), ValueError, r"needs CUDA tensors on one device"),
        (lambda: ct.attention(t(Q, torch.float64), t(KV), t(KV)), TypeError, r"q float64, k float16, v float16"),
        (lambda: ct.attention(t(Q), t((2, 2, 32, 32)), t(KV)), ValueError, r"q and k head dims differ"),
        (lambda: ct.attention(t(Q), t(KV), t(KV), window=(0, -3)), ValueError, r"window right must be >= -1"),
        (lambda: ct.attention(t(Q), t(KV), t(KV), scale=0.0), ValueError, r"scale must be finite and positive"),
        (lambda: ct.attention(t(PAGED_Q), t(PAGES), t(PAGES), page_table=t((3, 4), torch.int64),
                              seqlens_k=t((3,), torch.int32)), TypeError, r"page_table must be int32"),
        (lambda: ct.attention(t(PAGED_Q).requires_grad_(), t(PAGES), t(PAGES), page_table=t((3, 4), torch.int32),
                              seqlens_k=t((3,), torch.int32)), ValueError, r"no backward"),
        (lambda: ct.attention(t(VQ), t(VKV), t(VKV), cu_seqlens_q=t((3,), torch.int64),
                              cu_seqlens_k=t((3,), torch.int32), max_seqlen_q=5, max_seqlen_k=5), ValueError,
         r"cu_seqlens_q must be a 1-D int32 array"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_jax_adapter_names_bad_arguments():
    jax = pytest.importorskip("jax")
    if not jax_has_gpu(jax):
        pytest.skip("needs JAX with a CUDA GPU")
    import jax.numpy as jnp

    import cuflash.jax as cj

    def j(shape, dtype=jnp.float16):
        return jnp.zeros(shape, dtype)

    cases = [
        (lambda: cj.attention(j(Q, jnp.float32), j(KV), j(KV)), TypeError, r"q float32, k float16, v float16"),
        (lambda: cj.attention(j(Q), j((2, 2, 32, 32)), j(KV)), ValueError, r"q and k head dims differ"),
        (lambda: cj.attention(j(Q), j(KV), j(KV), window=(0, -3)), ValueError, r"window right must be >= -1"),
        (lambda: cj.attention(j(Q), j(KV), j(KV), scale=0.0), ValueError, r"scale must be finite and positive"),
        (lambda: cj.attention(j(PAGED_Q), j(PAGES), j(PAGES), page_table=[0, 1], seqlens_k=j((3,), jnp.int32)),
         TypeError, r"page_table must be an int32 array, got builtins.list"),
        (lambda: cj.attention(j(PAGED_Q), j(PAGES), j(PAGES), page_table=j((3, 4), jnp.int32),
                              seqlens_k=j((3,), jnp.int32), num_splits=0), ValueError,
         r"num_splits must be between 1 and 256, got 0"),
        (lambda: cj.attention(j(VQ), j(VKV), j(VKV), cu_seqlens_q=j((3, 1), jnp.int32),
                              cu_seqlens_k=j((3,), jnp.int32), max_seqlen_q=5, max_seqlen_k=5), ValueError,
         r"cu_seqlens_q must be a 1-D int32 array .*\(3, 1\)"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
