"""The recomputing backward kernels against the float64 reference (GPU; skipped without one)."""

import numpy as np
import pytest

from conftest import requires_gpu
from gpu_util import DTYPES, check_backward, random_array, to_device

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]

HEAD_DIMS = (8, 32, 40, 64, 96, 128, 160, 192, 256)
LENGTHS = ((1, 1), (17, 17), (113, 113), (17, 113), (113, 17))


def forward_backward(q, k, v, do, **kwargs):
    import cuflash

    deterministic = kwargs.pop("deterministic", False)
    q_d, k_d, v_d, do_d = (to_device(x) for x in (q, k, v, do))
    o, l, m = cuflash.attention(q_d, k_d, v_d, **kwargs)
    return cuflash.attention_backward(do_d, q_d, k_d, v_d, o, l, m, deterministic=deterministic, **kwargs)


def random_problem(rng, q_shape, kv_shape, dv, dtype, out_lead=None):
    q = random_array(rng, q_shape, dtype)
    k = random_array(rng, kv_shape, dtype)
    v = random_array(rng, kv_shape[:-1] + (dv,), dtype)
    lead = out_lead if out_lead is not None else q_shape[:-2]
    do = random_array(rng, tuple(lead) + (q_shape[-2], dv), dtype)
    return q, k, v, do


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims_and_odd_lengths(dtype, d, causal, deterministic, rng):
    if dtype == "float32" and deterministic:
        pytest.skip("float32 has one (deterministic) path; covered by the atomic id")
    for nq, nk in LENGTHS:
        q, k, v, do = random_problem(rng, (2, 2, nq, d), (2, 2, nk, d), d, dtype)
        grads = forward_backward(q, k, v, do, causal=causal, deterministic=deterministic)
        check_backward(grads, do, q, k, v, causal=causal, dtype=dtype)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("nq,nk", ((1023, 1023), (2049, 2049), (1023, 2049), (2049, 1023)))
@pytest.mark.parametrize("dtype,d", (("bfloat16", 64), ("float16", 128), ("bfloat16", 256), ("float32", 64)))
def test_long_sequences(dtype, d, nq, nk, causal, rng):
    q, k, v, do = random_problem(rng, (1, 2, nq, d), (1, 2, nk, d), d, dtype)
    check_backward(forward_backward(q, k, v, do, causal=causal), do, q, k, v, causal=causal, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", ((64, 128), (128, 64), (40, 256)))
def test_value_dim_differs(dtype, d, dv, rng):
    q, k, v, do = random_problem(rng, (2, 77, d), (2, 150, d), dv, dtype)
    for causal in (False, True):
        check_backward(forward_backward(q, k, v, do, causal=causal), do, q, k, v, causal=causal, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_shape,kv_shape",
    (
        ((2, 8, 96, 64), (2, 2, 96, 64)),  # grouped-query
        ((2, 8, 96, 64), (2, 1, 96, 64)),  # multi-query
        ((3, 4, 96, 64), (1, 4, 96, 64)),  # kv broadcast over batch
        ((3, 4, 96, 64), (96, 64)),  # missing leading dims
        ((1, 4, 96, 64), (5, 4, 96, 64)),  # q broadcast over batch: dq sums over it
    ),
)
def test_broadcast_and_grouped_heads_sum_back(dtype, q_shape, kv_shape, rng):
    import cuflash

    out_lead = cuflash._broadcast.broadcast_layout(q_shape, (0,) * len(q_shape), kv_shape, (0,) * len(kv_shape),
                                             kv_shape, (0,) * len(kv_shape)).out_lead_shape
    q, k, v, do = random_problem(rng, q_shape, kv_shape, 64, dtype, out_lead=out_lead)
    for causal in (False, True):
        grads = forward_backward(q, k, v, do, causal=causal)
        assert grads.dk.shape == k.shape and grads.dq.shape == q.shape
        check_backward(grads, do, q, k, v, causal=causal, dtype=dtype)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_strided_views(dtype, rng):
    import cuflash

    b, n, h, d = 2, 200, 4, 64
    q_bnhd = random_array(rng, (b, n, h, d), dtype)
    kv = random_array(rng, (b, n + 31, 2, h, d), dtype)
    do_bnhd = random_array(rng, (b, n, h, d), dtype)
    q_d, kv_d, do_d = to_device(q_bnhd), to_device(kv), to_device(do_bnhd)
    views = (q_d.swapaxes(1, 2), kv_d[:, :, 0].swapaxes(1, 2), kv_d[:, :, 1].swapaxes(1, 2))
    o, l, m = cuflash.attention(*views, causal=True)
    grads = cuflash.attention_backward(do_d.swapaxes(1, 2), *views, o, l, m, causal=True)
    host = (q_bnhd.swapaxes(1, 2), kv[:, :, 0].swapaxes(1, 2), kv[:, :, 1].swapaxes(1, 2))
    check_backward(grads, do_bnhd.swapaxes(1, 2), *host, causal=True, dtype=dtype)


@pytest.mark.parametrize("dtype,d", (("bfloat16", 64), ("float16", 128), ("bfloat16", 256), ("float32", 64)))
def test_deterministic_is_bitwise_repeatable(dtype, d, rng):
    import cupy

    import cuflash

    q, k, v, do = (to_device(x) for x in random_problem(rng, (2, 4, 777, d), (2, 4, 1025, d), d, dtype))
    o, l, m = cuflash.attention(q, k, v, causal=True)
    runs = [cuflash.attention_backward(do, q, k, v, o, l, m, causal=True, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            bits = f"u{a.dtype.itemsize}"
            assert bool(cupy.array_equal(a.view(bits), b.view(bits)))


def test_rows_without_keys_get_zero_gradients(rng):
    import cupy

    q, k, v, do = random_problem(rng, (1, 300, 64), (1, 40, 64), 64, "bfloat16")
    grads = forward_backward(q, k, v, do, causal=True)
    dq = cupy.asnumpy(grads.dq).astype(np.float64)
    assert (dq[:, :260] == 0).all() and np.isfinite(dq).all()
    check_backward(grads, do, q, k, v, causal=True, dtype="bfloat16")


def test_bad_statistics_are_refused(rng):
    import cupy

    import cuflash

    q = to_device(random_array(rng, (2, 64, 32), "float16"))
    o, l, m = cuflash.attention(q, q, q)
    with pytest.raises(ValueError, match=r"l must be the forward's C-contiguous float32 array of shape \(2, 64\)"):
        cuflash.attention_backward(o, q, q, q, o, l.astype(cupy.float16), m)
    with pytest.raises(ValueError, match=r"do must have the forward output's shape \(2, 64, 32\)"):
        cuflash.attention_backward(o[:, :10], q, q, q, o, l, m)
    with pytest.raises(TypeError, match="do must have q's dtype float16"):
        cuflash.attention_backward(o.astype(cupy.float32), q, q, q, o, l, m)
