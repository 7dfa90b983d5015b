"""cuflash.jax.attention_varlen and cuflash.jax.attention_with_kvcache: attention's static and
traced arguments under jax.jit, and bad index arrays refused at trace time (JAX alone); on a
CUDA GPU, each against cuflash.jax.attention's result (bit for bit) and the float64 reference,
the packed batch's gradients too. Their signatures and the calls they make are tested in
test_entry_points.py.

Skipped without JAX."""

import os

import numpy as np
import pytest

from conftest import jax_has_gpu
from entry_util import paged_problem
from gpu_util import OnHost

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # cuflash allocates through CuPy
jax = pytest.importorskip("jax")
jnp = jax.numpy
cj = pytest.importorskip("cuflash.jax")

gpu = pytest.mark.skipif(not jax_has_gpu(jax), reason="needs JAX with a CUDA GPU")
S = jax.ShapeDtypeStruct
LENGTHS_Q = (1, 77, 0, 200)
LENGTHS_K = (5, 77, 3, 190)


# ---- trace time, without a GPU -----------------------------------------------------------------


def packed_specs(cu_q=(5,), cu_k=(5,), cu_dtype=jnp.int32):
    """q (4, 278, 64), k and v (2, 275, 64) in bfloat16, and boundaries of the given shapes."""
    return (S((4, 278, 64), jnp.bfloat16), S((2, 275, 64), jnp.bfloat16), S((2, 275, 64), jnp.bfloat16),
            S(cu_q, cu_dtype), S(cu_k, jnp.int32))


def paged_specs(table=(4, 10), table_dtype=jnp.int32):
    """One query a head of 4 sequences against a (num_pages, Hk, page_size, d) cache."""
    return (S((4, 32, 1, 128), jnp.bfloat16), S((40, 8, 64, 128), jnp.bfloat16), S((40, 8, 64, 128), jnp.bfloat16),
            S(table, table_dtype), S((4,), jnp.int32))


def test_varlen_under_jit_with_the_longest_lengths_static():
    """The boundaries are traced, the longest lengths static (as attention's): named static they
    trace; left traced, the error says they must be host ints."""
    static = jax.jit(cj.attention_varlen, static_argnames=("max_seqlen_q", "max_seqlen_k", "causal"))
    o = jax.eval_shape(lambda *a: static(*a, max_seqlen_q=200, max_seqlen_k=190, causal=True), *packed_specs())
    assert o.shape == (4, 278, 64) and o.dtype == jnp.bfloat16
    grads = jax.eval_shape(jax.grad(lambda q, k, v, cq, ck: jnp.sum(cj.attention_varlen(
        q, k, v, cq, ck, 200, 190).astype(jnp.float32)), argnums=(0, 1, 2)), *packed_specs())
    assert [g.shape for g in grads] == [(4, 278, 64), (2, 275, 64), (2, 275, 64)]
    with pytest.raises(TypeError, match="max_seqlen_q must be a host int"):
        jax.eval_shape(jax.jit(cj.attention_varlen), *packed_specs(), 200, 190)


def test_kvcache_under_jit_with_the_split_count_static():
    """Page table and lengths are traced, the split count static (as attention's)."""
    q, k, v, table, lengths = paged_specs()
    o = jax.eval_shape(jax.jit(cj.attention_with_kvcache), q, k, v, page_table=table, seqlens_k=lengths)
    assert o.shape == q.shape and o.dtype == q.dtype
    static = jax.jit(cj.attention_with_kvcache, static_argnames=("num_splits",))
    assert jax.eval_shape(static, q, k, v, page_table=table, seqlens_k=lengths, num_splits=4).shape == q.shape
    with pytest.raises(TypeError, match="num_splits must be an int or None"):
        jax.eval_shape(jax.jit(cj.attention_with_kvcache), q, k, v, page_table=table, seqlens_k=lengths,
                       num_splits=4)


@pytest.mark.parametrize("specs,error,message", (
    (packed_specs(cu_q=(5, 1)), ValueError, r"cu_seqlens_q must be a 1-D int32 array .* got shape \(5, 1\)"),
    (packed_specs(cu_dtype=jnp.int16), ValueError, r"cu_seqlens_q must be a 1-D int32 array .* dtype int16"),
    (packed_specs(cu_k=(4,)), ValueError, r"cu_seqlens_q and cu_seqlens_k must have one length"),
), ids=("two_dims", "not_int32", "lengths_differ"))
def test_bad_boundaries_fail_at_trace_time(specs, error, message):
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda *a: cj.attention_varlen(*a, 200, 190), *specs)


@pytest.mark.parametrize("specs,error,message", (
    (paged_specs(table=(40,)), ValueError,
     r"page_table must have shape \(batch, max_pages\) = \(4, >= 1\) .* got shape \(40,\), dtype int32"),
    (paged_specs(table_dtype=jnp.uint32), TypeError, r"page_table must be int32, got shape \(4, 10\), dtype uint32"),
), ids=("one_dim", "not_int32"))
def test_bad_page_table_fails_at_trace_time(specs, error, message):
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda *a: cj.attention_with_kvcache(*a[:3], page_table=a[3], seqlens_k=a[4]), *specs)


# ---- on the GPU --------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_varlen_equals_attention_and_the_reference(dtype, causal, rng):
    from cuflash import reference as ref
    from varlen_util import check_backward, check_forward, packed_inputs

    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, LENGTHS_Q, LENGTHS_K, hq=4, hk=2, d=64)
    do = rng.standard_normal(q.shape[:2] + (v.shape[-1],)).astype(np.float32)
    args = [jnp.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    entry = jax.jit(cj.attention_varlen, static_argnames=("max_seqlen_q", "max_seqlen_k", "causal"))
    o = entry(*args, max_seqlen_q=200, max_seqlen_k=190, causal=causal)
    check_forward((OnHost(o),), q, k, v, cu_q, cu_k, dtype=dtype, causal=causal)
    want = cj.attention(*args[:3], causal=causal, cu_seqlens_q=args[3], cu_seqlens_k=args[4], max_seqlen_q=200,
                     max_seqlen_k=190)
    rows = ref.covered_rows(cu_q, q.shape[1])
    np.testing.assert_array_equal(np.asarray(o)[:, rows], np.asarray(want)[:, rows])
    grads = jax.grad(lambda q, k, v: jnp.sum(cj.attention_varlen(q, k, v, *args[3:], 200, 190, causal=causal)
                                             .astype(jnp.float32) * do), argnums=(0, 1, 2))(*args[:3])
    check_backward([OnHost(g) for g in grads], do, q, k, v, cu_q, cu_k, dtype=dtype, causal=causal)


@gpu
@pytest.mark.parametrize("num_splits", (1, 3, None))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_kvcache_paged_equals_attention_and_the_reference(dtype, num_splits, rng):
    from test_decode_gpu import check

    q, k, v, lengths, cache = paged_problem(rng, dtype)  # pages (num_pages, Hk, page_size, d), row-major
    args = [jnp.asarray(x) for x in (q, *cache.host_pages, cache.table, cache.lengths)]
    step = jax.jit(cj.attention_with_kvcache, static_argnames=("num_splits", "causal"))
    o = step(*args[:3], page_table=args[3], seqlens_k=args[4], num_splits=num_splits, causal=True)
    check((OnHost(o),), q, k, v, lengths, dtype, causal=True)
    want = cj.attention(*args[:3], page_table=args[3], seqlens_k=args[4], num_splits=num_splits, causal=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(want))
