"""Block-sparse attention and sliding windows on the GPU against the float64 reference.

The oracle is plain attention with the block mask (and window) expanded to elements
(``reference.element_mask``); the error rule is the dense tests': the forward within 2x, the
gradients within 3x, of what plain attention in the same dtype gets wrong (float32: 1e-5
relative). Every output comes from a poisoned pool, so an element the kernels skip writing is
NaN and fails. Skipped without a GPU.
"""

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import masks as M
from cuflash import reference as ref
from gpu_util import check_backward, check_forward, random_array, to_device, to_host64

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]


def _next_power_of_two(n):
    return 1 << max(0, n - 1).bit_length()


# Every pattern of cuflash.masks (and BigBird's union), built square and cropped to the grid,
# so that any (Tq, Tk) gets each of them.
PATTERNS = {
    "butterfly": lambda n: M.butterfly(_next_power_of_two(n)),
    "fixed": lambda n: M.fixed(n, 3, 1),
    "strided": lambda n: M.strided(n, 3),
    "local": lambda n: M.local(n, 1),
    "causal": lambda n: M.causal(n),
    "global": lambda n: M.global_tokens(n, 1),
    "random": lambda n: M.random(n, 0.25, seed=n),
    "dense": lambda n: M.dense(n),
    "bigbird": lambda n: M.global_tokens(n, 1) | M.local(n, 1) | M.random(n, 0.15, seed=3),
}


def pattern_mask(name, tq, tk, block_size):
    square = PATTERNS[name](max(tq, tk)).to_dense()
    return M.BlockMask.from_dense(square[:tq, :tk], block_size)


def grid(nq, nk, block_size):
    bq, bk = M._block_pair(block_size)
    return -(-nq // bq), -(-nk // bk)


def random_problem(rng, dtype, q_shape, kv_shape, dv=None):
    dv = q_shape[-1] if dv is None else dv
    q = random_array(rng, q_shape, dtype)
    k = random_array(rng, kv_shape, dtype)
    v = random_array(rng, kv_shape[:-1] + (dv,), dtype)
    lead = ref.broadcast_plan(q.shape, k.shape, v.shape).batch_shape
    do = random_array(rng, lead + (q_shape[-2], dv), dtype)
    return q, k, v, do


def run(q, k, v, do, *, deterministic=False, **options):
    """cuflash's forward and backward on device copies of host arrays."""
    import cuflash

    q_d, k_d, v_d, do_d = (to_device(x) for x in (q, k, v, do))
    out = cuflash.attention(q_d, k_d, v_d, **options)
    grads = cuflash.attention_backward(do_d, q_d, k_d, v_d, *out, deterministic=deterministic, **options)
    return out, grads


def check(q, k, v, do, *, dtype, causal=False, block_mask=None, block_size=None, window=None,
          deterministic=False):
    """Run forward and backward with these options and check both against the reference."""
    import cuflash

    out, grads = run(q, k, v, do, causal=causal, block_mask=block_mask, block_size=block_size,
                     window=window, deterministic=deterministic)
    mask = ref.element_mask(q.shape[-2], k.shape[-2], block_mask=cuflash._checks.as_block_mask(block_mask, block_size),
                            window=window, batch_shape=out.o.shape[:-2])
    check_forward(out, q, k, v, causal=causal, dtype=dtype, mask=mask)
    check_backward(grads, do, q, k, v, causal=causal, dtype=dtype, mask=mask)
    return out, grads


# (block size, Nq, Nk): the block sizes of the issue, ragged ends, Nq != Nk both ways.
GEOMETRIES = ((64, 1000, 1000), (128, 1000, 1300), ((128, 64), 1000, 777), (256, 2049, 1000))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"bs{g[0]}_{g[1]}x{g[2]}")
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_every_pattern(name, geometry, causal, rng):
    block_size, nq, nk = geometry
    mask = pattern_mask(name, *grid(nq, nk, block_size), block_size)
    q, k, v, do = random_problem(rng, "bfloat16", (1, 2, nq, 64), (1, 2, nk, 64))
    check(q, k, v, do, dtype="bfloat16", causal=causal, block_mask=mask)


@pytest.mark.parametrize("dtype,d", (("float16", 128), ("float32", 64), ("float32", 96), ("bfloat16", 256)))
def test_dtypes_and_head_dims(dtype, d, rng):
    nq, nk, block_size = 500, 700, (64, 128)
    blocks = np.random.default_rng(d).random((3,) + grid(nq, nk, block_size)) < 0.3  # per head
    q, k, v, do = random_problem(rng, dtype, (1, 3, nq, d), (1, 3, nk, d))
    for causal in (False, True):
        check(q, k, v, do, dtype=dtype, causal=causal, block_mask=M.BlockMask.from_dense(blocks, block_size))
    check(q, k, v, do, dtype=dtype, causal=True, block_mask=M.BlockMask.from_dense(blocks, block_size), window=(200, 0))
    check(q, k, v, do, dtype=dtype, window=(50, 50))  # a window alone: the dense kernels


@pytest.mark.parametrize("mask_batch", ((), (4,), (2, 1), (2, 4), (1, 4)), ids=str)
def test_grouped_heads_and_mask_batch_dims(mask_batch, rng):
    nq, nk, block_size = 333, 500, 64
    blocks = np.random.default_rng(len(mask_batch)).random(mask_batch + grid(nq, nk, block_size)) < 0.4
    mask = M.BlockMask.from_dense(blocks, block_size)
    q, k, v, do = random_problem(rng, "bfloat16", (2, 4, nq, 64), (2, 2, nk, 64))  # 4 q heads on 2
    for causal in (False, True):
        out, _ = check(q, k, v, do, dtype="bfloat16", causal=causal, block_mask=mask)
        assert out.o.shape == (2, 4, nq, 64)


@pytest.mark.parametrize("with_mask", (False, True), ids=("window", "window_and_mask"))
@pytest.mark.parametrize("window", ((-1, 0), (0, 0), (100, 50), (-1, 17), (33, -1), (256, 0)), ids=str)
def test_sliding_windows(window, with_mask, rng):
    for nq, nk in ((600, 900), (900, 600), (17, 113), (113, 17)):
        blocks = np.random.default_rng(nq).random(grid(nq, nk, 128)) < 0.5
        mask = M.BlockMask.from_dense(blocks, 128) if with_mask else None
        q, k, v, do = random_problem(rng, "bfloat16", (2, nq, 64), (2, nk, 64))
        for causal in (False, True):
            check(q, k, v, do, dtype="bfloat16", causal=causal, block_mask=mask, window=window)


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_rows_and_keys_without_blocks(dtype, rng):
    """Empty block rows give o = 0, l = 0, m = -inf and dq = 0; empty block columns dk = dv = 0;
    causal with Nq > Nk empties the first rows too; an all-absent mask empties everything."""
    nq, nk, block_size = 600, 400, 64
    tq, tk = grid(nq, nk, block_size)
    blocks = np.random.default_rng(0).random((tq, tk)) < 0.6
    blocks[[1, 4]] = False
    blocks[:, [0, 3]] = False
    q, k, v, do = random_problem(rng, dtype, (2, nq, 64), (2, nk, 64))
    for causal in (False, True):
        out, grads = check(q, k, v, do, dtype=dtype, causal=causal, block_mask=M.BlockMask.from_dense(blocks, block_size))
        o, l, m = (to_host64(x) for x in out)
        dq, dk, dv = (to_host64(x) for x in grads)
        for rows in (slice(64, 128), slice(256, 320)):
            assert (o[:, rows] == 0).all() and (l[:, rows] == 0).all() and np.isneginf(m[:, rows]).all()
            assert (dq[:, rows] == 0).all()
        for keys in (slice(0, 64), slice(192, 256)):
            assert (dk[:, keys] == 0).all() and (dv[:, keys] == 0).all()
    none = M.BlockMask.from_dense(np.zeros((tq, tk), bool), block_size)
    out, grads = check(q, k, v, do, dtype=dtype, block_mask=none)
    assert all((to_host64(g) == 0).all() for g in grads) and (to_host64(out.o) == 0).all()


def test_absent_tiles_are_never_read(rng):
    """NaN in the Q rows and K/V rows that only absent blocks cover leaves every result finite
    (and right): those tiles are skipped, not masked. Holds when each kernel tile lies inside
    one block (tiles of 64 and 128 in 128-blocks, head dim 64)."""
    import cupy

    from cuflash import _config

    block_size, nq, nk = 128, 1000, 900
    arch = cupy.cuda.Device().compute_capability  # as attention and attention_backward pick
    hopper, wgmma = _config.is_hopper(arch), _config.has_wgmma(arch)
    plans = [_config.backward_plan("bfloat16", 64, 64, False, deterministic, hopper=hopper, sparse=True, wgmma=wgmma)
             for deterministic in (False, True)]
    forward = _config.forward_config("bfloat16", 64, 64, False, sparse=True, wgmma=wgmma, nq=nq)
    for variant in (forward, *(v for plan in plans for v in (*plan.key_passes, plan.dq) if v is not None)):
        if any(block_size % t for t in (variant.block_rows, variant.block_cols)):
            pytest.skip(f"{variant.key} has tiles that straddle 128-blocks")
    tq, tk = grid(nq, nk, block_size)
    blocks = np.random.default_rng(1).random((tq, tk)) < 0.5
    blocks[2] = False
    blocks[:, 5] = False
    mask = M.BlockMask.from_dense(blocks, block_size)
    q, k, v, do = random_problem(rng, "bfloat16", (2, nq, 64), (2, nk, 64))
    clean = run(q, k, v, do, block_mask=mask, deterministic=True)
    q[:, 256:384], k[:, 640:768], v[:, 640:768] = np.nan, np.nan, np.inf
    for deterministic in (False, True):
        out, grads = run(q, k, v, do, block_mask=mask, deterministic=deterministic)
        for name, got, want in zip(("o", "l", "m", "dq", "dk", "dv"), (*out, *grads), (*clean[0], *clean[1])):
            got, want = to_host64(got), to_host64(want)
            assert not np.isnan(got).any(), name
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2, err_msg=name)


def test_deterministic_backward_with_mask_is_repeatable(rng):
    import cupy

    import cuflash

    nq, nk, block_size = 777, 1025, (128, 64)
    mask = pattern_mask("bigbird", *grid(nq, nk, block_size), block_size)
    q, k, v, do = random_problem(rng, "bfloat16", (2, 4, nq, 64), (2, 2, nk, 64))
    check(q, k, v, do, dtype="bfloat16", causal=True, block_mask=mask, window=(300, 0), deterministic=True)
    q_d, k_d, v_d, do_d = (to_device(x) for x in (q, k, v, do))
    options = dict(causal=True, block_mask=mask, window=(300, 0))
    out = cuflash.attention(q_d, k_d, v_d, **options)
    runs = [cuflash.attention_backward(do_d, q_d, k_d, v_d, *out, deterministic=True, **options) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            bits = f"u{a.dtype.itemsize}"
            assert bool(cupy.array_equal(a.view(bits), b.view(bits)))


def test_boolean_arrays_equal_the_block_mask(rng):
    import cupy

    import cuflash

    nq, nk = 500, 700
    blocks = np.random.default_rng(2).random((2, 1) + grid(nq, nk, (64, 128))) < 0.5
    q, k, v, _ = (to_device(x) for x in random_problem(rng, "float16", (2, 3, nq, 64), (2, 3, nk, 64)))
    want = cuflash.attention(q, k, v, causal=True, block_mask=M.BlockMask.from_dense(blocks, (64, 128)))
    for given in (blocks, cupy.asarray(blocks), blocks.astype(np.uint8)):
        got = cuflash.attention(q, k, v, causal=True, block_mask=given, block_size=(64, 128))
        for a, b in zip(got, want):
            assert bool(cupy.array_equal(a, b))


def test_mask_that_does_not_fit_is_refused_before_launch(rng):
    import cuflash

    q = to_device(random_array(rng, (2, 4, 300, 64), "bfloat16"))
    with pytest.raises(ValueError, match=r"Nq=300 needs ceil\(300/128\) = 3 query blocks, the mask has Tq=2"):
        cuflash.attention(q, q, q, block_mask=M.dense(2))
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 4\)"):
        cuflash.attention(q, q, q, block_mask=np.ones((3, 3, 3), bool))
    o, l, m = cuflash.attention(q, q, q)
    with pytest.raises(ValueError, match="block_size=64 differs"):
        cuflash.attention_backward(o, q, q, q, o, l, m, block_mask=M.dense(3), block_size=64)
