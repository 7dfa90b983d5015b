"""cuflash.jax: eager, jit, grad and vmap against a float64 NumPy reference (GPU + JAX), and
trace-time checks and shapes (JAX alone).

Error bounds: the forward within 2x, gradients within 3x, of what plain jnp attention in the
same dtype gets wrong against the float64 reference.
"""

import functools
import os

import numpy as np
import pytest

from conftest import jax_has_gpu
from cuflash import reference as ref
from gpu_util import DTYPES, max_err, random_array

# cuflash allocates through CuPy, outside XLA's pool: keep XLA from reserving 75% of the GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy


gpu = pytest.mark.skipif(not jax_has_gpu(jax), reason="needs JAX with a CUDA GPU")

# (name, lead_q, lead_kv, Nq, Nk, d, dv, causal)
CASES = (
    ("plain", (2, 4), (2, 4), 128, 128, 64, 64, False),
    ("causal_rect", (2, 3), (2, 3), 100, 230, 128, 128, True),
    ("gqa", (2, 6), (2, 2), 77, 200, 64, 32, False),
    ("gqa_causal", (1, 8), (1, 2), 130, 130, 64, 64, True),
    ("broadcast_causal_tall", (3, 2), (2,), 150, 60, 32, 32, True),  # rows with no key
)
CASE_IDS = [c[0] for c in CASES]


def host_inputs(rng, case, dtype):
    _, lq, lkv, nq, nk, d, dv, causal = case
    q = random_array(rng, lq + (nq, d), dtype)
    k = random_array(rng, lkv + (nk, d), dtype)
    v = random_array(rng, lkv + (nk, dv), dtype)
    w = random_array(rng, ref.broadcast_plan(q.shape, k.shape, v.shape).batch_shape + (nq, dv), dtype)
    return q, k, v, w, causal


def jnp_attention(q, k, v, causal, scale=None):
    """Plain attention in the inputs' dtype, as a JAX user would write it."""
    if k.ndim >= 3 and q.ndim >= 3 and k.shape[-3] not in (1, q.shape[-3]):
        group = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, group, axis=-3), jnp.repeat(v, group, axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ jnp.swapaxes(k, -1, -2)) * jnp.asarray(scale, q.dtype)
    nq, nk = s.shape[-2:]
    if causal:
        allowed = jnp.tril(jnp.ones((nq, nk), bool), nk - nq)
        s = jnp.where(allowed, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(allowed.any(-1, keepdims=True), p, 0)  # empty rows: 0, not NaN
    else:
        p = jax.nn.softmax(s, axis=-1)
    return p @ v


def cuflash_attention(q, k, v, causal, scale=None, deterministic=False, **sparsity):
    import cuflash.jax

    return cuflash.jax.attention(q, k, v, causal=causal, scale=scale, deterministic=deterministic, **sparsity)


def loss_of(attend, w, causal):
    w = jnp.asarray(w)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, causal).astype(jnp.float32) * w.astype(jnp.float32))

    return loss


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward(case, dtype, rng):
    q, k, v, _, causal = host_inputs(rng, case, dtype)
    o = cuflash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal)
    exact = ref.standard_attention(q, k, v, causal=causal)
    assert o.shape == exact.o.shape and o.dtype == q.dtype
    got = np.asarray(o).astype(np.float64)
    assert not np.isnan(got).any()
    err = max_err(got, exact.o)
    plain = np.asarray(jnp_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal)).astype(np.float64)
    # Also the NumPy model of plain attention in dtype: XLA's f32 dots may use TF32, but not
    # every GPU does, and the bound must not depend on it.
    lowp = ref.lowp_attention(q, k, v, dtype=dtype, causal=causal).o
    bound = 2 * max(max_err(plain, exact.o), max_err(lowp, exact.o)) + 1e-6
    assert err <= bound, f"max |o - ref| {err:.3g} > {bound:.3g}"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_eager_and_jit(case, dtype, rng):
    q, k, v, w, causal = host_inputs(rng, case, dtype)
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    exact = ref.standard_attention_backward(w, q, k, v, causal=causal)
    plain = jax.grad(loss_of(jnp_attention, w, causal), argnums=(0, 1, 2))(*args)
    grad = jax.grad(loss_of(cuflash_attention, w, causal), argnums=(0, 1, 2))
    for mode, got in (("eager", grad(*args)), ("jit", jax.jit(grad)(*args))):
        for name, g, e, p in zip("qkv", got, exact, plain):
            assert g.shape == e.shape and g.dtype == q.dtype, (mode, name)
            g, p = np.asarray(g).astype(np.float64), np.asarray(p).astype(np.float64)
            err, baseline = max_err(g, e), max_err(p, e)
            bound = 3 * baseline + 1e-6
            assert err <= bound, f"{mode} d{name}: max err {err:.3g} > 3 x jnp's {baseline:.3g}"


@gpu
def test_jit_with_surrounding_ops(rng):
    """Inside one compiled program with other work before and after, results unchanged."""
    q, k, v, w, causal = host_inputs(rng, CASES[3], "bfloat16")
    q, k, v = (jnp.asarray(x) for x in (q, k, v))

    @jax.jit
    def f(q, k, v):
        q2 = q * 2  # produced by XLA right before the callback reads it
        return cuflash_attention(q2, k, v, causal, scale=0.5 / np.sqrt(q.shape[-1])) + 1

    expected = cuflash_attention(q * 2, k, v, causal, scale=0.5 / np.sqrt(q.shape[-1])) + 1
    assert np.array_equal(np.asarray(f(q, k, v)), np.asarray(expected))


@gpu
def test_vmap(rng):
    """vmap over q alone: same as one call with the extra leading dim; grads per example."""
    q, k, v, _, causal = host_inputs(rng, CASES[2], "float16")
    qb = jnp.asarray(random_array(rng, (3,) + q.shape, "float16"))
    k, v = jnp.asarray(k), jnp.asarray(v)
    attend = lambda q, k: cuflash_attention(q, k, v, causal)  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.vmap(attend, in_axes=(0, None))(qb, k), np.float32),
                               np.asarray(attend(qb, k), np.float32), rtol=1e-3, atol=1e-3)

    loss = lambda q, k: jnp.sum(attend(q, k).astype(jnp.float32) ** 2)  # noqa: E731
    dq, dk = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(qb, k)
    assert dq.shape == qb.shape and dk.shape == (3,) + k.shape
    for i in range(3):
        eq, ek = jax.grad(loss, argnums=(0, 1))(qb[i], k)
        for got, expected in ((dq[i], eq), (dk[i], ek)):
            got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
            np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


@gpu
def test_deterministic_gradients(rng):
    q, k, v, w, causal = host_inputs(rng, CASES[2], "bfloat16")
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    attend = functools.partial(cuflash_attention, deterministic=True)
    grad = jax.jit(jax.grad(loss_of(attend, w, causal), argnums=(0, 1, 2)))
    first = [np.asarray(g) for g in grad(*args)]
    for _ in range(2):
        for a, b in zip(first, grad(*args)):
            assert np.array_equal(a, np.asarray(b))


def test_bad_arguments_fail_at_trace_time():
    q = jnp.zeros((2, 16, 64), jnp.float16)
    with pytest.raises(TypeError, match="share one dtype"):
        cuflash_attention(q, q.astype(jnp.float32), q, False)
    with pytest.raises(ValueError, match="multiple of 8"):
        cuflash_attention(q, q, q[..., :12], False)
    with pytest.raises(ValueError, match="scale"):
        cuflash_attention(q, q, q, False, scale=-1.0)


# ---- block masks and windows -----------------------------------------------------------------


def sparse_inputs(rng, dtype, nq=300, nk=200, bs=(64, 32)):
    """Grouped heads (4 on 2) with a per-head random block mask; head 1 sees nothing."""
    from cuflash import masks

    blocks = np.random.default_rng(1).random((4, -(-nq // bs[0]), -(-nk // bs[1]))) < 0.4
    blocks[1] = False
    q = random_array(rng, (2, 4, nq, 64), dtype)
    k = random_array(rng, (2, 2, nk, 64), dtype)
    v = random_array(rng, (2, 2, nk, 32), dtype)
    w = random_array(rng, (2, 4, nq, 32), dtype)
    return q, k, v, w, masks.BlockMask.from_dense(blocks, bs)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", ((False, None), (True, (50, 0)), (False, (-1, 20))))
def test_block_mask_forward_and_gradients(dtype, causal, window, rng):
    q, k, v, w, mask = sparse_inputs(rng, dtype)
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    element = ref.element_mask(q.shape[-2], k.shape[-2], block_mask=mask, window=window)

    def attend(q, k, v, causal):
        return cuflash_attention(q, k, v, causal, block_mask=mask, window=window)

    o = np.asarray(jax.jit(lambda *a: attend(*a, causal))(*args)).astype(np.float64)
    exact = ref.standard_attention(q, k, v, causal=causal, mask=element)
    lowp = ref.lowp_attention(q, k, v, dtype=dtype, causal=causal, mask=element)
    assert max_err(o, exact.o) <= 2 * max_err(lowp.o, exact.o) + 1e-6
    assert (o[:, 1] == 0).all()
    grads = jax.jit(jax.grad(loss_of(attend, w, causal), argnums=(0, 1, 2)))(*args)
    exact = ref.standard_attention_backward(w, q, k, v, causal=causal, mask=element)
    lowp = ref.lowp_attention_backward(w, q, k, v, dtype=dtype, causal=causal, mask=element)
    for name, g, e, p in zip("qkv", grads, exact, lowp):
        err, bound = max_err(np.asarray(g).astype(np.float64), e), 3 * max_err(p, e) + 1e-6
        assert err <= bound, f"d{name}: {err:.3g} > {bound:.3g}"


def test_block_mask_shapes_without_a_gpu():
    """Shape inference and differentiation trace with a mask and a window (no kernel runs)."""
    q, k, v, _, mask = sparse_inputs(np.random.default_rng(0), "bfloat16")

    def loss(q, k, v):
        return cuflash_attention(q, k, v, True, block_mask=mask, window=(5, 0)).astype(jnp.float32).sum()

    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    assert jax.eval_shape(loss, *specs).shape == ()
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), *specs)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    # A boolean array is converted once: equal arrays are one BlockMask, hence one trace.
    import cuflash

    blocks = mask.to_dense()
    assert cuflash._checks.as_block_mask(blocks, (64, 32)) is cuflash._checks.as_block_mask(blocks.copy(), (64, 32))
    out = jax.eval_shape(lambda q, k, v: cuflash_attention(q, k, v, False, block_mask=blocks, block_size=(64, 32)), *specs)
    assert out.shape == (2, 4, 300, 32)


def test_bad_block_mask_fails_at_trace_time():
    from cuflash import masks

    q = jax.ShapeDtypeStruct((2, 4, 100, 64), jnp.float16)
    with pytest.raises(ValueError, match=r"Nq=100 needs ceil\(100/32\) = 4 query blocks, the mask has Tq=3"):
        jax.eval_shape(lambda q: cuflash_attention(q, q, q, False, block_mask=masks.dense(3, block_size=32)), q)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 4\)"):
        bm = masks.BlockMask.from_dense(np.ones((3, 4, 4), bool), 32)
        jax.eval_shape(lambda q: cuflash_attention(q, q, q, False, block_mask=bm), q)
    with pytest.raises(ValueError, match="window right"):
        jax.eval_shape(lambda q: cuflash_attention(q, q, q, False, window=(1, -5)), q)
    with pytest.raises(ValueError, match="differs from the block size"):
        cuflash_attention(q, q, q, False, block_mask=masks.dense(4, block_size=32), block_size=16)
