"""Property-based tests: drawn problems through the kernels, forward and backward, against the
float64 reference with the error rule of gpu_util (GPU; skipped without one).

A problem is a dtype, head dims d and dv (multiples of 8 up to 256), lengths from 1 (Nk from
0), leading dims with broadcast and grouped heads, a strided layout per tensor, causal, a
scale, and -- once cuflash.attention takes them and gpu_util's checks take a mask -- a block
mask and a sliding window. Examples are derandomized, so CI runs the same 40 each time.
"""

import inspect

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import cuflash  # noqa: E402
from conftest import requires_gpu  # noqa: E402
from cuflash import reference as ref  # noqa: E402
from fuzz_strategies import (SEEDS, buffer_shape, element_mask_of, fuzz_settings,  # noqa: E402
                             layout_for, lead_dims, sparsity, strided_views)
from gpu_util import DTYPES, check_backward, check_forward, random_array, to_device  # noqa: E402

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]

_API = inspect.signature(cuflash.attention).parameters
_CHECKS_TAKE_MASK = all("mask" in inspect.signature(f).parameters for f in (check_forward, check_backward))
SPARSE_KWARGS = {name: name in _API and _CHECKS_TAKE_MASK for name in ("block_mask", "window")}


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    d = 8 * draw(st.integers(1, 32))
    dv = draw(st.one_of(st.just(d), st.integers(1, 32).map(lambda x: 8 * x)))
    nq, nk = draw(st.integers(1, 260)), draw(st.integers(0, 260))
    lead = draw(lead_dims())
    shapes = {"q": lead.q + (nq, d), "k": lead.kv + (nk, d), "v": lead.kv + (nk, dv)}
    layouts = {name: layout_for(draw, shape) for name, shape in shapes.items()}
    seed = draw(SEEDS)
    kwargs = draw(sparsity(nq, nk, np.random.default_rng(seed), **SPARSE_KWARGS))
    return dict(
        dtype=dtype, shapes=shapes, layouts=layouts, seed=seed, sparse=kwargs,
        causal=draw(st.booleans()), deterministic=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
    )


@fuzz_settings(max_examples=40)
@given(problem=problems())
def test_forward_and_backward_match_the_reference(problem):
    dtype, causal, scale = problem["dtype"], problem["causal"], problem["scale"]
    rng = np.random.default_rng(problem["seed"])
    host, dev = {}, {}
    for name, shape in problem["shapes"].items():
        layout = problem["layouts"][name]
        buffer = random_array(rng, buffer_shape(shape, layout), dtype)
        host[name], dev[name] = strided_views(buffer, layout, to_device)
        assert host[name].shape == shape
    q, k, v = (host[n] for n in "qkv")
    nq, nk = q.shape[-2], k.shape[-2]
    sparse = problem["sparse"]
    mask = element_mask_of(nq, nk, sparse)
    checks = {"causal": causal, "scale": scale, "dtype": dtype, **({"mask": mask} if mask is not None else {})}

    out = cuflash.attention(dev["q"], dev["k"], dev["v"], causal=causal, scale=scale, **sparse)
    check_forward(out, q, k, v, **checks)

    out_lead = ref.broadcast_plan(q.shape, k.shape, v.shape).batch_shape
    do = random_array(rng, out_lead + (nq, v.shape[-1]), dtype)
    grads = cuflash.attention_backward(to_device(do), dev["q"], dev["k"], dev["v"], *out, causal=causal,
                                       scale=scale, deterministic=problem["deterministic"], **sparse)
    check_backward(grads, do, q, k, v, **checks)
