"""cuflash.attention_varlen and cuflash.attention_with_kvcache on the GPU: each gives what
cuflash.attention gives for the same mode, bit for bit, and stays within the error rule against
the float64 reference; bad index arrays are refused, naming the argument, before any launch.
Outputs come from the poisoned pool, and caches hold NaN wherever the kernels must not read."""

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import reference as ref
from entry_util import paged_problem
from gpu_util import check_forward, launched_variants, random_array, to_device
from test_decode_gpu import PagedCache, check, inputs, poisoned_past
from varlen_util import check_forward as check_varlen_forward
from varlen_util import packed_inputs

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]

LENGTHS_Q = (1, 17, 0, 113, 300)  # length 1, an empty sequence, nq != nk, past a tile
LENGTHS_K = (17, 1, 5, 113, 257)


def assert_same(got, want, rows=None):
    """Two AttentionOutputs equal bit for bit (on the packed ``rows`` of axis 1 where given)."""
    for a, b in zip(got, want):
        a, b = a.get(), b.get()
        if rows is not None:
            a, b = a[:, rows], b[:, rows]
        np.testing.assert_array_equal(a, b)


def token_major(x):
    """A host (H, total, d) array as flash-attn lays it out on the device, (total, H, d), seen
    through the heads-first view the entry point takes."""
    return to_device(np.ascontiguousarray(x.swapaxes(0, 1))).swapaxes(0, 1)


@pytest.mark.parametrize("window", (None, (40, 13)), ids=("nowindow", "window40_13"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
def test_varlen_equals_attention_and_the_reference(dtype, causal, window, rng):
    import cuflash

    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, LENGTHS_Q, LENGTHS_K, hq=4, hk=2, d=64)
    dq, dk, dv = (token_major(x) for x in (q, k, v))
    assert not dq.flags.c_contiguous
    cq, ck = to_device(cu_q), to_device(cu_k)
    got = cuflash.attention_varlen(dq, dk, dv, cq, ck, max(LENGTHS_Q), max(LENGTHS_K), causal=causal, window=window)
    check_varlen_forward(got, q, k, v, cu_q, cu_k, dtype=dtype, causal=causal, window=window)
    want = cuflash.attention(dq, dk, dv, causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck,
                             max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K))
    covered = ref.covered_rows(cu_q, q.shape[1])
    assert_same(got, want, covered)
    # the longest lengths left to the call: read from the boundaries, the same result
    assert_same(cuflash.attention_varlen(dq, dk, dv, cq, ck, None, None, causal=causal, window=window), want, covered)


def test_varlen_writes_the_given_outputs(rng):
    import cupy

    import cuflash

    q, k, v, cu_q, cu_k = packed_inputs(rng, "bfloat16", LENGTHS_Q, LENGTHS_K, hq=4, hk=2, d=64)
    args = [to_device(x) for x in (q, k, v, cu_q, cu_k)]
    given = (cupy.empty_like(args[0]), cupy.empty(q.shape[:2], cupy.float32), cupy.empty(q.shape[:2], cupy.float32))
    got = cuflash.attention_varlen(*args, 300, 257, causal=True, out=given)
    assert all(a is b for a, b in zip(got, given))
    check_varlen_forward(got, q, k, v, cu_q, cu_k, dtype="bfloat16", causal=True)


@pytest.mark.parametrize("num_splits", (1, 3, None))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_kvcache_paged_equals_attention_and_the_reference(dtype, causal, num_splits, rng):
    """vLLM's (num_pages, page_size, Hk, d) cache, shuffled pages, passed as its view."""
    import cuflash

    q, k, v, lengths, cache = paged_problem(rng, dtype, vllm=True)
    k_cache, v_cache, table, seqlens = cache.device()
    options = dict(page_table=table, seqlens_k=seqlens, num_splits=num_splits, causal=causal)
    got = cuflash.attention_with_kvcache(to_device(q), k_cache, v_cache, **options)
    check(got, q, k, v, lengths, dtype, causal=causal)
    assert_same(got, cuflash.attention(to_device(q), k_cache, v_cache, **options))


@pytest.mark.parametrize("window", (None, (50, 0)), ids=("nowindow", "window50_0"))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_kvcache_dense_with_lengths(dtype, window, rng):
    import cuflash

    lengths = [3, 700, 0]
    q, k, v = inputs(rng, dtype, len(lengths), (8, 2), 1, 700, 64)
    k_dev, v_dev = poisoned_past(k, lengths), poisoned_past(v, lengths)
    options = dict(seqlens_k=to_device(np.asarray(lengths, np.int32)), window=window)
    got = cuflash.attention_with_kvcache(to_device(q), k_dev, v_dev, **options)
    check(got, q, k, v, lengths, dtype, window=window)
    assert_same(got, cuflash.attention(to_device(q), k_dev, v_dev, **options))


@pytest.mark.parametrize("nq,dtype", ((1, "bfloat16"), (40, "float32")), ids=("decoding", "forward"))
def test_kvcache_without_index_arrays_is_attention_over_the_whole_cache(nq, dtype, rng):
    """No page table, lengths or split count: cuflash.attention's call, whichever kernels its
    shapes take (one query a head in bfloat16 fits the split-KV kernels, 40 in float32 not)."""
    import cuflash

    q = random_array(rng, (2, 8, nq, 64), dtype)
    k, v = (random_array(rng, (2, 2, 513, 64), dtype) for _ in range(2))
    args = [to_device(x) for x in (q, k, v)]
    got = cuflash.attention_with_kvcache(*args, causal=True)
    check_forward(got, q, k, v, causal=True, dtype=dtype)
    assert_same(got, cuflash.attention(*args, causal=True))


def _varlen_call(rng, cu_q=None, cu_k=None):
    import cuflash

    q, k, v, good_q, good_k = packed_inputs(rng, "bfloat16", LENGTHS_Q, LENGTHS_K, hq=4, hk=2, d=64)
    cu_q, cu_k = (good if bad is None else bad for good, bad in ((good_q, cu_q), (good_k, cu_k)))
    return cuflash.attention_varlen(*(to_device(x) for x in (q, k, v, cu_q, cu_k)), 300, 257)


def _paged_call(rng, table=None):
    import cuflash

    lengths = [5, 100]
    q, k, v = inputs(rng, "float16", len(lengths), (8, 2), 1, 128, 64)
    k_cache, v_cache, good_table, seqlens = PagedCache(rng, k, v, lengths, page_size=64).device()
    table = good_table if table is None else to_device(table)
    return cuflash.attention_with_kvcache(to_device(q), k_cache, v_cache, page_table=table, seqlens_k=seqlens)


BAD_CALLS = {
    "cu_q_int64": (lambda rng: _varlen_call(rng, cu_q=np.arange(6, dtype=np.int64)), ValueError,
                   r"cu_seqlens_q must be a 1-D int32 array of length batch \+ 1, got shape \(6,\), dtype int64"),
    "cu_k_2d": (lambda rng: _varlen_call(rng, cu_k=np.zeros((6, 1), np.int32)), ValueError,
                r"cu_seqlens_k must be a 1-D int32 array .* got shape \(6, 1\), dtype int32"),
    "cu_lengths_differ": (lambda rng: _varlen_call(rng, cu_k=np.zeros(4, np.int32)), ValueError,
                          r"cu_seqlens_q and cu_seqlens_k must have one length .* \(6,\) and \(4,\)"),
    "table_1d": (lambda rng: _paged_call(rng, table=np.zeros(2, np.int32)), ValueError,
                 r"page_table must have shape \(batch, max_pages\) = \(2, >= 1\) .* got shape \(2,\), dtype int32"),
    "table_int64": (lambda rng: _paged_call(rng, table=np.zeros((2, 2), np.int64)), TypeError,
                    r"page_table must be int32, got shape \(2, 2\), dtype int64"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_index_arrays_are_refused_before_any_launch(name, rng):
    call, error, message = BAD_CALLS[name]
    with launched_variants() as launched, pytest.raises(error, match=message):
        call(rng)
    assert launched == []
