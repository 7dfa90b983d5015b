"""The wgmma forward (kernels/flash_fwd_sm90.cu) on an H100/H200, against the float64 reference.

The other forward tests run it too wherever the dispatcher picks it (head dims 64 and 128 in
16 bits on compute capability 9.0); these add what stresses its own machinery: many trips
around the K/V ring (the mbarrier phases), row tiles split between its two consumer
warpgroups, grouped heads and strided inputs through its loader, block-sparse lists and
windows, and the same inputs through the mma.sync kernel for comparison. Skipped elsewhere.
"""

import contextlib

import numpy as np
import pytest

from conftest import requires_gpu, requires_wgmma
from cuflash import _config, _variants
from cuflash import masks as M
from cuflash import reference as ref
from gpu_util import check_forward, launched_variants, random_array, to_device, tma_refused

pytestmark = [requires_gpu, requires_wgmma, pytest.mark.usefixtures("poisoned_pool")]

DTYPES16 = ("float16", "bfloat16")


def run(q, k, v, **kwargs):
    import cuflash

    return cuflash.attention(to_device(q), to_device(k), to_device(v), **kwargs)


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES16)
def test_dispatcher_picks_wgmma(dtype, d):
    for causal in (False, True):
        for sparse in (False, True):
            variant = _config.forward_config(dtype, d, d, causal, sparse=sparse, wgmma=True)
            assert isinstance(variant, _variants.HopperForward), variant
    assert not isinstance(_config.forward_config(dtype, d, d // 2, False, wgmma=True), _variants.HopperForward)
    with _config.wgmma_forward(False):
        assert not isinstance(_config.forward_config(dtype, d, d, False, wgmma=True), _variants.HopperForward)


# Lengths around the 128-row and 64/128-key tiles, and long enough for many laps of the ring.
LENGTHS = ((1, 1), (63, 65), (128, 128), (129, 127), (200, 1000), (1000, 200), (3000, 3001))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES16)
def test_lengths(dtype, d, causal, rng):
    for nq, nk in LENGTHS:
        q = random_array(rng, (1, 2, nq, d), dtype)
        k = random_array(rng, (1, 2, nk, d), dtype)
        v = random_array(rng, (1, 2, nk, d), dtype)
        check_forward(run(q, k, v, causal=causal), q, k, v, causal=causal, dtype=dtype)


# Each head dim's schedule in every form its launch can take: loaded through TMA, or through
# cp.async where the copy engine cannot map the inputs; a persistent grid for short queries
# where the table says so (head dims 64 and 128: up to 1024 query rows, causal head dim 128 up
# to 512, _config.persistent_query_tiles), one item a CTA beyond.
@pytest.mark.parametrize("loads", ("tma", "cp.async"))
@pytest.mark.parametrize("nq", (500, 1000, 1100), ids=("shorter", "short", "long"))
@pytest.mark.parametrize("d", (64, 128, 256))
def test_every_form(d, nq, loads, rng):
    dtype = "bfloat16"
    persistent = {causal: _config.forward_config(dtype, d, d, causal, wgmma=True, nq=nq).persistent
                  for causal in (False, True)}
    assert persistent[False] == (d != 256 and nq <= 1024)  # both grids are covered below
    assert persistent[True] == (d != 256 and nq <= (512 if d == 128 else 1024))
    q = random_array(rng, (2, 3, nq, d), dtype)
    k, v = (random_array(rng, (2, 3, 777, d), dtype) for _ in range(2))
    refused = tma_refused() if loads == "cp.async" else contextlib.nullcontext()
    with launched_variants() as launched, refused:
        for causal in (False, True):
            check_forward(run(q, k, v, causal=causal), q, k, v, causal=causal, dtype=dtype)
    forms = {(v.tma, v.persistent, v.causal) for v in launched if isinstance(v, _variants.HopperForward)}
    assert forms == {(loads == "tma", persistent[causal], causal) for causal in (False, True)}


@pytest.mark.parametrize("d", (64, 128))
def test_persistent_grid_walks_many_items(d, rng):
    """The persistent forms with two items or more a CTA, which one K/V ring and one Q buffer
    serve in turn, so that a phase or hand-off error shows only from a CTA's second item on
    (test_every_form's inputs give each CTA one item on an H200): items of different key-tile
    counts (causal, Nq < Nk), one-tile items and items with no tile at all (a block mask's
    empty row: nothing is loaded, the rows get o = 0).

    CTA c takes items c, c + grid, ...; the last heads' items come last (causal: all but
    their last query tile), so they are second items, and only those heads are checked
    against the reference, which costs seconds a call on the host for all of them."""
    import cupy

    from cuflash._driver import sm_count as _sm_count

    dtype = "bfloat16"
    sms = _sm_count(cupy.cuda.Device().id)  # the persistent grid's size
    nq, nk = 300, 400  # 3 query tiles a head; 4 key tiles of 128
    heads = -(-2 * sms // 3)  # 3 * heads >= 2 * sms items
    assert _config.forward_config(dtype, d, d, False, wgmma=True, nq=nq).persistent
    q = random_array(rng, (1, heads, nq, d), dtype)
    k, v = (random_array(rng, (1, heads, nk, d), dtype) for _ in range(2))
    mask = M.BlockMask.from_dense(np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool), 128)
    elements = ref.element_mask(nq, nk, block_mask=mask)
    last = slice(heads - 4, heads)

    def check(out, causal, **kwargs):
        check_forward(tuple(x[:, last] for x in out), q[:, last], k[:, last], v[:, last], causal=causal,
                      dtype=dtype, **kwargs)

    for causal in (False, True):
        check(run(q, k, v, causal=causal), causal)
        check(run(q, k, v, causal=causal, block_mask=mask), causal, mask=elements)


@pytest.mark.parametrize("d", (64, 128))
def test_same_answer_as_mma_sync_kernel(d, rng):
    """Both kernels within the error rule on one input, and close to each other."""
    dtype = "bfloat16"
    q, k, v = (random_array(rng, (2, 4, 1500, d), dtype) for _ in range(3))
    for causal in (False, True):
        fast = run(q, k, v, causal=causal)
        check_forward(fast, q, k, v, causal=causal, dtype=dtype)
        with _config.wgmma_forward(False):
            slow = run(q, k, v, causal=causal)
        check_forward(slow, q, k, v, causal=causal, dtype=dtype)
        np.testing.assert_allclose(fast.m.get(), slow.m.get(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(fast.l.get(), slow.l.get(), rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES16)
def test_grouped_heads_and_strided_views(dtype, rng):
    """GQA (8 query heads on 2 k/v heads) read from (B, N, H, d) buffers in place."""
    import cupy

    import cuflash

    b, n, d = 2, 700, 128
    q = random_array(rng, (b, n, 8, d), dtype)
    k = random_array(rng, (b, n, 2, d), dtype)
    v = random_array(rng, (b, n, 2, d), dtype)
    views = [cupy.asarray(x).swapaxes(1, 2) for x in (q, k, v)]
    for causal in (False, True):
        out = cuflash.attention(*views, causal=causal)
        check_forward(out, *(x.swapaxes(1, 2) for x in (q, k, v)), causal=causal, dtype=dtype)


@pytest.mark.parametrize("window", ((200, 0), (100, 50), (-1, 300)))
@pytest.mark.parametrize("d", (64, 128))
def test_windows(d, window, rng):
    dtype = "bfloat16"
    q, k, v = (random_array(rng, (1, 2, 1100, d), dtype) for _ in range(3))
    mask = ref.element_mask(1100, 1100, window=window)
    check_forward(run(q, k, v, window=window), q, k, v, causal=False, dtype=dtype, mask=mask)


@pytest.mark.parametrize("block_size", (128, (64, 192), 100))
@pytest.mark.parametrize("d", (64, 128))
def test_block_sparse(d, block_size, rng):
    """Patterns whose blocks match the kernel's tiles, are wider, or straddle them (partial tiles)."""
    dtype = "float16"
    n = 1300
    bq, bk = M._block_pair(block_size)
    tq, tk = -(-n // bq), -(-n // bk)
    size = max(tq, tk)
    square = M.butterfly(1 << (size - 1).bit_length()).to_dense()[:size, :size] | M.global_tokens(size, 1).to_dense()
    mask = M.BlockMask.from_dense(square[:tq, :tk], block_size)
    q, k, v = (random_array(rng, (1, 3, n, d), dtype) for _ in range(3))
    elements = ref.element_mask(n, n, block_mask=mask)
    for causal in (False, True):
        out = run(q, k, v, causal=causal, block_mask=mask)
        check_forward(out, q, k, v, causal=causal, dtype=dtype, mask=elements)


@pytest.mark.parametrize("d", (64, 128))
def test_sparse_forward_with_few_key_tiles_a_row_runs_persistent(d, rng):
    """A block mask whose query tiles visit few key tiles takes the persistent form at any
    length where _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES has an entry (head dim 64), one item
    a CTA otherwise and for a denser mask; both exact."""
    from cuflash import _tiles

    dtype, n = "bfloat16", 2100  # 17 query tiles: the dense rule alone would not be persistent
    tiles = -(-n // 128)
    few = M.local(tiles, 1)  # at most 3 key tiles a row
    many = M.BlockMask.from_dense(np.ones((tiles, tiles), bool) & ~np.eye(tiles, k=3, dtype=bool), 128)
    q, k, v = (random_array(rng, (1, 2, n, d), dtype) for _ in range(3))
    for mask, persistent in ((few, d in _tiles.SM90_SPARSE_PERSISTENT_ROW_TILES), (many, False)):
        with launched_variants() as launched:
            out = run(q, k, v, block_mask=mask)
        (variant,) = [x for x in launched if isinstance(x, _variants.HopperForward)]
        assert variant.sparse and variant.persistent == persistent
        check_forward(out, q, k, v, causal=False, dtype=dtype, mask=ref.element_mask(n, n, block_mask=mask))
