"""The speed table's backends: each way of running attention that it times, as a Backend
(the call, and what runs untimed around it): cuflash forward, backward and forward +
backward; standard attention in CuPy (standard_parts, which the IO table runs too); PyTorch
SDPA pinned to one backend. cuflash.bench.speed times them.

Importing this module needs neither a GPU nor CuPy's CUDA libraries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Optional

from .common import Env, as_cupy

SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION"}


def tile_label(tiles: tuple) -> str:
    return "cuflash[" + ",".join(map(str, tiles)) + "]"


@dataclasses.dataclass
class Backend:
    name: str
    fn: Callable  # fn(*args) -> output; args: an input set, or what prepare made of it
    context: Callable = contextlib.nullcontext  # entered around all calls
    convert: Optional[Callable] = None  # applied to each input outside the timing
    prepare: Optional[Callable] = None  # prepare(*input_set) -> args of fn, untimed
    max_sets: Optional[int] = None  # use at most this many input sets
    is_cuflash: bool = False
    tiles: Optional[tuple] = None


def cuflash_backend(causal: bool, hdim: int, tiles: Optional[tuple] = None) -> Backend:
    import cuflash
    from cuflash import _config

    def run(q, k, v):
        return cuflash.attention(q, k, v, causal=causal).o

    if tiles is None:
        return Backend("cuflash", run, is_cuflash=True)
    bucket = _config.head_dim_bucket(hdim)
    return Backend(tile_label(tiles), run,
                   context=lambda: _config.forward_tiles_override({bucket: tiles}),
                   is_cuflash=True, tiles=tiles)


def cuflash_backward_backend(causal: bool) -> Backend:
    """Times cuflash.attention_backward; o, l, m come from a forward run while preparing."""
    import cuflash

    def prepare(q, k, v, do):
        o, l, m = cuflash.attention(q, k, v, causal=causal)
        return do, q, k, v, o, l, m

    def run(do, q, k, v, o, l, m):
        return tuple(cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal))

    return Backend("cuflash", run, prepare=prepare, is_cuflash=True)


def cuflash_fwdbwd_backend(causal: bool) -> Backend:
    """Times cuflash.attention followed by cuflash.attention_backward in one call."""
    import cuflash

    def run(q, k, v, do):
        o, l, m = cuflash.attention(q, k, v, causal=causal)
        return tuple(cuflash.attention_backward(do, q, k, v, o, l, m, causal=causal))

    return Backend("cuflash", run, is_cuflash=True)


def standard_parts(env: Env, causal: bool, nq: int, nk: int, hdim: int):
    """(forward, backward) of standard attention in CuPy, in env.standard_dtype.

    forward(q, k, v) -> (o, p): S = q k^T * scale, causal -inf mask, float32 softmax, P cast
    back to the input dtype and kept, o = P v. backward(q, k, v, do, o, p) -> (dq, dk, dv) from
    that P, nothing recomputed: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)) in
    float32 then cast back, dQ = scale dS K, dK = scale dS^T Q.
    """
    cupy = env.cupy
    scale = 1.0 / math.sqrt(hdim)
    bias = None
    if causal:  # 0 where allowed, -inf where key j > query i + (nk - nq); built untimed
        rows = cupy.arange(nq)[:, None]
        cols = cupy.arange(nk)[None, :]
        bias = cupy.where(cols > rows + (nk - nq), cupy.float32(-cupy.inf), cupy.float32(0))

    def forward(q, k, v):
        s = cupy.matmul(q, k.swapaxes(-1, -2))
        s32 = s.astype(cupy.float32)
        del s
        s32 *= scale
        if bias is not None:
            s32 += bias
        s32 -= s32.max(axis=-1, keepdims=True)
        cupy.exp(s32, out=s32)
        s32 /= s32.sum(axis=-1, keepdims=True)
        p = s32.astype(q.dtype)
        del s32
        return cupy.matmul(p, v), p

    def backward(q, k, v, do, o, p):
        dv = cupy.matmul(p.swapaxes(-1, -2), do)
        dp = cupy.matmul(do, v.swapaxes(-1, -2))
        delta = (do.astype(cupy.float32) * o.astype(cupy.float32)).sum(axis=-1, keepdims=True)
        ds32 = dp.astype(cupy.float32)
        del dp
        ds32 -= delta
        ds32 *= p
        ds32 *= scale
        ds = ds32.astype(q.dtype)
        del ds32
        return cupy.matmul(ds, k), cupy.matmul(ds.swapaxes(-1, -2), q), dv

    return forward, backward


def standard_convert(env: Env) -> Callable:
    def convert(x):
        x = as_cupy(env, x)
        return x if x.dtype == env.standard_dtype else x.astype(env.standard_dtype)
    return convert


def standard_backend(env: Env, causal: bool, nq: int, nk: int, hdim: int) -> Backend:
    """The forward of standard_parts, all in CuPy."""
    forward, _ = standard_parts(env, causal, nq, nk, hdim)

    def run(q, k, v):
        return forward(q, k, v)[0]

    return Backend("standard", run, convert=standard_convert(env))


def standard_backward_backend(env: Env, causal: bool, nq: int, nk: int, hdim: int) -> Backend:
    """The backward of standard_parts from a materialised P. One input set only: P is
    batch * heads * seq^2 elements, far beyond any L2, and a second one may not fit."""
    forward, backward = standard_parts(env, causal, nq, nk, hdim)

    def prepare(q, k, v, do):
        o, p = forward(q, k, v)
        return q, k, v, do, o, p

    return Backend("standard", backward, convert=standard_convert(env), prepare=prepare,
                   max_sets=1)


def standard_fwdbwd_backend(env: Env, causal: bool, nq: int, nk: int, hdim: int) -> Backend:
    """Forward then backward of standard_parts in one call (P made and dropped per call)."""
    forward, backward = standard_parts(env, causal, nq, nk, hdim)

    def run(q, k, v, do):
        o, p = forward(q, k, v)
        return backward(q, k, v, do, o, p)

    return Backend("standard", run, convert=standard_convert(env))


def _sdpa(env: Env, name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = getattr(SDPBackend, SDPA_BACKENDS[name])
    return env.torch.nn.functional.scaled_dot_product_attention, (lambda: sdpa_kernel(which))


def sdpa_backend(env: Env, name: str, causal: bool) -> Backend:
    sdpa, context = _sdpa(env, name)

    def run(q, k, v):
        return sdpa(q, k, v, is_causal=causal)

    return Backend(name, run, context=context)


def sdpa_backward_backend(env: Env, name: str, causal: bool) -> Backend:
    """Times torch.autograd.grad of SDPA's output with a fixed dO, on a graph recorded once
    per input set while preparing (the backend choice is made by the forward)."""
    torch = env.torch
    sdpa, context = _sdpa(env, name)

    def prepare(q, k, v, do):
        leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
        with context():
            out = sdpa(*leaves, is_causal=causal)
        return out, leaves, do

    def run(out, leaves, do):
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    return Backend(name, run, prepare=prepare)


def sdpa_fwdbwd_backend(env: Env, name: str, causal: bool) -> Backend:
    """Times out = sdpa(q, k, v) and torch.autograd.grad(out, (q, k, v), dO) in one call."""
    torch = env.torch
    sdpa, context = _sdpa(env, name)

    def prepare(q, k, v, do):
        return tuple(x.detach().requires_grad_() for x in (q, k, v)) + (do,)

    def run(q, k, v, do):
        out = sdpa(q, k, v, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), do)

    return Backend(name, run, context=context, prepare=prepare)


def peer_backend(env: Env, name: str, causal: bool, shape: tuple, mode: str = "fwd") -> Backend:
    if name == "standard":
        parts = {"fwd": standard_backend, "bwd": standard_backward_backend,
                 "fwdbwd": standard_fwdbwd_backend}[mode]
        return parts(env, causal, shape[2], shape[2], shape[3])
    if mode == "fwd":
        return sdpa_backend(env, name, causal)
    if mode == "bwd":
        return sdpa_backward_backend(env, name, causal)
    return sdpa_fwdbwd_backend(env, name, causal)
