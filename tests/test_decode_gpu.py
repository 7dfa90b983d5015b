"""The decoding kernels against the float64 reference (GPU; skipped without one).

Every device cache holds NaN wherever the kernel must not read: past each sequence's length,
in pages no table entry points at, and in the rows of a last page past the length; outputs and
the split workspace come from the poisoned pool. The reference sees the same keys, finite, with
an element mask for the lengths, causal and the window (aligned at each sequence's end).
"""

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import masks
from cuflash import reference as ref
from gpu_util import check_forward, random_array, to_device

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]

DECODE_DTYPES = ("float16", "bfloat16")
HEADS = {"gqa": (32, 8), "mqa": (32, 1), "mha": (8, 8)}
SPLITS = (1, 2, 3, 8, None)  # forced, and chosen
POISON = 0xFFFF  # NaN in float16 and bfloat16


def allowed_keys(lengths, nq, capacity, causal=False, window=None):
    """(batch, 1, nq, capacity) element mask: sequence b's keys [0, len_b), with causal and the
    window aligned at its end (the reference's own rules on an (nq, len_b) problem)."""
    lengths = np.clip(np.asarray(lengths), 0, capacity)
    out = np.zeros((len(lengths), 1, nq, capacity), dtype=bool)
    for b, n in enumerate(lengths):
        band = None if window is None else masks.sliding_window(nq, n, *window)
        out[b, 0, :, :n] = ref.allowed_keys(nq, n, causal=causal, mask=band)
    return out


def poisoned_past(cache, lengths):
    """A device copy of dense (batch, Hk, Nk, d) ``cache`` with NaN from each length on."""
    poisoned = cache.copy()
    for b, n in enumerate(lengths):
        poisoned.view(np.uint16)[b, :, max(0, n):] = POISON
    return to_device(poisoned)


class PagedCache:
    """Logical (batch, Hk, capacity, d) keys and values laid out in shuffled pages of page_size,
    with the table and lengths the kernel takes. ``vllm``: the device cache is (num_pages,
    page_size, Hk, d), passed as its (num_pages, Hk, page_size, d) view."""

    def __init__(self, rng, k, v, lengths, page_size, vllm=False, spare_pages=3):
        batch, heads, capacity, _ = k.shape
        self.max_pages = capacity // page_size
        needed = [-(-int(n) // page_size) for n in lengths]
        self.num_pages = sum(needed) + spare_pages
        order = iter(rng.permutation(self.num_pages))
        # Entries past a sequence's pages are garbage: the kernel must not look at them.
        table = rng.integers(-2**31, 2**31 - 1, size=(batch, self.max_pages), dtype=np.int64).astype(np.int32)
        caches = []
        for logical in (k, v):
            pages = np.empty((self.num_pages, heads, page_size, logical.shape[-1]), logical.dtype)
            pages.view(np.uint16)[...] = POISON
            caches.append(pages)
        for b, n in enumerate(lengths):
            for page in range(needed[b]):
                table[b, page] = slot = next(order)
                rows = min(page_size, n - page * page_size)
                for pages, logical in zip(caches, (k, v)):
                    pages[slot, :, :rows] = logical[b, :, page * page_size:page * page_size + rows]
        self.table = table
        self.lengths = np.asarray(lengths, np.int32)
        self.vllm = vllm
        self.host_pages = caches

    def device(self):
        """(k_cache, v_cache, page_table, seqlens_k) on the device."""
        if self.vllm:
            k, v = (to_device(np.ascontiguousarray(c.transpose(0, 2, 1, 3))).swapaxes(1, 2) for c in self.host_pages)
            assert k.shape[1] == 1 or not k.flags.c_contiguous  # with one k/v head the view is contiguous too
        else:
            k, v = (to_device(c) for c in self.host_pages)
        return k, v, to_device(self.table), to_device(self.lengths)


def run_dense(q, k, v, lengths, *, seqlens=True, **kwargs):
    from cuflash import _api

    seqlens_k = to_device(np.asarray(lengths, np.int32)) if seqlens else None
    return _api.decode_attention(to_device(q), poisoned_past(k, lengths), poisoned_past(v, lengths),
                                    seqlens_k=seqlens_k, **kwargs)


def check(out, q, k, v, lengths, dtype, *, causal=False, window=None, scale=None, drop=None):
    """The kernel's output against the reference; ``drop``: a (batch, 1, 1, capacity) mask of
    keys the kernel was told to skip (pages with bad table entries)."""
    allowed = allowed_keys(lengths, q.shape[-2], k.shape[-2], causal=causal, window=window)
    if drop is not None:
        allowed &= ~drop
    return check_forward(out, q, k, v, causal=False, scale=scale, dtype=dtype, mask=allowed)


def inputs(rng, dtype, batch, heads, nq, capacity, d, dv=None):
    hq, hk = heads
    q = random_array(rng, (batch, hq, nq, d), dtype)
    k = random_array(rng, (batch, hk, capacity, d), dtype)
    v = random_array(rng, (batch, hk, capacity, dv or d), dtype)
    return q, k, v


# ---- dense -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("nq", (1, 3, 16))
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("dtype", DECODE_DTYPES)
def test_dense_split_and_unsplit(dtype, heads, nq, num_splits, rng):
    lengths = [0, 1, 17, 1000, 777]
    q, k, v = inputs(rng, dtype, len(lengths), HEADS[heads], nq, 1000, 128)
    check(run_dense(q, k, v, lengths, num_splits=num_splits), q, k, v, lengths, dtype)


@pytest.mark.parametrize("num_splits", (1, 4, None))
@pytest.mark.parametrize("dtype", DECODE_DTYPES)
def test_dense_without_lengths_reads_the_whole_cache(dtype, num_splits, rng):
    q, k, v = inputs(rng, dtype, 3, HEADS["gqa"], 1, 4099, 64)
    lengths = [4099] * 3
    check(run_dense(q, k, v, lengths, seqlens=False, num_splits=num_splits), q, k, v, lengths, dtype)


@pytest.mark.parametrize("paged", (False, True), ids=("dense", "paged"))
@pytest.mark.parametrize("dtype", DECODE_DTYPES)
def test_short_cache_tiles(dtype, paged, rng):
    """128 sequences x 8 k/v heads (1024 CTAs, at least four an SM up to 284 SMs) against a
    cache of 1024 keys take the short-cache tiles (_tiles.DECODE_TILES_SHORT) at head dim 64."""
    from cuflash import _api, _config, _decode, _driver, _tiles

    lengths = [int(n) for n in rng.integers(0, 1025, size=128)]
    lengths[:4] = [0, 1, 17, 1024]
    q, k, v = inputs(rng, dtype, len(lengths), HEADS["gqa"], 1, 1024, 64)
    if paged:
        k_dev, v_dev, table, seqlens = PagedCache(rng, k, v, lengths, 64, vllm=True).device()
        kwargs = dict(page_table=table, seqlens_k=seqlens)
    else:
        k_dev, v_dev = poisoned_past(k, lengths), poisoned_past(v, lengths)
        kwargs = dict(seqlens_k=to_device(np.asarray(lengths, np.int32)))
    plan = _decode.plan_decode(to_device(q), k_dev, v_dev, **kwargs, sm_count=_driver.sm_count(0))
    assert (plan.variant.block_cols, plan.variant.warps, plan.variant.stages) == _tiles.DECODE_TILES_SHORT[(64, 1)]
    assert plan.variant in _config.all_decode_variants()
    check(_api.decode_attention(to_device(q), k_dev, v_dev, **kwargs), q, k, v, lengths, dtype)


@pytest.mark.parametrize("d,dv", ((8, 8), (40, 40), (64, 64), (72, 72), (128, 128), (64, 128), (128, 8)))
def test_head_dims(d, dv, rng):
    lengths = [130, 5, 64]
    for dtype, nq in zip(DECODE_DTYPES, (3, 16)):  # 12 and 64 packed rows: one and four row warps
        q, k, v = inputs(rng, dtype, 3, HEADS["gqa"], nq, 130, d, dv)
        for num_splits in (1, None):
            check(run_dense(q, k, v, lengths, num_splits=num_splits, causal=True), q, k, v, lengths, dtype,
                  causal=True)


@pytest.mark.parametrize("window", (None, (5, 0), (20, 3), (0, 0), (-1, 2)), ids=str)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("nq", (1, 3, 16))
def test_causal_and_window_dense(nq, causal, window, rng):
    lengths = [1, 2, 17, 300, 1000, 0]  # shorter than nq, too
    dtype = "bfloat16"
    q, k, v = inputs(rng, dtype, len(lengths), HEADS["gqa"], nq, 1000, 128)
    for num_splits in (1, 5, None):
        out = run_dense(q, k, v, lengths, causal=causal, window=window, num_splits=num_splits)
        check(out, q, k, v, lengths, dtype, causal=causal, window=window)


def test_lengths_are_clamped_to_the_cache(rng):
    """A negative length counts as 0 and one past the capacity as the capacity (no sync, no
    error: the values live on the GPU)."""
    from cuflash import _api

    dtype = "float16"
    q, k, v = inputs(rng, dtype, 3, HEADS["gqa"], 2, 200, 64)
    given = np.array([-3, 250, 2**31 - 1], np.int32)
    out = _api.decode_attention(to_device(q), to_device(k), to_device(v), seqlens_k=to_device(given),
                                   num_splits=3)
    check(out, q, k, v, [0, 200, 200], dtype)


def test_scale(rng):
    dtype = "bfloat16"
    lengths = [300, 41]
    q, k, v = inputs(rng, dtype, 2, HEADS["mqa"], 4, 300, 64)
    for scale in (0.05, 1.0):
        check(run_dense(q, k, v, lengths, scale=scale), q, k, v, lengths, dtype, scale=scale)


def test_strided_queries_and_batch_dims(rng):
    """q as a (B, Nq, Hq, d) buffer's view, and q with two batch dims."""
    from cuflash import _api

    dtype = "bfloat16"
    lengths = [100, 7, 64, 0]
    q, k, v = inputs(rng, dtype, 4, HEADS["gqa"], 3, 100, 64)
    q_bnhd = to_device(np.ascontiguousarray(q.swapaxes(1, 2)))
    out = _api.decode_attention(q_bnhd.swapaxes(1, 2), poisoned_past(k, lengths), poisoned_past(v, lengths),
                                   seqlens_k=to_device(np.asarray(lengths, np.int32)))
    check(out, q, k, v, lengths, dtype)
    assert out.o.flags.c_contiguous and out.o.shape == q.shape
    q2 = to_device(q.reshape(2, 2, *q.shape[1:]))
    k2, v2 = (poisoned_past(x, lengths).reshape(2, 2, *x.shape[1:]) for x in (k, v))
    out2 = _api.decode_attention(q2, k2, v2, seqlens_k=to_device(np.asarray(lengths, np.int32)))
    assert out2.o.shape == (2, 2) + q.shape[1:] and out2.l.shape == (2, 2) + q.shape[1:-1]
    flat = type(out)(*(x.reshape(q.shape[:-1] + x.shape[4:]) for x in out2))
    check(flat, q, k, v, lengths, dtype)


# ---- paged -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", (1, 4, None))
@pytest.mark.parametrize("page_size", (16, 32, 64, 128, 256))
@pytest.mark.parametrize("dtype", DECODE_DTYPES)
def test_paged_every_page_size(dtype, page_size, num_splits, rng):
    from cuflash import _api

    capacity = 4 * 256
    lengths = [0, 1, 17, 3 * page_size + 5, capacity, 300]
    # 4, 96, 16 and 32 packed rows: one, four (two CTAs) and two row warps
    for heads, nq, vllm, d in (("gqa", 1, True, 128), ("mqa", 3, False, 128), ("mha", 16, True, 64),
                               ("gqa", 8, False, 64)):
        q, k, v = inputs(rng, dtype, len(lengths), HEADS[heads], nq, capacity, d)
        cache = PagedCache(rng, k, v, lengths, page_size, vllm=vllm)
        k_dev, v_dev, table, seqlens = cache.device()
        out = _api.decode_attention(to_device(q), k_dev, v_dev, page_table=table, seqlens_k=seqlens,
                                       num_splits=num_splits)
        check(out, q, k, v, lengths, dtype)


@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("heads,nq,d,dv", (("mqa", 1, 128, 128), ("mqa", 2, 64, 64), ("gqa", 1, 40, 72)), ids=str)
def test_paged_row_warps_and_head_dims(heads, nq, d, dv, page_size, rng):
    """The paged forms the test above leaves out: 32 rows at head dim 128 (two row warps, MQA
    decoding), 64 rows at head dim 64 (four), and head dims short of their bucket (columns
    past d or dv zero-filled, not read)."""
    from cuflash import _api

    dtype = "bfloat16"
    lengths = [700, 1, 16, 0, 513]
    q, k, v = inputs(rng, dtype, len(lengths), HEADS[heads], nq, 768, d, dv)
    cache = PagedCache(rng, k, v, lengths, page_size, vllm=True)
    k_dev, v_dev, table, seqlens = cache.device()
    for num_splits in (1, None):
        out = _api.decode_attention(to_device(q), k_dev, v_dev, page_table=table, seqlens_k=seqlens,
                                       num_splits=num_splits)
        check(out, q, k, v, lengths, dtype)


@pytest.mark.parametrize("window", (None, (9, 0), (40, 2)), ids=str)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("nq", (1, 3, 16))
def test_causal_and_window_paged(nq, causal, window, rng):
    from cuflash import _api

    dtype = "float16"
    lengths = [2, 100, 513, 0, 1024]
    q, k, v = inputs(rng, dtype, len(lengths), HEADS["gqa"], nq, 1024, 128)
    cache = PagedCache(rng, k, v, lengths, 64, vllm=True)
    k_dev, v_dev, table, seqlens = cache.device()
    for num_splits in (1, 3, None):
        out = _api.decode_attention(to_device(q), k_dev, v_dev, page_table=table, seqlens_k=seqlens,
                                       causal=causal, window=window, num_splits=num_splits)
        check(out, q, k, v, lengths, dtype, causal=causal, window=window)


@pytest.mark.parametrize("page_size", (16, 128))
def test_bad_page_entries_mask_their_keys(page_size, rng):
    """Table entries outside [0, num_pages) are never dereferenced: their keys are masked."""
    from cuflash import _api

    dtype = "bfloat16"
    capacity = 8 * page_size
    lengths = [capacity, 5 * page_size + 3, page_size]
    q, k, v = inputs(rng, dtype, 3, HEADS["gqa"], 3, capacity, 64)
    cache = PagedCache(rng, k, v, lengths, page_size)
    drop = np.zeros((3, 1, 1, capacity), dtype=bool)
    for (b, page), entry in zip(((0, 1), (0, 7), (1, 5), (2, 0)), (-1, cache.num_pages, 2**30, -2**31)):
        cache.table[b, page] = entry
        drop[b, 0, 0, page * page_size:(page + 1) * page_size] = True
    k_dev, v_dev, table, seqlens = cache.device()
    for num_splits in (1, None):
        out = _api.decode_attention(to_device(q), k_dev, v_dev, page_table=table, seqlens_k=seqlens,
                                       num_splits=num_splits)
        check(out, q, k, v, lengths, dtype, drop=drop)  # sequence 2 has no key left: o = 0, m = -inf


def test_paged_matches_dense_layout(rng):
    """The same keys paged and dense give the same result within the error rule each."""
    from cuflash import _api

    dtype = "bfloat16"
    lengths = [640, 1, 333]
    q, k, v = inputs(rng, dtype, 3, HEADS["mqa"], 16, 640, 128)
    cache = PagedCache(rng, k, v, lengths, 32, vllm=True)
    k_dev, v_dev, table, seqlens = cache.device()
    paged = _api.decode_attention(to_device(q), k_dev, v_dev, page_table=table, seqlens_k=seqlens, causal=True)
    dense = run_dense(q, k, v, lengths, causal=True)
    check(paged, q, k, v, lengths, dtype, causal=True)
    check(dense, q, k, v, lengths, dtype, causal=True)


# ---- launching a plan with fixed buffers --------------------------------------------------------


def test_run_plan_writes_the_given_buffers(rng):
    """run_plan with its workspace and outputs given allocates nothing (what a captured graph
    needs), and gives what decode_attention gives."""
    import cupy

    from cuflash import _api, _arrays, _decode

    dtype = "float16"
    lengths = [2000, 17]
    q, k, v = inputs(rng, dtype, 2, HEADS["gqa"], 1, 2000, 128)
    q_dev, k_dev, v_dev = to_device(q), poisoned_past(k, lengths), poisoned_past(v, lengths)
    seqlens = to_device(np.asarray(lengths, np.int32))
    plan = _decode.plan_decode(q_dev, k_dev, v_dev, seqlens_k=seqlens, num_splits=6)
    workspace = cupy.empty(plan.workspace_bytes, cupy.uint8)  # the splits' o, l and m, one buffer
    out = (cupy.empty(plan.out_shape, q_dev.dtype), cupy.empty(plan.out_shape[:-1], cupy.float32),
           cupy.empty(plan.out_shape[:-1], cupy.float32))
    _api.run_plan(plan, q_dev, k_dev, v_dev, seqlens_k=seqlens)  # builds the kernels
    allocations = []
    poisoning = cupy.cuda.get_allocator()

    def counting(size):
        allocations.append(size)
        return poisoning(size)

    cupy.cuda.set_allocator(counting)
    try:
        got = _api.run_plan(plan, q_dev, k_dev, v_dev, seqlens_k=seqlens, workspace=workspace, out=out)
    finally:
        cupy.cuda.set_allocator(poisoning)
    assert allocations == []
    assert all(a is b for a, b in zip(got, out))
    check(_arrays.AttentionOutput(*got), q, k, v, lengths, dtype)
    with pytest.raises(ValueError, match="workspace must be a contiguous array of at least"):
        _api.run_plan(plan, q_dev, k_dev, v_dev, seqlens_k=seqlens, workspace=workspace[:-1], out=out)


@requires_gpu
@pytest.mark.parametrize("nk,expected", ((512, "decode"), (32, "fwd")))
def test_short_queries_take_the_split_kv_path_from_decode_min_keys(nk, expected):
    """cuflash.attention routes 1-16 queries a head to the split-KV kernels from
    _config.DECODE_MIN_KEYS keys on, and keeps shorter key ranges on the forward."""
    import cuflash
    from cuflash import _config
    from gpu_util import launched_variants

    assert (nk >= _config.DECODE_MIN_KEYS) == (expected == "decode")
    rng = np.random.default_rng(nk)
    q = to_device(random_array(rng, (2, 8, 1, 128), "bfloat16"))
    k, v = (to_device(random_array(rng, (2, 2, nk, 128), "bfloat16")) for _ in range(2))
    with launched_variants() as launched:
        cuflash.attention(q, k, v)
    assert launched and launched[0].key.startswith(expected + "_"), [x.key for x in launched]
