"""cuflash.jax's decoding path on the GPU against the float64 reference: dense caches with
lengths, paged caches (pages 16, 64, 256), GQA and MQA, forced and chosen split counts, under
jax.jit and jax.vmap, and the short-query routing (forward and gradients).

As in test_decode_gpu.py, caches hold NaN wherever the kernel must not read (past each length,
unused pages, rows of a last page past the length). XLA allocates the outputs and the split
workspace, so a wrapper around the bound launch's run fills them with NaN bytes on XLA's stream
right before each launch: every element the test reads was written by the kernels.
"""

import math
import os

import numpy as np
import pytest

from cuflash import _config, _decode
from cuflash import reference as ref
from gpu_util import check_forward, launched_variants, max_err, random_array
from test_decode_gpu import HEADS, POISON, PagedCache, allowed_keys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # cuflash's kernels compile through CuPy
jax = pytest.importorskip("jax")
jnp = jax.numpy
from test_jax_adapter import gpu  # noqa: E402  (after JAX's memory setting)

pytestmark = [gpu, pytest.mark.usefixtures("poisoned_outputs")]

DECODE_DTYPES = ("float16", "bfloat16")


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """NaN bytes in o, l, m and the workspace (XLA's buffers) before every decoding launch, on
    the launch's stream (XLA's)."""
    import cupy

    from cuflash import _checks, _driver

    run = _decode.DecodePlan.run

    def poisoning(self, pointers, stream):
        q, k, v, o, l, m, page_table, seqlens, workspace = pointers
        rows = math.prod(self.choice.out_shape[:-1])
        sizes = ((o, rows * self.choice.dv * _checks.itemsize(self.choice.variant.dtype)), (l, 4 * rows),
                 (m, 4 * rows), (workspace, self.workspace_bytes))
        with _driver.Context(self.ctx):
            for ptr, nbytes in sizes:
                if ptr and nbytes:
                    cupy.cuda.runtime.memsetAsync(ptr, 0xFF, nbytes, stream)
        return run(self, pointers, stream)

    monkeypatch.setattr(_decode.DecodePlan, "run", poisoning)


class _OnHost:
    """A JAX array where gpu_util.check_forward expects a CuPy one (``.get()``)."""

    def __init__(self, x):
        self.x = x

    def get(self):
        return np.asarray(self.x)


def decode_olm(q, k, v, page_table=None, seqlens_k=None, *, causal=False, window=None, scale=None,
               num_splits=None):
    """o, l, m of the adapter's decoding call under jax.jit (the public call returns o)."""
    import cuflash.jax as cj

    options = (causal, scale, window, num_splits)
    return jax.jit(lambda *a: cj._decode_outputs(*a, options))(q, k, v, page_table, seqlens_k)


def public(q, k, v, page_table=None, seqlens_k=None, **kwargs):
    import cuflash.jax as cj

    return jax.jit(lambda *a: cj.attention(*a[:3], page_table=a[3], seqlens_k=a[4], **kwargs))(
        q, k, v, page_table, seqlens_k)


def check(olm, q, k, v, lengths, dtype, *, causal=False, window=None, scale=None):
    allowed = allowed_keys(lengths, q.shape[-2], k.shape[-2], causal=causal, window=window)
    return check_forward(tuple(_OnHost(x) for x in olm), q, k, v, causal=False, scale=scale, dtype=dtype,
                         mask=allowed)


def nan_past(cache, lengths):
    """A host copy of dense (batch, Hk, Nk, d) ``cache`` with NaN from each length on."""
    poisoned = cache.copy()
    for b, n in enumerate(lengths):
        poisoned.view(np.uint16)[b, :, max(0, n):] = POISON
    return poisoned


def inputs(rng, dtype, batch, heads, nq, capacity, d):
    hq, hk = HEADS[heads]
    return (random_array(rng, (batch, hq, nq, d), dtype), random_array(rng, (batch, hk, capacity, d), dtype),
            random_array(rng, (batch, hk, capacity, d), dtype))


# ---- dense caches ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", (1, 3, None))
@pytest.mark.parametrize("nq", (1, 3, 16))
@pytest.mark.parametrize("heads", ("gqa", "mqa"))
@pytest.mark.parametrize("dtype", DECODE_DTYPES)
def test_dense_with_lengths(dtype, heads, nq, num_splits, rng):
    lengths = np.array([0, 1, 17, 1000, 777], np.int32)  # 0: o = 0, l = 0, m = -inf
    q, k, v = inputs(rng, dtype, len(lengths), heads, nq, 1000, 128)
    args = (q, nan_past(k, lengths), nan_past(v, lengths), None, lengths)
    olm = decode_olm(*args, num_splits=num_splits)
    check(olm, q, k, v, lengths, dtype)
    assert np.array_equal(np.asarray(public(*args, num_splits=num_splits)), np.asarray(olm[0]))


@pytest.mark.parametrize("num_splits", (1, 4))
def test_dense_without_lengths_reads_the_whole_cache(num_splits, rng):
    """num_splits alone selects the decoding path: every one of Nk keys."""
    dtype = "bfloat16"
    q, k, v = inputs(rng, dtype, 3, "gqa", 1, 4099, 64)
    check(decode_olm(q, k, v, num_splits=num_splits), q, k, v, [4099] * 3, dtype)


# ---- paged caches ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", (1, 4, None))
@pytest.mark.parametrize("page_size", (16, 64, 256))
@pytest.mark.parametrize("heads,nq,d", (("gqa", 1, 128), ("mqa", 3, 64), ("gqa", 16, 128)))
@pytest.mark.parametrize("dtype", DECODE_DTYPES)
def test_paged(dtype, heads, nq, d, page_size, num_splits, rng):
    capacity = 4 * 256
    lengths = [0, 1, 17, 3 * page_size + 5, capacity, 113]
    q, k, v = inputs(rng, dtype, len(lengths), heads, nq, capacity, d)
    cache = PagedCache(rng, k, v, lengths, page_size)  # (num_pages, Hk, page_size, d), row-major
    olm = decode_olm(q, *cache.host_pages, cache.table, cache.lengths, num_splits=num_splits)
    check(olm, q, k, v, lengths, dtype)


@pytest.mark.parametrize("causal,window", ((True, None), (False, (9, 0)), (True, (40, 2)), (False, (-1, 2))), ids=str)
def test_paged_causal_and_window(causal, window, rng):
    dtype = "float16"
    lengths = [2, 100, 513, 0, 1024]
    q, k, v = inputs(rng, dtype, len(lengths), "gqa", 3, 1024, 128)
    cache = PagedCache(rng, k, v, lengths, 64)
    for num_splits in (1, 3, None):
        olm = decode_olm(q, *cache.host_pages, cache.table, cache.lengths, causal=causal, window=window,
                         num_splits=num_splits)
        check(olm, q, k, v, lengths, dtype, causal=causal, window=window)


# ---- one trace, many steps; vmap; inputs left alone ---------------------------------------------


def test_one_trace_serves_every_length(rng):
    """A jitted decode step traced once: new lengths and page tables are data, read by the
    kernels from device memory."""
    import cuflash.jax as cj

    dtype = "bfloat16"
    q, k, v = inputs(rng, dtype, 4, "gqa", 1, 1024, 128)
    traces = []

    @jax.jit
    def step(q, k_cache, v_cache, table, lengths):
        traces.append(1)
        return cj.attention(q, k_cache, v_cache, page_table=table, seqlens_k=lengths)

    for lengths in ([1, 1024, 0, 300], [1000, 17, 64, 65], [5, 5, 5, 1024]):
        cache = PagedCache(rng, k, v, lengths, 64, spare_pages=64 - sum(-(-n // 64) for n in lengths))
        o = step(q, *cache.host_pages, cache.table, cache.lengths)
        exact = ref.standard_attention(q, k, v, mask=allowed_keys(lengths, 1, 1024))
        lowp = ref.lowp_attention(q, k, v, dtype=dtype, mask=allowed_keys(lengths, 1, 1024))
        got = np.asarray(o).astype(np.float64)
        assert max_err(got, exact.o) <= 2 * max_err(lowp.o, exact.o) + 1e-6
    assert len(traces) == 1


def test_vmap_runs_each_example(rng):
    """vmap over q, the table and the lengths with one shared cache: example by example."""
    dtype = "float16"
    lengths = np.array([[3, 300], [0, 250], [299, 1]], np.int32)
    q = random_array(rng, (3, 2, 8, 2, 64), dtype)
    k, v = (random_array(rng, (2, 2, 300, 64), dtype) for _ in range(2))
    import cuflash.jax as cj

    o = jax.jit(jax.vmap(lambda q, n: cj.attention(q, k, v, seqlens_k=n, num_splits=3)))(q, lengths)
    for i in range(3):
        single = public(q[i], k, v, None, lengths[i], num_splits=3)
        assert np.array_equal(np.asarray(o[i]), np.asarray(single))
        check(decode_olm(q[i], k, v, None, lengths[i], num_splits=3), q[i], k, v, lengths[i], dtype)


def test_inputs_are_not_written(rng):
    dtype = "bfloat16"
    lengths = [700, 3]
    q, k, v = inputs(rng, dtype, 2, "mqa", 4, 768, 128)
    cache = PagedCache(rng, k, v, lengths, 256)
    args = [jnp.asarray(x) for x in (q, *cache.host_pages, cache.table, cache.lengths)]
    before = [np.asarray(x).copy() for x in args]
    decode_olm(*args, num_splits=5)[0].block_until_ready()
    for x, b in zip(args, before):
        assert np.array_equal(np.asarray(x).view(np.uint8), b.view(np.uint8))


# ---- short queries routed to the split-KV kernels ------------------------------------------------


@pytest.mark.parametrize("nk,expected", ((700, "decode"), (32, "fwd")))
def test_short_queries_are_routed_and_differentiable(nk, expected, rng):
    import cuflash.jax as cj

    assert (nk >= _config.DECODE_MIN_KEYS) == (expected == "decode")
    dtype = "bfloat16"
    q, k, v = (random_array(rng, s, dtype) for s in ((2, 8, 3, 128), (2, 2, nk, 128), (2, 2, nk, 128)))
    w = random_array(rng, q.shape, dtype)
    with launched_variants() as launched:
        o = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=True))(q, k, v).block_until_ready()
    assert launched and launched[0].key.startswith(expected + "_"), [x.key for x in launched]
    exact = ref.standard_attention(q, k, v, causal=True)
    lowp = ref.lowp_attention(q, k, v, dtype=dtype, causal=True)
    assert max_err(np.asarray(o).astype(np.float64), exact.o) <= 2 * max_err(lowp.o, exact.o) + 1e-6

    def loss(q, k, v):
        return jnp.sum(cj.attention(q, k, v, causal=True).astype(jnp.float32) * jnp.asarray(w).astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    exact = ref.standard_attention_backward(w, q, k, v, causal=True)
    lowp = ref.lowp_attention_backward(w, q, k, v, dtype=dtype, causal=True)
    for name, g, e, p in zip("qkv", grads, exact, lowp):
        err, bound = max_err(np.asarray(g).astype(np.float64), e), 3 * max_err(p, e) + 1e-6
        assert err <= bound, f"d{name}: {err:.3g} > {bound:.3g}"


def test_routed_call_under_vmap(rng):
    """vmapped over every operand: one split-KV launch of the batched shapes; over q alone
    (k and v broadcast): the forward. Both as the unbatched calls give."""
    import cuflash.jax as cj

    dtype = "float16"
    q = random_array(rng, (3, 2, 8, 1, 64), dtype)
    k, v = (random_array(rng, (3, 2, 2, 1111, 64), dtype) for _ in range(2))
    attend = lambda q, k, v: cj.attention(q, k, v)  # noqa: E731
    for in_axes, expected in ((0, "decode"), ((0, None, None), "fwd")):
        kb, vb = (k, v) if in_axes == 0 else (k[0], v[0])
        with launched_variants() as launched:
            o = jax.jit(jax.vmap(attend, in_axes=in_axes))(q, kb, vb).block_until_ready()
        assert launched[0].key.startswith(expected + "_"), [x.key for x in launched]
        for i in range(3):
            ki, vi = (kb[i], vb[i]) if in_axes == 0 else (kb, vb)
            exact = ref.standard_attention(q[i], ki, vi)
            lowp = ref.lowp_attention(q[i], ki, vi, dtype=dtype)
            assert max_err(np.asarray(o[i]).astype(np.float64), exact.o) <= 2 * max_err(lowp.o, exact.o) + 1e-6
