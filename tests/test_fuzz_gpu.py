"""Property-based tests: drawn problems through the kernels, forward and backward, against the
float64 reference with the error rule of gpu_util (GPU; skipped without one).

Dense: a dtype, head dims d and dv (multiples of 8 up to 256), lengths from 1 (Nk from 0),
leading dims with broadcast and grouped heads, a strided layout per tensor, causal, a scale,
and -- once cuflash.attention takes them and gpu_util's checks take a mask -- a block mask and
a sliding window. Packed batches (varlen): sequences of lengths from 0 (0 and 1 drawn often),
grouped heads, flash-attn's (total, heads, d) layout or the packed one, causal and a window,
max_seqlen given exactly, too small, or not at all; forward and gradients. Decoding: dense and
paged caches (every page size, vLLM's layout as a view), lengths from 0 to past the capacity,
1-16 queries a head over grouped heads, causal and a window, split counts forced or chosen.

Examples are derandomized, so CI runs the same ones each time; every problem holds the seed of
its arrays, which hypothesis prints with a failing example.
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
from fuzz_strategies import (SEEDS, buffer_shape, element_mask_of, fuzz_settings, head_dims,  # noqa: E402
                             layout_for, lead_dims, lengths, sparsity, strided_views, windows)
from gpu_util import DTYPES, check_backward, check_forward, random_array, to_device  # noqa: E402
from test_decode_gpu import PagedCache, poisoned_past  # noqa: E402
from test_decode_gpu import check as check_decoding  # noqa: E402
from test_decode_gpu import inputs as decode_inputs  # noqa: E402
from varlen_util import check_backward as check_packed_backward  # noqa: E402
from varlen_util import check_forward as check_packed_forward  # noqa: E402
from varlen_util import packed_inputs  # noqa: E402

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


# ---- packed variable-length batches -------------------------------------------------------------


@st.composite
def packed_problems(draw):
    batch = draw(st.integers(1, 5))
    kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    lengths_q, lengths_k = (draw(st.lists(lengths(200), min_size=batch, max_size=batch)) for _ in range(2))
    return dict(
        dtype=draw(st.sampled_from(DTYPES)), dims=draw(head_dims(256)), heads=(kv_heads * group, kv_heads),
        lengths_q=lengths_q, lengths_k=lengths_k, causal=draw(st.booleans()), window=draw(windows(200)),
        deterministic=draw(st.booleans()), tokens_first=draw(st.booleans()),
        max_seqlen=draw(st.sampled_from(("exact", "short", None))), seed=draw(SEEDS),
    )


def packed_view(host, tokens_first):
    """A device copy of a packed (heads, total, d) host array: as it is, or as the (heads,
    total, d) view of a (total, heads, d) buffer (flash_attn_varlen_func's layout)."""
    if not tokens_first:
        return to_device(host)
    return to_device(np.ascontiguousarray(host.swapaxes(0, 1))).swapaxes(0, 1)


@fuzz_settings(max_examples=30)
@given(problem=packed_problems())
def test_packed_batches_match_the_reference(problem):
    dtype, causal, window = problem["dtype"], problem["causal"], problem["window"]
    rng = np.random.default_rng(problem["seed"])
    (d, dv), (hq, hk) = problem["dims"], problem["heads"]
    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, problem["lengths_q"], problem["lengths_k"], hq, hk, d, dv)
    longest = {"exact": (max(problem["lengths_q"]), max(problem["lengths_k"])),  # a shorter one sizes the grid only
               "short": (max(problem["lengths_q"]) // 3, max(problem["lengths_k"]) // 3),
               None: (None, None)}[problem["max_seqlen"]]
    packed = dict(causal=causal, window=window, cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k),
                  max_seqlen_q=longest[0], max_seqlen_k=longest[1])
    dev = [packed_view(x, problem["tokens_first"]) for x in (q, k, v)]
    out = cuflash.attention(*dev, **packed)
    check_packed_forward(out, q, k, v, cu_q, cu_k, dtype=dtype, causal=causal, window=window)
    do = random_array(rng, (hq, q.shape[1], dv), dtype)
    grads = cuflash.attention_backward(packed_view(do, problem["tokens_first"]), *dev, *out,
                                       deterministic=problem["deterministic"], **packed)
    check_packed_backward(grads, do, q, k, v, cu_q, cu_k, dtype=dtype, causal=causal, window=window)


# ---- decoding against dense and paged caches ------------------------------------------------------


@st.composite
def cache_problems(draw):
    page_size = draw(st.sampled_from((None, 16, 32, 64, 128, 256)))
    capacity = draw(st.integers(1, 600)) if page_size is None else page_size * draw(st.integers(1, 5))
    batch, kv_heads = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    length = st.one_of(lengths(capacity), st.sampled_from((capacity, capacity + 7, -3)))  # clamped past either end
    return dict(
        dtype=draw(st.sampled_from(("float16", "bfloat16"))), dims=draw(head_dims(128)),
        heads=(kv_heads * draw(st.sampled_from((1, 2, 4, 8))), kv_heads), nq=draw(st.integers(1, 16)),
        page_size=page_size, capacity=capacity, vllm=draw(st.booleans()),
        lengths=draw(st.lists(length, min_size=batch, max_size=batch)), causal=draw(st.booleans()),
        window=draw(windows(64)), num_splits=draw(st.one_of(st.none(), st.integers(1, 8))), seed=draw(SEEDS),
    )


@fuzz_settings(max_examples=30)
@given(problem=cache_problems())
def test_decoding_matches_the_reference(problem):
    """Through cuflash.attention's page_table / seqlens_k; the caches hold NaN past each
    sequence's length and in every page no table entry of a used page points at."""
    dtype, page_size, raw = problem["dtype"], problem["page_size"], problem["lengths"]
    rng = np.random.default_rng(problem["seed"])
    (d, dv), capacity = problem["dims"], problem["capacity"]
    q, k, v = decode_inputs(rng, dtype, len(raw), problem["heads"], problem["nq"], capacity, d, dv)
    clamped = [min(max(n, 0), capacity) for n in raw]
    options = dict(causal=problem["causal"], window=problem["window"], num_splits=problem["num_splits"])
    if page_size is None:
        out = cuflash.attention(to_device(q), poisoned_past(k, clamped), poisoned_past(v, clamped),
                                seqlens_k=to_device(np.asarray(raw, np.int32)), **options)
    else:
        cache = PagedCache(rng, k, v, clamped, page_size, vllm=problem["vllm"])
        cache.lengths = np.asarray(raw, np.int32)  # the kernels clamp what the table was built for
        k_dev, v_dev, table, seqlens = cache.device()
        out = cuflash.attention(to_device(q), k_dev, v_dev, page_table=table, seqlens_k=seqlens, **options)
    check_decoding(out, q, k, v, clamped, dtype, causal=problem["causal"], window=problem["window"])
