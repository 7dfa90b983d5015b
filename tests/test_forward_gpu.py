"""The forward kernels against the float64 reference (GPU; skipped without one)."""

import numpy as np
import pytest

from conftest import requires_gpu
from gpu_util import DTYPES, check_forward, random_array, to_device

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]

HEAD_DIMS = (8, 32, 40, 64, 80, 96, 128, 160, 192, 256)
LENGTHS = ((1, 1), (17, 17), (113, 113), (17, 113), (113, 17), (1, 130))


def run(q, k, v, **kwargs):
    import cuflash

    return cuflash.attention(to_device(q), to_device(k), to_device(v), **kwargs)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims_and_odd_lengths(dtype, d, causal, rng):
    for nq, nk in LENGTHS:
        q = random_array(rng, (2, 3, nq, d), dtype)
        k = random_array(rng, (2, 3, nk, d), dtype)
        v = random_array(rng, (2, 3, nk, d), dtype)
        check_forward(run(q, k, v, causal=causal), q, k, v, causal=causal, dtype=dtype)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("nq,nk", ((1023, 1023), (2049, 2049), (1023, 2049), (2049, 1023)))
@pytest.mark.parametrize("dtype,d", (("bfloat16", 64), ("float16", 128), ("bfloat16", 256), ("float32", 64)))
def test_long_sequences(dtype, d, nq, nk, causal, rng):
    q = random_array(rng, (1, 2, nq, d), dtype)
    k = random_array(rng, (1, 2, nk, d), dtype)
    v = random_array(rng, (1, 2, nk, d), dtype)
    check_forward(run(q, k, v, causal=causal), q, k, v, causal=causal, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", ((64, 128), (128, 64), (40, 256), (256, 8)))
def test_value_dim_differs(dtype, d, dv, rng):
    q = random_array(rng, (2, 77, d), dtype)
    k = random_array(rng, (2, 150, d), dtype)
    v = random_array(rng, (2, 150, dv), dtype)
    for causal in (False, True):
        check_forward(run(q, k, v, causal=causal), q, k, v, causal=causal, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_are_read_in_place(dtype, rng):
    """(B, N, H, d) buffers passed as (B, H, N, d) views, and k/v sliced from a packed kv."""
    import cupy

    import cuflash

    b, n, h, d = 2, 200, 4, 64
    q_bnhd = random_array(rng, (b, n, h, d), dtype)
    kv_bn2hd = random_array(rng, (b, n + 31, 2, h, d), dtype)
    q_dev, kv_dev = to_device(q_bnhd), to_device(kv_bn2hd)
    q_view = q_dev.swapaxes(1, 2)
    k_view = kv_dev[:, :, 0].swapaxes(1, 2)
    v_view = kv_dev[:, :, 1].swapaxes(1, 2)
    assert not q_view.flags.c_contiguous and not k_view.flags.c_contiguous
    for causal in (False, True):
        out = cuflash.attention(q_view, k_view, v_view, causal=causal)
        q = q_bnhd.swapaxes(1, 2)
        k = kv_bn2hd[:, :, 0].swapaxes(1, 2)
        v = kv_bn2hd[:, :, 1].swapaxes(1, 2)
        check_forward(out, q, k, v, causal=causal, dtype=dtype)
    assert isinstance(out.o, cupy.ndarray) and out.o.flags.c_contiguous


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_shape,kv_shape",
    (
        ((2, 8, 96, 64), (2, 2, 96, 64)),  # grouped-query: 4 q heads per kv head
        ((2, 8, 96, 64), (2, 1, 96, 64)),  # multi-query
        ((3, 4, 96, 64), (1, 4, 96, 64)),  # kv broadcast over batch
        ((3, 4, 96, 64), (96, 64)),  # missing leading dims
        ((1, 4, 96, 64), (5, 4, 96, 64)),  # q broadcast over batch
        ((2, 3, 6, 96, 64), (2, 1, 3, 96, 64)),  # 3 leading dims, grouped last
        ((6, 1, 2, 3, 96, 64), (1, 5, 2, 1, 96, 64)),  # 4 leading dims
    ),
)
def test_broadcast_and_grouped_heads(dtype, q_shape, kv_shape, rng):
    q = random_array(rng, q_shape, dtype)
    k = random_array(rng, kv_shape, dtype)
    v = random_array(rng, kv_shape, dtype)
    for causal in (False, True):
        check_forward(run(q, k, v, causal=causal), q, k, v, causal=causal, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_argument(dtype, rng):
    q = random_array(rng, (2, 64, 32), dtype)
    k = random_array(rng, (2, 90, 32), dtype)
    v = random_array(rng, (2, 90, 32), dtype)
    for scale in (0.05, 1.0, 3.0):
        check_forward(run(q, k, v, scale=scale), q, k, v, causal=False, scale=scale, dtype=dtype)


def test_rows_without_keys_are_zero_not_nan(rng):
    import cupy

    q = random_array(rng, (1, 300, 64), "bfloat16")
    k = random_array(rng, (1, 40, 64), "bfloat16")
    out = run(q, k, k, causal=True)
    o, l, m = (cupy.asnumpy(x).astype(np.float64) for x in out)
    assert (o[:, :260] == 0).all() and (l[:, :260] == 0).all() and np.isneginf(m[:, :260]).all()
    assert np.isfinite(o).all() and (l[:, 260:] > 0).all()


def test_zero_size_batch_returns_empty(rng):
    q = random_array(rng, (0, 4, 16, 64), "float16")
    out = run(q, q, q)
    assert out.o.shape == (0, 4, 16, 64) and out.l.shape == (0, 4, 16) and out.m.shape == (0, 4, 16)


def test_lse_merges_key_blocks(rng):
    """Partial results over key halves merge to the full result through m and l."""
    import cupy

    import cuflash

    q, k, v = (to_device(random_array(rng, (2, 128, 64), "float32")) for _ in range(3))
    full = cuflash.attention(q, k, v)
    a = cuflash.attention(q, k[:, :50], v[:, :50])
    b = cuflash.attention(q, k[:, 50:], v[:, 50:])
    m = cupy.maximum(a.m, b.m)
    wa, wb = a.l * cupy.exp(a.m - m), b.l * cupy.exp(b.m - m)
    o = (a.o * wa[..., None] + b.o * wb[..., None]) / (wa + wb)[..., None]
    cupy.testing.assert_allclose(o, full.o, rtol=1e-5, atol=1e-6)
    cupy.testing.assert_allclose(m, full.m, rtol=1e-6)
    cupy.testing.assert_allclose(wa + wb, full.l, rtol=1e-5)


def test_runs_on_current_stream(rng):
    import cupy

    import cuflash

    q = to_device(random_array(rng, (4, 512, 128), "bfloat16"))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        expected = cuflash.attention(q, q, q).o
        got = cuflash.attention(q, q, q).o
        stream.synchronize()
    assert bool((expected == got).all())


def test_torch_tensors_zero_copy(rng):
    torch = pytest.importorskip("torch")
    import cupy

    import cuflash

    q = torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 130, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 130, 64, device="cuda", dtype=torch.bfloat16)
    out = cuflash.attention(q, k, v, causal=True)
    o = torch.from_dlpack(out.o)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=False, enable_gqa=True,
        attn_mask=torch.ones(100, 130, dtype=torch.bool, device="cuda").tril(130 - 100),
    )
    assert o.shape == expected.shape and o.dtype == torch.bfloat16
    assert (o.float() - expected).abs().max().item() < 2e-2
    assert cupy.from_dlpack(q).data.ptr == q.data_ptr()  # zero-copy in


def test_torch_stream_ordering(rng):
    """Work queued on a torch side stream is seen by cuflash launched on that stream."""
    torch = pytest.importorskip("torch")
    import cupy

    import cuflash

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q = torch.randn(8, 2048, 128, device="cuda", dtype=torch.float16)
        q.mul_(0.5)  # still running when cuflash is launched
        with cupy.cuda.Stream.from_external(side):
            o = torch.from_dlpack(cuflash.attention(q, q, q).o)
        expected = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    side.synchronize()
    assert (o.float() - expected.float()).abs().max().item() < 5e-3


def test_jax_arrays(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash

    q = jax.device_put(jnp.asarray(random_array(rng, (2, 100, 64), "float32").astype(np.float16)))
    out = cuflash.attention(q, q, q, causal=True)
    o = np.asarray(jax.dlpack.from_dlpack(out.o))
    qh = np.asarray(q)
    check_forward(out, qh, qh, qh, causal=True, dtype="float16")
    assert o.shape == (2, 100, 64)
