"""Outputs: the one allocation cuflash makes for a call's arrays, and arrays the caller brings
(``out=``) for the forward, the backward, varlen and decoding calls (GPU; skipped without one)."""

import numpy as np
import pytest

from conftest import requires_gpu
from gpu_util import check_backward, check_forward, random_array, to_device

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]


def poisoned_like(*arrays):
    """New arrays shaped and typed like ``arrays``, every byte 0xFF (NaN in each float dtype)."""
    import cupy

    made = [cupy.empty_like(x) for x in arrays]
    for x in made:
        x.view(cupy.uint8).fill(0xFF)
    return made


def test_forward_outputs_share_one_allocation(rng):
    import cuflash

    q = to_device(random_array(rng, (2, 3, 100, 64), "bfloat16"))
    o, l, m = cuflash.attention(q, q, q)
    assert o.data.mem is l.data.mem is m.data.mem
    assert l.data.ptr >= o.data.ptr + o.nbytes and m.data.ptr >= l.data.ptr + l.nbytes


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_forward_writes_the_given_arrays(dtype, causal, rng):
    import cuflash

    q, k, v = (random_array(rng, (2, 4, n, 64), dtype) for n in (130, 257, 257))
    args = [to_device(x) for x in (q, k, v)]
    expected = cuflash.attention(*args, causal=causal)
    given = poisoned_like(*expected)
    got = cuflash.attention(*args, causal=causal, out=tuple(given))
    assert all(g is x for g, x in zip(got, given))
    check_forward(got, q, k, v, causal=causal, dtype=dtype)
    for a, b in zip(got, expected):  # the same launch as without out: bit-identical
        assert bool((a == b).all())


def test_backward_writes_the_given_arrays(rng):
    """Direct, summed-over-groups and broadcast (summed by CuPy) gradients alike."""
    import cuflash

    dtype = "bfloat16"
    for q_shape, kv_shape in (((2, 4, 96, 64), (2, 4, 96, 64)), ((2, 4, 96, 64), (2, 2, 96, 64)),
                              ((2, 4, 96, 64), (1, 4, 96, 64))):
        q = random_array(rng, q_shape, dtype)
        k, v = (random_array(rng, kv_shape, dtype) for _ in range(2))
        do = random_array(rng, q_shape, dtype)
        dev = [to_device(x) for x in (do, q, k, v)]
        o, l, m = cuflash.attention(*dev[1:], causal=True)
        expected = cuflash.attention_backward(*dev, o, l, m, causal=True)
        given = poisoned_like(*expected)
        got = cuflash.attention_backward(*dev, o, l, m, causal=True, out=given)
        assert all(g is x for g, x in zip(got, given))
        check_backward(got, do, q, k, v, causal=True, dtype=dtype)
        for a, b in zip(got, expected):  # atomic dQ: equal up to the order of its float adds
            np.testing.assert_allclose(a.get().astype(np.float32), b.get().astype(np.float32), rtol=2e-2, atol=2e-2)


def test_varlen_writes_the_given_arrays(rng):
    import cupy

    import cuflash

    q = to_device(random_array(rng, (4, 300, 64), "bfloat16"))
    cu = cupy.asarray([0, 100, 100, 300], dtype=cupy.int32)
    options = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200, causal=True)
    expected = cuflash.attention(q, q, q, **options)
    given = poisoned_like(*expected)
    got = cuflash.attention(q, q, q, out=given, **options)
    assert all(g is x for g, x in zip(got, given))
    for a, b in zip(got, expected):
        assert bool((a == b).all())


@pytest.mark.parametrize("paged", (False, True), ids=("dense", "paged"))
def test_decoding_writes_the_given_arrays(paged, rng):
    import cupy

    import cuflash

    q = to_device(random_array(rng, (3, 8, 1, 128), "bfloat16"))
    k, v = (to_device(random_array(rng, (3, 2, 1024, 128), "bfloat16")) for _ in range(2))
    seqlens = cupy.asarray([1024, 700, 5], dtype=cupy.int32)
    if paged:  # pages of 64 keys, sequence b's pages in order
        pages = 1024 // 64
        table = cupy.arange(3 * pages, dtype=cupy.int32).reshape(3, pages)
        k, v = (x.reshape(3, 2, pages, 64, 128).transpose(0, 2, 1, 3, 4).reshape(3 * pages, 2, 64, 128) for x in (k, v))
        options = dict(page_table=table, seqlens_k=seqlens)
    else:
        options = dict(seqlens_k=seqlens)
    expected = cuflash.attention(q, k, v, **options)
    assert expected.o.data.mem is expected.l.data.mem  # one allocation (with the workspace)
    given = poisoned_like(*expected)
    got = cuflash.attention(q, k, v, out=given, **options)
    assert all(g is x for g, x in zip(got, given))
    for a, b in zip(got, expected):
        assert bool((a == b).all())


def test_routed_decoding_writes_the_given_arrays(rng):
    """A plain call with one query a head, which cuflash sends to the split-KV kernels."""
    import cuflash

    q = to_device(random_array(rng, (2, 8, 1, 64), "float16"))
    k = to_device(random_array(rng, (2, 8, 4096, 64), "float16"))
    expected = cuflash.attention(q, k, k)
    given = poisoned_like(*expected)
    got = cuflash.attention(q, k, k, out=given)
    assert all(g is x for g, x in zip(got, given))
    for a, b in zip(got, expected):
        assert bool((a == b).all())


def test_bad_outputs_are_refused_with_what_was_given(rng):
    import cupy

    import cuflash

    q = to_device(random_array(rng, (2, 3, 64, 64), "bfloat16"))
    o, l, m = cuflash.attention(q, q, q)
    good = poisoned_like(o, l, m)
    with pytest.raises(TypeError, match=r"out must be a tuple \(o, l, m\) of 3 arrays, got tuple of 2"):
        cuflash.attention(q, q, q, out=tuple(good[:2]))
    with pytest.raises(ValueError, match=r"out's o must be a C-contiguous bfloat16 array of shape \(2, 3, 64, 64\), "
                                         r"got shape \(2, 3, 64, 32\)"):
        cuflash.attention(q, q, q, out=(good[0][..., :32], good[1], good[2]))
    with pytest.raises(ValueError, match=r"out's l must be a C-contiguous float32 array .* dtype float16"):
        cuflash.attention(q, q, q, out=(good[0], good[1].astype(cupy.float16), good[2]))
    wide = cupy.empty((2, 3, 64, 128), dtype=o.dtype)
    with pytest.raises(ValueError, match=r"out's o must be a C-contiguous .* strides \(49152, 16384, 256, 2\)"):
        cuflash.attention(q, q, q, out=(wide[..., :64], good[1], good[2]))
    with pytest.raises(ValueError, match="out's o overlaps q: outputs must not share memory"):
        cuflash.attention(q, q, q, out=(q, good[1], good[2]))
    with pytest.raises(ValueError, match="out's l overlaps out's m"):
        cuflash.attention(q, q, q, out=(good[0], good[1], good[1]))
    with pytest.raises(TypeError, match="out's m is a NumPy array"):
        cuflash.attention(q, q, q, out=(good[0], good[1], np.zeros((2, 3, 64), np.float32)))
    do = poisoned_like(q)[0]
    with pytest.raises(ValueError, match="out's dq overlaps do"):
        cuflash.attention_backward(do, q, q, q, o, l, m, out=(do, *poisoned_like(q, q)))
