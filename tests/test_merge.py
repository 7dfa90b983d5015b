"""cuflash.merge / merge_stacked: attention over disjoint key sets, combined exactly.

The oracle is the float64 reference over all keys; the parts are the reference (CPU) or
cuflash.attention (GPU) over random subsets of the keys. GPU tests skip without a GPU.
"""

import numpy as np
import pytest

import cuflash
from conftest import requires_gpu
from cuflash import reference as ref
from gpu_util import DTYPES, check_forward, random_array, to_device

# (batch lead dims, Nq, Nk, d, dv): odd lengths, one key, one query, grouped heads
SHAPES = (
    ((2, 3), 17, 113, 16, 16),
    ((1, 4), 1, 1, 8, 24),
    ((3,), 64, 2, 32, 8),
    ((2, 1), 5, 130, 8, 8),
)


@pytest.fixture(autouse=True)
def no_float_warnings():
    """A NaN, an overflow or a division by zero anywhere in a merge fails the test."""
    with np.errstate(divide="raise", over="raise", invalid="raise", under="ignore"):
        yield


def random_problem(rng, lead, nq, nk, d, dv, spread=1.0):
    q = rng.standard_normal(lead + (nq, d)) * spread
    k = rng.standard_normal(lead + (nk, d)) * spread
    v = rng.standard_normal(lead + (nk, dv))
    return q, k, v


def part_results(q, k, v, owner, parts, *, causal):
    """The reference over each part's keys (owner[j] = part of key j), with the causal mask
    of the whole problem restricted to them; some parts or rows may get no key at all."""
    allowed = ref.allowed_keys(q.shape[-2], k.shape[-2], causal=causal)
    results = []
    for p in range(parts):
        keys = np.flatnonzero(owner == p)
        results.append(ref.standard_attention(q, k[..., keys, :], v[..., keys, :], mask=allowed[:, keys]))
    return results


def assert_same_attention(got, want, rtol=1e-12, atol=1e-13):
    for name, g, w in zip("olm", got, want):
        assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
        assert not np.isnan(g).any(), f"NaN in {name}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)


# ---- NumPy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("lead,nq,nk,d,dv", SHAPES)
def test_two_parts_give_the_whole(lead, nq, nk, d, dv, causal, rng):
    q, k, v = random_problem(rng, lead, nq, nk, d, dv)
    for _ in range(3):  # fresh random splits, one side possibly empty
        owner = rng.integers(0, 2, nk)
        a, b = part_results(q, k, v, owner, 2, causal=causal)
        merged = cuflash.merge(*a, *b)
        assert all(x.dtype == np.float64 for x in merged)
        assert_same_attention(merged, ref.standard_attention(q, k, v, causal=causal))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("lead,nq,nk,d,dv", SHAPES)
def test_stacked_parts_give_the_whole(lead, nq, nk, d, dv, causal, rng):
    q, k, v = random_problem(rng, lead, nq, nk, d, dv)
    parts = int(rng.integers(3, 8))
    owner = rng.integers(0, parts, nk)
    stacked = [np.stack(x) for x in zip(*part_results(q, k, v, owner, parts, causal=causal))]
    assert_same_attention(cuflash.merge_stacked(*stacked), ref.standard_attention(q, k, v, causal=causal))


def test_scores_far_apart_neither_overflow_nor_lose_the_larger_part(rng):
    """Maxima 1e3 apart: the smaller part's weight underflows to 0, exactly as in the whole."""
    q, k, v = random_problem(rng, (2,), 9, 40, 8, 8, spread=6.0)
    owner = np.arange(40) % 2
    a, b = part_results(q, k, v, owner, 2, causal=False)
    assert np.ptp(np.stack([a.m, b.m])) > 10
    assert_same_attention(cuflash.merge(*a, *b), ref.standard_attention(q, k, v))


def test_empty_parts_give_zero_never_nan(rng):
    shape = (3, 7)
    o = rng.standard_normal(shape + (8,))
    l = rng.uniform(0.5, 4.0, shape)
    m = rng.standard_normal(shape)
    empty_o, empty_l, empty_m = np.zeros_like(o), np.zeros(shape), np.full(shape, -np.inf)

    both = cuflash.merge(empty_o, empty_l, empty_m, empty_o, empty_l, empty_m)
    np.testing.assert_array_equal(both.o, 0.0)
    np.testing.assert_array_equal(both.l, 0.0)
    np.testing.assert_array_equal(both.m, -np.inf)
    for merged in (cuflash.merge(o, l, m, empty_o, empty_l, empty_m),
                   cuflash.merge(empty_o, empty_l, empty_m, o, l, m)):
        assert_same_attention(merged, (o, l, m), rtol=1e-15, atol=0)

    stacked = cuflash.merge_stacked(np.stack([empty_o, o, empty_o]), np.stack([empty_l, l, empty_l]),
                                    np.stack([empty_m, m, empty_m]))
    assert_same_attention(stacked, (o, l, m), rtol=1e-15, atol=0)
    none = cuflash.merge_stacked(np.zeros((0,) + o.shape), np.zeros((0,) + shape), np.zeros((0,) + shape))
    assert_same_attention(none, (empty_o, empty_l, empty_m), rtol=0, atol=0)


@pytest.mark.parametrize("o_dtype", ("float16", "bfloat16", "float32"))
def test_low_precision_parts_merge_in_float32(o_dtype, rng):
    """o keeps its dtype, l and m come back float32, the merge itself is float32."""
    from gpu_util import np_dtype

    q, k, v = random_problem(rng, (2, 2), 33, 70, 16, 16)
    a, b = part_results(q, k, v, rng.integers(0, 2, 70), 2, causal=True)
    rounded = [(x.o.astype(np_dtype(o_dtype)), x.l.astype(np.float32), x.m.astype(np.float32)) for x in (a, b)]
    o, l, m = cuflash.merge(*rounded[0], *rounded[1])
    assert (o.dtype, l.dtype, m.dtype) == (np_dtype(o_dtype), np.float32, np.float32)
    whole = ref.standard_attention(q, k, v, causal=True)
    # o: the parts' rounding to o_dtype plus one more; l, m: float32 arithmetic
    o_tol = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6}[o_dtype]
    np.testing.assert_allclose(o.astype(np.float64), whole.o, rtol=0, atol=o_tol * np.abs(whole.o).max())
    np.testing.assert_allclose(l, whole.l, rtol=1e-6)
    np.testing.assert_allclose(m, whole.m, rtol=1e-6, atol=1e-7)


def test_bad_arguments_are_named_with_their_shapes_and_dtypes():
    o, l = np.zeros((2, 5, 8), np.float32), np.ones((2, 5), np.float32)
    with pytest.raises(ValueError, match=r"l_b must have shape \(2, 5\).*l_b \(2, 4\)"):
        cuflash.merge(o, l, l, o, np.ones((2, 4), np.float32), l)
    with pytest.raises(ValueError, match=r"o_b must have shape \(2, 5, 8\).*o_b \(2, 5, 16\)"):
        cuflash.merge(o, l, l, np.zeros((2, 5, 16), np.float32), l, l)
    with pytest.raises(ValueError, match=r"o_a must have shape \(2, 5, 'dv'\)"):
        cuflash.merge(np.zeros((), np.float32), l, l, o, l, l)
    with pytest.raises(TypeError, match="o_a, o_b must share one dtype.*o_a float32, o_b float16"):
        cuflash.merge(o, l, l, o.astype(np.float16), l, l)
    with pytest.raises(TypeError, match="l_a, m_a, l_b, m_b must share one dtype.*m_b int64"):
        cuflash.merge(o, l, l, o, l, np.ones((2, 5), np.int64))
    with pytest.raises(TypeError, match="NumPy, CuPy, torch or JAX arrays, got builtins.list"):
        cuflash.merge(o, l, l, o, l, [[1.0] * 5] * 2)
    with pytest.raises(ValueError, match=r"m must have shape \(3, 2, 5\).*m \(2, 2, 5\)"):
        cuflash.merge_stacked(np.stack([o] * 3), np.stack([l] * 3), np.stack([l] * 2))
    with pytest.raises(ValueError, match=r"parts along axis 0, got \(\)"):
        cuflash.merge_stacked(o, np.float32(1.0), np.float32(0.0))


# ---- torch (CPU) -----------------------------------------------------------------------------


def torch_attention(q, k, v, allowed):
    """Plain differentiable attention with cuflash's (o, l, m); every row has a key."""
    import torch

    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = torch.where(torch.as_tensor(allowed), s, -torch.inf)
    m = torch.amax(s, dim=-1)
    p = torch.exp(s - m[..., None])
    l = p.sum(-1)
    return (p @ v) / l[..., None], l, m


def test_torch_merge_matches_numpy_and_keeps_dtypes(rng):
    torch = pytest.importorskip("torch")
    q, k, v = random_problem(rng, (2, 3), 19, 50, 8, 8)
    a, b = part_results(q, k, v, rng.integers(0, 2, 50), 2, causal=True)
    want = cuflash.merge(*a, *b)
    tensors = [torch.from_numpy(x) for x in (*a, *b)]
    got = cuflash.merge(*tensors)
    assert all(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in got)
    assert_same_attention([x.numpy() for x in got], want)

    low = [x.to(torch.bfloat16 if i % 3 == 0 else torch.float32) for i, x in enumerate(tensors)]
    o, l, m = cuflash.merge(*low)
    assert (o.dtype, l.dtype, m.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    stacked = cuflash.merge_stacked(torch.stack(low[0::3]), torch.stack(low[1::3]), torch.stack(low[2::3]))
    for x, y in zip(stacked, (o, l, m)):
        torch.testing.assert_close(x, y)


def test_torch_gradients_through_the_merge_equal_the_direct_ones(rng):
    """o and the log-sum-exp m + log l of the merged parts, differentiated back to q, k, v."""
    torch = pytest.importorskip("torch")
    nq, nk = 13, 41
    q, k, v = (torch.tensor(x, requires_grad=True) for x in random_problem(rng, (2, 2), nq, nk, 8, 8))
    allowed = np.ones((nq, nk), bool)
    owner = np.arange(nk) % 3 == 0
    w = torch.tensor(rng.standard_normal((2, 2, nq, 8)))

    def loss(o, l, m):
        return (o * w).sum() + (m + torch.log(l)).sum()

    direct = torch.autograd.grad(loss(*torch_attention(q, k, v, allowed)), (q, k, v))
    a, b = (torch_attention(q, k[..., keys, :], v[..., keys, :], allowed[:, keys])
            for keys in (np.flatnonzero(owner), np.flatnonzero(~owner)))
    merged = torch.autograd.grad(loss(*cuflash.merge(*a, *b)), (q, k, v))
    for name, g, want in zip(("dq", "dk", "dv"), merged, direct):
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12, msg=name)


def test_torch_gradients_stay_finite_across_empty_parts(rng):
    torch = pytest.importorskip("torch")
    shape = (2, 6)
    o_a = torch.tensor(rng.standard_normal(shape + (4,)), requires_grad=True)
    l_a = torch.tensor(rng.uniform(1.0, 3.0, shape), requires_grad=True)
    m_a = torch.tensor(rng.standard_normal(shape), requires_grad=True)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    empty = [torch.zeros(shape + (4,), **f64), torch.zeros(shape, **f64), torch.full(shape, -torch.inf, **f64)]
    for parts in ((o_a, l_a, m_a, *empty), (*empty, *empty)):
        o, l, _ = cuflash.merge(*parts)
        grads = torch.autograd.grad((o.sum() + l.sum()), parts, allow_unused=True)
        assert all(g is None or torch.isfinite(g).all() for g in grads)
    o, l, m = cuflash.merge(o_a, l_a, m_a, *empty)
    grads = torch.autograd.grad((o * o).sum() + l.sum(), (o_a, l_a))
    torch.testing.assert_close(grads[0], 2 * o_a.detach())  # merging nothing in is the identity
    torch.testing.assert_close(grads[1], torch.ones(shape, dtype=torch.float64))


def test_torch_compile_traces_the_merge_whole(rng):
    torch = pytest.importorskip("torch")
    q, k, v = random_problem(rng, (2,), 11, 30, 8, 8)
    a, b = part_results(q, k, v, rng.integers(0, 2, 30), 2, causal=True)
    tensors = [torch.from_numpy(x).float() for x in (*a, *b)]
    compiled = torch.compile(cuflash.merge, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*tensors), cuflash.merge(*tensors)):
        torch.testing.assert_close(got, want)
    stacked = [torch.stack(tensors[i::3]) for i in range(3)]
    compiled_stacked = torch.compile(cuflash.merge_stacked, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled_stacked(*stacked), cuflash.merge_stacked(*stacked)):
        torch.testing.assert_close(got, want)


def test_frameworks_are_not_mixed(rng):
    torch = pytest.importorskip("torch")
    o, l = np.zeros((2, 8)), np.ones(2)
    with pytest.raises(TypeError, match="one framework, got o_a numpy, l_a numpy, m_a torch"):
        cuflash.merge(o, l, torch.from_numpy(l), o, l, l)


# ---- CuPy on the GPU: cuflash.attention over key subsets ----------------------------------------


@requires_gpu
@pytest.mark.usefixtures("poisoned_pool")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead_q,lead_kv,nq,nk", (((2, 4), (2, 4), 113, 1023), ((1, 8), (1, 2), 1, 2049),
                                                  ((3, 2), (3, 1), 17, 130)))
def test_gpu_key_halves_merge_to_the_whole(dtype, lead_q, lead_kv, nq, nk, rng):
    q = random_array(rng, lead_q + (nq, 64), dtype)
    k = random_array(rng, lead_kv + (nk, 64), dtype)
    v = random_array(rng, lead_kv + (nk, 64), dtype)
    q_d, k_d, v_d = to_device(q), to_device(k), to_device(v)
    half = int(rng.integers(1, nk))
    a = cuflash.attention(q_d, k_d[..., :half, :], v_d[..., :half, :])
    b = cuflash.attention(q_d, k_d[..., half:, :], v_d[..., half:, :])
    merged = cuflash.merge(*a, *b)
    assert merged.o.dtype == q_d.dtype and merged.l.dtype == merged.m.dtype == np.float32
    check_forward(merged, q, k, v, causal=False, dtype=dtype)


@requires_gpu
@pytest.mark.usefixtures("poisoned_pool")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_causal_parts_with_empty_rows_merge_to_the_whole(dtype, rng):
    """Causal over N keys as [0, h) with the window j <= i and [h, N) causal: the first h
    query rows see nothing in the second part (l = 0, m = -inf there)."""
    n, h = 300, 128
    q, k, v = (random_array(rng, (2, 3, n, 64), dtype) for _ in range(3))
    q_d, k_d, v_d = to_device(q), to_device(k), to_device(v)
    first = cuflash.attention(q_d, k_d[..., :h, :], v_d[..., :h, :], window=(-1, n - h))
    second = cuflash.attention(q_d, k_d[..., h:, :], v_d[..., h:, :], causal=True)
    assert bool((second.m[..., :h] == -np.inf).all()) and bool((second.l[..., :h] == 0).all())
    check_forward(cuflash.merge(*first, *second), q, k, v, causal=True, dtype=dtype)


@requires_gpu
@pytest.mark.usefixtures("poisoned_pool")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_stacked_splits_merge_to_the_whole(dtype, rng):
    import cupy

    nq, nk, parts = 40, 1500, 5
    q = random_array(rng, (2, 8, nq, 128), dtype)
    k, v = (random_array(rng, (2, 2, nk, 128), dtype) for _ in range(2))
    q_d, k_d, v_d = to_device(q), to_device(k), to_device(v)
    bounds = np.linspace(0, nk, parts + 1).astype(int)
    results = [cuflash.attention(q_d, k_d[..., s:e, :], v_d[..., s:e, :]) for s, e in zip(bounds, bounds[1:])]
    merged = cuflash.merge_stacked(*(cupy.stack(x) for x in zip(*results)))
    check_forward(merged, q, k, v, causal=False, dtype=dtype)


# ---- JAX (skipped where it is not installed) ----------------------------------------------------


def test_jax_merge_jits_and_matches_numpy(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    q, k, v = random_problem(rng, (2, 2), 21, 60, 8, 8)
    a, b = part_results(q, k, v, rng.integers(0, 2, 60), 2, causal=True)
    parts32 = [x.astype(np.float32) for x in (*a, *b)]
    want = cuflash.merge(*parts32)
    got = jax.jit(cuflash.merge)(*(jnp.asarray(x) for x in parts32))
    stacked = jax.jit(cuflash.merge_stacked)(*(jnp.stack([jnp.asarray(x) for x in parts32[i::3]]) for i in range(3)))
    for result in (got, stacked):
        for name, g, w in zip("olm", result, want):
            assert g.dtype == w.dtype, name
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-7, err_msg=name)
