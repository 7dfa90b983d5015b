"""cuflash.jax on packed variable-length batches: trace-time checks and shapes (JAX alone), and
the forward and gradients against the float64 reference, eagerly and under jax.jit (GPU + JAX)."""

import os

import numpy as np
import pytest

from conftest import jax_has_gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # cuflash allocates through CuPy
jax = pytest.importorskip("jax")
jnp = jax.numpy

LENGTHS_Q = (1, 77, 0, 200)  # an empty sequence, one of length 1, one past a tile
LENGTHS_K = (5, 77, 3, 190)


gpu = pytest.mark.skipif(not jax_has_gpu(jax), reason="needs JAX with a CUDA GPU")


def _abstract(hq=4, hk=2, total_q=283, total_k=275, d=64, batch=4, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((hq, total_q, d), dtype)
    k = jax.ShapeDtypeStruct((hk, total_k, d), dtype)
    v = jax.ShapeDtypeStruct((hk, total_k, d), dtype)
    cu = jax.ShapeDtypeStruct((batch + 1,), jnp.int32)
    return q, k, v, cu, cu


def test_shapes_of_the_forward_and_the_gradients():
    import cuflash.jax as cj

    def loss(q, k, v, cu_q, cu_k):
        o = cj.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200,
                         max_seqlen_k=190)
        return jnp.sum(o.astype(jnp.float32))

    args = _abstract()
    o = jax.eval_shape(lambda *a: cj.attention(*a[:3], cu_seqlens_q=a[3], cu_seqlens_k=a[4], max_seqlen_q=200,
                                               max_seqlen_k=190), *args)
    assert o.shape == (4, 283, 64) and o.dtype == jnp.bfloat16
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), *args)
    assert [g.shape for g in grads] == [(4, 283, 64), (2, 275, 64), (2, 275, 64)]


def test_traced_boundaries_need_the_longest_lengths():
    import cuflash.jax as cj

    call = jax.jit(lambda q, k, v, cu_q, cu_k: cj.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                             max_seqlen_k=190))
    with pytest.raises(ValueError, match="max_seqlen_q must be given"):
        jax.eval_shape(call, *_abstract())


@pytest.mark.parametrize("cu_q,cu_k,match", (
    (((5,), jnp.float32), ((5,), jnp.int32), "cu_seqlens_q must be a 1-D int32 array"),
    (((5, 1), jnp.int32), ((5,), jnp.int32), "cu_seqlens_q must be a 1-D int32 array"),
    (((5,), jnp.int32), ((4,), jnp.int32), "cu_seqlens_q and cu_seqlens_k"),
))
def test_bad_boundaries_fail_at_trace_time(cu_q, cu_k, match):
    import cuflash.jax as cj

    q, k, v, _, _ = _abstract()
    boundaries = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (cu_q, cu_k)]
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: cj.attention(*a[:3], cu_seqlens_q=a[3], cu_seqlens_k=a[4], max_seqlen_q=1,
                                               max_seqlen_k=1), q, k, v, *boundaries)


def test_four_dim_q_is_refused():
    import cuflash.jax as cj

    q, k, v, cu, _ = _abstract()
    q4 = jax.ShapeDtypeStruct((1,) + q.shape, q.dtype)
    with pytest.raises(ValueError, match="with cu_seqlens, q must have shape"):
        jax.eval_shape(lambda *a: cj.attention(*a[:3], cu_seqlens_q=a[3], cu_seqlens_k=a[4], max_seqlen_q=1,
                                               max_seqlen_k=1), q4, k, v, cu, cu)


def test_block_mask_is_refused_with_boundaries():
    import cuflash
    import cuflash.jax as cj

    q, k, v, cu, _ = _abstract()
    with pytest.raises(ValueError, match="block_mask cannot be combined with cu_seqlens"):
        cj.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1, max_seqlen_k=1,
                     block_mask=cuflash.masks.butterfly(2))


class _Host:
    """A JAX array with CuPy's .get(), for the varlen error rule's to_host64."""

    def __init__(self, x):
        self.x = x

    def get(self):
        return np.asarray(self.x.astype(jnp.float32))


@gpu
@pytest.mark.parametrize("jit", (False, True), ids=("eager", "jit"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype,hq,hk,d", (("bfloat16", 4, 2, 64), ("float16", 6, 6, 128), ("float32", 4, 1, 64)))
def test_forward_and_gradients_against_the_reference(dtype, hq, hk, d, causal, jit, rng):
    import cuflash.jax as cj
    from varlen_util import check_backward, check_forward, packed_inputs

    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, LENGTHS_Q, LENGTHS_K, hq=hq, hk=hk, d=d)
    do = rng.standard_normal(q.shape[:2] + (v.shape[-1],)).astype(np.float32)
    lengths = dict(max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K)) if jit else {}

    def f(q, k, v, cq, ck):
        return cj.attention(q, k, v, causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck, **lengths)

    def loss(q, k, v, cq, ck):
        return jnp.sum(f(q, k, v, cq, ck).astype(jnp.float32) * do)

    if jit:
        f, loss = jax.jit(f), jax.jit(loss)
    args = [jnp.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    o = f(*args)
    check_forward((_Host(o),), q, k, v, cu_q, cu_k, dtype=dtype, causal=causal)
    grads = jax.grad(loss, argnums=(0, 1, 2))(*args)
    check_backward([_Host(g) for g in grads], do, q, k, v, cu_q, cu_k, dtype=dtype, causal=causal)


@gpu
def test_deterministic_gradients_repeat_bit_for_bit(rng):
    import cuflash.jax as cj
    from varlen_util import packed_inputs

    q, k, v, cu_q, cu_k = (jnp.asarray(x) for x in packed_inputs(rng, "bfloat16", LENGTHS_Q, LENGTHS_K))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(cj.attention(
        q, k, v, causal=True, deterministic=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200,
        max_seqlen_k=190).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    first, second = grad(q, k, v), grad(q, k, v)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
