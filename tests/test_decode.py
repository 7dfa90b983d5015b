"""The decoding path on the CPU: argument checks, the split chooser, the parameter blocks (the
kernel checks their layout against them when it is built), and an NVRTC build of every decoding
variant (no GPU needed)."""

import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cpu_fakes import HostArrayAsDevice
from cuflash import _config, _constants, _decode, _params, _tiles, _variants, compile_check

BF16 = np.dtype(ml_dtypes.bfloat16)


def arr(shape, dtype=BF16, device_id=0):
    """Metadata of a C-contiguous array of ``shape``; the memory behind it is one element (the
    checks never read it), so caches of any size cost nothing."""
    dtype = np.dtype(dtype)
    strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize for i in range(len(shape)))
    view = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, strides, writeable=False)
    return HostArrayAsDevice(view, device_id)


def paged_cache(num_pages=40, heads=8, page_size=64, d=128, dtype=BF16):
    """vLLM's (num_pages, page_size, Hk, d) cache seen as (num_pages, Hk, page_size, d)."""
    return arr((num_pages, page_size, heads, d), dtype).swapaxes(1, 2)


def plan(q, k, v=None, **kwargs):
    return _decode.plan_decode(q, k, k if v is None else v, **kwargs)


def dense_and_paged_plans(batch, hk, kv_len, d=64):
    """Plans on 132 SMs of one query a head for 32 query heads against ``kv_len`` keys over
    ``hk`` k/v heads: a dense cache, and the same keys in pages of 64."""
    q = arr((batch, 32, 1, d))
    pages = kv_len // 64
    dense = plan(q, arr((batch, hk, kv_len, d)), sm_count=132)
    paged = plan(q, arr((batch * pages, hk, 64, d)), page_table=arr((batch, pages), np.int32),
                 seqlens_k=arr((batch,), np.int32), sm_count=132)
    return dense, paged


# ---- the parameter blocks ------------------------------------------------------------------


def test_a_plan_fills_every_member():
    p = plan(arr((2, 32, 1, 128)), paged_cache(), page_table=arr((2, 5), np.int32), seqlens_k=arr((2,), np.int32))
    pointers = {name: 0 for name, kind in _params.DECODE_PARAM_FIELDS if kind == "Q"}
    assert set(p.fields) | set(pointers) == {name for name, _ in _params.DECODE_PARAM_FIELDS}
    assert struct.calcsize(_params.fields_format(_params.DECODE_PARAM_FIELDS)) == \
        8 * len(_params.DECODE_PARAM_FIELDS)


def test_a_page_group_is_the_smallest_page():
    assert _constants.DECODE_PAGE_GROUP == min(_constants.DECODE_PAGE_SIZES)


# ---- argument checks -------------------------------------------------------------------------


def test_dense_gqa_plan():
    p = plan(arr((8, 32, 1, 128)), arr((8, 8, 32768, 128)))
    assert (p.batch, p.kv_heads, p.group, p.nq, p.capacity, p.row_tiles) == (8, 8, 4, 1, 32768, 1)
    assert p.variant == _config.decode_config("bfloat16", 128, 128, False, 4) and p.variant.row_warps == 1
    assert p.out_shape == (8, 32, 1, 128)
    f = p.fields
    assert (f["q_batch_stride"], f["q_head_stride"], f["q_row_stride"]) == (32 * 128, 128, 128)
    assert (f["k_batch_stride"], f["k_head_stride"], f["k_row_stride"]) == (8 * 32768 * 128, 32768 * 128, 128)
    assert f["scale"] == pytest.approx(128 ** -0.5) and f["scale_log2"] == pytest.approx(128 ** -0.5 / np.log(2))
    assert (f["window_left"], f["window_right"]) == (-1, -1)


def test_vllm_layout_is_read_in_place():
    k = paged_cache(num_pages=40, heads=8, page_size=64)
    p = plan(arr((4, 32, 3, 128)), k, page_table=arr((4, 7), np.int32), seqlens_k=arr((4,), np.int32))
    f = p.fields
    assert (f["k_batch_stride"], f["k_head_stride"], f["k_row_stride"]) == (64 * 8 * 128, 128, 8 * 128)
    assert (f["page_shift"], f["max_pages"], f["num_pages"], p.capacity) == (6, 7, 40, 7 * 64)
    assert p.variant.paged and p.row_tiles == 1  # 4 heads x 3 queries = 12 rows


def test_leading_batch_dims_collapse():
    q = arr((2, 3, 4, 2, 64))
    p = plan(q, arr((2, 3, 2, 100, 64)))
    assert p.batch == 6 and p.group == 2 and p.fields["q_batch_stride"] == 4 * 2 * 64
    assert p.out_shape == (2, 3, 4, 2, 64)
    p = plan(arr((4, 1, 64)), arr((4, 100, 64)))  # no batch dims at all
    assert p.batch == 1 and p.fields["q_batch_stride"] == 0
    with pytest.raises(ValueError, match=r"batch dims \(3, 2\) of q must collapse"):
        plan(arr((2, 3, 4, 1, 64)).swapaxes(0, 1), arr((3, 2, 4, 100, 64)))


def test_mqa_with_many_queries_takes_several_row_tiles():
    p = plan(arr((2, 32, 16, 64)), arr((2, 1, 1000, 64)))
    assert p.group == 32 and p.variant.row_warps == 4 and p.row_tiles == 32 * 16 // 64
    assert p.grid_x == p.row_tiles * p.num_splits


@pytest.mark.parametrize("rows,row_warps", ((1, 1), (4, 1), (16, 1), (17, 2), (32, 2), (33, 4), (64, 4), (512, 4)))
def test_row_warps_hold_the_rows(rows, row_warps):
    assert _config.decode_row_warps(rows) == row_warps
    v = _config.decode_config("float16", 128, 128, False, rows)
    assert v.block_rows == 16 * row_warps and v in _config.all_decode_variants()


def test_head_dims_pick_their_bucket():
    for d, bucket in ((8, 64), (64, 64), (72, 128), (128, 128)):
        assert plan(arr((1, 4, 1, d)), arr((1, 4, 100, d))).variant.head_dim == bucket
    assert plan(arr((1, 4, 1, 64)), arr((1, 4, 100, 64)), arr((1, 4, 100, 128))).variant.head_dim == 128


@pytest.mark.parametrize("kwargs,match", (
    (dict(q=arr((2, 4, 17, 64))), r"1 to 16 queries a head, got q shape \(2, 4, 17, 64\)"),
    (dict(q=arr((2, 4, 1, 64), np.float32), k=arr((2, 4, 100, 64), np.float32)), "float16 or bfloat16"),
    (dict(q=arr((2, 4, 1, 256)), k=arr((2, 4, 100, 256))), r"head dims up to 128"),
    (dict(q=arr((1, 64))), r"q must have shape \(batch..., Hq, Nq, head_dim\)"),
    (dict(k=arr((2, 3, 100, 64))), r"k/v heads must divide the query heads.*\(2, 3, 100, 64\)"),
    (dict(k=arr((3, 4, 100, 64))), r"batch dims of q and k must be equal"),
    (dict(v=arr((2, 4, 99, 64))), r"sequence lengths differ"),
    (dict(k=arr((2, 4, 100, 64), np.float16)), r"q bfloat16, k float16, v float16"),
    (dict(k=arr((2, 4, 100, 64), device_id=1)), r"one device.*k 1"),
    (dict(k=arr((2, 4, 100, 128))[..., ::2]), r"last dim of k must be contiguous"),
    (dict(num_splits=0), r"num_splits must be between 1 and 256, got 0"),
    (dict(num_splits=257), r"got 257"),
    (dict(num_splits=2.0), r"num_splits must be an int"),
    (dict(scale=-1.0), "finite and positive"),
    (dict(window=(3,)), "window must be a"),
    (dict(seqlens_k=arr((3,), np.int32)), r"seqlens_k must have shape \(2,\), got shape \(3,\)"),
    (dict(seqlens_k=arr((2,), np.int64)), r"seqlens_k must be int32, got shape \(2,\), dtype int64"),
    (dict(seqlens_k=np.zeros(2, np.int32)), r"seqlens_k must be an int32 GPU array"),
    (dict(seqlens_k=arr((2,), np.int32, device_id=1)), r"seqlens_k is on device 1"),
))
def test_dense_errors_name_the_argument(kwargs, match):
    q = kwargs.pop("q", arr((2, 4, 1, 64)))
    k = kwargs.pop("k", arr((2, 4, 100, 64) if q.ndim == 4 else (4, 100, 64)))
    v = kwargs.pop("v", k)
    with pytest.raises((TypeError, ValueError), match=match):
        plan(q, k, v, **kwargs)


def test_misaligned_views_are_refused():
    k = arr((2, 4, 101, 64))[:, :, 1:]  # starts 128 bytes in: aligned; rows fine
    plan(arr((2, 4, 1, 64)), k)
    k = HostArrayAsDevice(np.zeros(2 * 4 * 100 * 64 + 4, BF16)[4:].reshape(2, 4, 100, 64))
    with pytest.raises(ValueError, match=r"k must be 16-byte aligned"):
        plan(arr((2, 4, 1, 64)), k)


@pytest.mark.parametrize("kwargs,match", (
    (dict(seqlens_k=None), r"paged cache needs seqlens_k"),
    (dict(page_table=arr((3, 5), np.int32)), r"page_table must have shape \(batch, max_pages\) = \(2, >= 1\)"),
    (dict(page_table=arr((2, 0), np.int32)), r"\(2, >= 1\).*\(2, 0\)"),
    (dict(page_table=arr((2, 5), np.int64)), r"page_table must be int32"),
    (dict(page_table=arr((5, 2), np.int32).swapaxes(0, 1)), r"page_table must be C-contiguous"),
    (dict(page_table=arr((2, 5), np.int32, device_id=1)), r"page_table is on device 1"),
    (dict(k=paged_cache(page_size=8)), r"page size \(k.shape\[2\]\) must be one of \(16, 32, 64, 128, 256\)"),
    (dict(k=paged_cache(page_size=48)), r"got k shape \(40, 8, 48, 128\)"),
    (dict(k=paged_cache(page_size=512)), r"must be one of"),
    (dict(k=arr((2, 40, 8, 64, 128))), r"k must have shape \(num_pages, Hk, page_size, head_dim\)"),
    (dict(v=paged_cache(num_pages=41)), r"k and v must agree in every dim but the last"),
    # rows 2**27 bytes apart: 16 of them span 2**31, past the kernel's 32-bit offsets in a page
    (dict(v=HostArrayAsDevice(np.lib.stride_tricks.as_strided(
        np.zeros(1, BF16), (40, 8, 64, 128), (2**40, 256, 2**27, 2), writeable=False))),
     r"v's rows must lie less than 134217728 bytes apart in a paged cache, got shape \(40, 8, 64, 128\)"),
))
def test_paged_errors_name_the_argument(kwargs, match):
    args = dict(k=paged_cache(), page_table=arr((2, 5), np.int32), seqlens_k=arr((2,), np.int32))
    args.update(kwargs)
    k = args.pop("k")
    v = args.pop("v", k)
    with pytest.raises((TypeError, ValueError), match=match):
        plan(arr((2, 32, 1, 128)), k, v, **args)


def test_capacity_beyond_32_bit_positions_is_refused():
    """Capacities whose key positions, with the kernel's read-ahead slack, reach 2^31 are
    refused; the largest below the bound plans."""
    k = paged_cache(num_pages=2, page_size=256)
    def table(pages):
        return HostArrayAsDevice(np.broadcast_to(np.zeros(1, np.int32), (1, pages)).copy())
    with pytest.raises(ValueError, match=r"2147483648 keys a sequence exceeds"):
        plan(arr((1, 32, 1, 128)), k, page_table=table(2**23), seqlens_k=arr((1,), np.int32))
    largest = (_decode.MAX_KEY_POSITION - 1) // 256  # pages, with one query
    assert largest * 256 + (_constants.DECODE_PAGE_SLOTS + 2) * _tiles.DECODE_MAX_TILE_KEYS < 2**31
    with pytest.raises(ValueError, match=f"{(largest + 1) * 256} keys a sequence exceeds"):
        plan(arr((1, 32, 1, 128)), k, page_table=table(largest + 1), seqlens_k=arr((1,), np.int32))
    assert plan(arr((1, 32, 1, 128)), k, page_table=table(largest), seqlens_k=arr((1,), np.int32)).num_splits >= 1


def test_causal_folds_into_the_window():
    def band(**kw):
        f = plan(arr((1, 4, 3, 64)), arr((1, 4, 100, 64)), **kw).fields
        return f["window_left"], f["window_right"]

    assert band() == (-1, -1)
    assert band(causal=True) == (-1, 0)
    assert band(window=(5, 7)) == (5, 7)
    assert band(window=(5, 7), causal=True) == (5, 0)
    assert band(window=(-1, -1)) == (-1, -1)


def test_supports():
    q, k = arr((2, 32, 1, 128)), arr((2, 8, 4096, 128))
    assert _decode.supports(q, k, k)
    assert _decode.supports(arr((2, 32, 16, 64)), arr((2, 8, 10, 64)), arr((2, 8, 10, 64)))
    assert not _decode.supports(q, k, k, block_mask=object())
    assert not _decode.supports(arr((2, 32, 17, 128)), k, k)
    assert not _decode.supports(arr((2, 32, 1, 128), np.float32), arr((2, 8, 4096, 128), np.float32),
                                arr((2, 8, 4096, 128), np.float32))
    assert not _decode.supports(arr((2, 32, 1, 256)), arr((2, 8, 10, 256)), arr((2, 8, 10, 256)))
    assert not _decode.supports(q, arr((1, 8, 4096, 128)), arr((1, 8, 4096, 128)))  # broadcast batch
    assert _decode.supports(q, paged_cache(), paged_cache(), page_table=arr((2, 5), np.int32))


# ---- the split chooser ------------------------------------------------------------------------


@pytest.mark.parametrize("batch", (1, 2, 8, 64, 128))
@pytest.mark.parametrize("kv_len", (1, 1000, 8192, 131072))
@pytest.mark.parametrize("heads", ((32, 8, 1), (32, 1, 1), (32, 1, 16), (8, 8, 3)))
def test_auto_splits_fill_the_sms_but_keep_tiles_per_split(batch, kv_len, heads):
    hq, hk, nq = heads
    sms = 132
    p = plan(arr((batch, hq, nq, 128)), arr((batch, hk, kv_len, 128)), sm_count=sms)
    key_tiles = -(-kv_len // p.variant.block_cols)
    splits, per_split, ctas = p.num_splits, p.tiles_per_split, p.num_bh * p.row_tiles
    filled = _config.DECODE_SM_FILL * sms
    assert 1 <= splits <= _constants.MAX_DECODE_SPLITS
    assert (splits - 1) * per_split < key_tiles <= splits * per_split  # none empty
    if splits > 1:
        assert per_split >= _config.DECODE_MIN_TILES_PER_SPLIT_SHORT
        if per_split < _config.DECODE_MIN_TILES_PER_SPLIT:  # only where longer splits leave SMs idle
            assert ctas * min(_constants.MAX_DECODE_SPLITS, key_tiles // _config.DECODE_MIN_TILES_PER_SPLIT) < filled
        # Not many more CTAs than the target: one an SM, or two for short splits.
        a_sm = 2 if per_split < _config.DECODE_SHORT_SPLIT_TILES else 1
        assert ctas * (splits - 1) < a_sm * 1.1 * sms
    # The most splits of whole tiles, none empty and none under the short floor:
    most = max(1, min(_constants.MAX_DECODE_SPLITS, key_tiles // _config.DECODE_MIN_TILES_PER_SPLIT_SHORT))
    shortest = -(-key_tiles // most)
    if ctas * -(-key_tiles // shortest) >= filled:  # the SMs are filled where the tiles allow
        assert ctas * splits >= filled
    else:  # out of reach: as many splits as the tiles allow
        assert per_split == shortest


def test_short_dense_splits_take_two_ctas_an_sm():
    """One sequence of 8192 keys over 8 k/v heads: 15 splits of 9 tiles at one CTA an SM, so 32
    of 4 (256 CTAs); 16384 keys (18 tiles a split) stay at one an SM; a call that fits one
    split is not split for it."""
    assert plan(arr((1, 32, 1, 128)), arr((1, 8, 8192, 128)), sm_count=132).num_splits == 32
    assert plan(arr((1, 32, 1, 128)), arr((1, 8, 16384, 128)), sm_count=132).num_splits == 15
    assert plan(arr((128, 32, 1, 128)), arr((128, 1, 1024, 128)), sm_count=132).num_splits == 1


@pytest.mark.parametrize("batch, kv_len, short", ((128, 1024, True), (256, 512, True), (128, 2048, True),
                                                  (128, 4096, False), (32, 1024, False), (1, 131072, False)))
def test_short_caches_in_deep_grids_take_the_short_tiles(batch, kv_len, short):
    """GQA 32/8 at head dim 64: 64-key tiles where the cache is at most 2048 keys and the grid
    at least 4 CTAs an SM (475 on 132 SMs; 32 x 8 = 256 is not); paged caches alike."""
    dense, paged = dense_and_paged_plans(batch, 8, kv_len)
    tiles = _tiles.DECODE_TILES_SHORT[(64, 1)] if short else _tiles.DECODE_TILES[(64, 1)]
    for p in (dense, paged):
        assert (p.variant.block_cols, p.variant.warps, p.variant.stages) == tiles
        assert p.variant in _config.all_decode_variants()
    assert dense.num_splits == 1 or not short
    # MQA (two row warps) has no short form
    mqa = plan(arr((batch, 32, 1, 64)), arr((batch, 1, kv_len, 64)), sm_count=132).variant
    assert (mqa.block_cols, mqa.warps, mqa.stages) == _tiles.DECODE_TILES[(64, 2)]


def test_large_batches_take_one_split():
    """8 x 8 (batch, k/v head) rows fill 64 of 132 SMs: two splits; 32 x 8 fill them all: one
    (the kernel writes o itself, no combine)."""
    p = plan(arr((8, 32, 1, 128)), arr((8, 8, 32768, 128)), sm_count=132)
    assert p.num_splits == 2
    p = plan(arr((32, 32, 1, 128)), arr((32, 8, 8192, 128)), sm_count=132)
    assert p.num_splits == 1 and p.combine is None


@pytest.mark.parametrize("batch, hk, kv_len", ((8, 8, 32768), (1, 8, 8192), (128, 1, 1024), (128, 1, 8192), (1, 1, 131072)))
def test_paged_caches_split_as_dense_ones(batch, hk, kv_len):
    """The same keys paged (64 a page) and dense: the same splits, and so the same merge."""
    dense, paged = dense_and_paged_plans(batch, hk, kv_len)
    assert paged.variant.block_cols == dense.variant.block_cols
    assert (paged.num_splits, paged.tiles_per_split, paged.combine) == (dense.num_splits, dense.tiles_per_split,
                                                                         dense.combine)
    assert dense.num_splits == {(8, 8, 32768): 2, (1, 8, 8192): 16, (128, 1, 1024): 1, (128, 1, 8192): 1,
                                (1, 1, 131072): 256}[(batch, hk, kv_len)]


def test_long_single_sequence_is_spread_over_every_sm():
    p = plan(arr((1, 32, 1, 128)), arr((1, 8, 131072, 128)), sm_count=132)
    assert p.num_bh * p.grid_x >= 0.9 * 132 and p.num_splits == 15  # 8 CTAs a split
    # 32 rows (1 x 32 heads x 1 query) on 132 SMs: the merge's CTAs take the many-warp form
    assert p.combine == _variants.DecodeCombine("bfloat16", _config.DECODE_COMBINE_WARPS[1])
    many = plan(arr((8, 32, 1, 128)), arr((8, 8, 32768, 128)), sm_count=132)
    assert many.combine == _variants.DecodeCombine("bfloat16", _config.DECODE_COMBINE_WARPS[0])  # 256 rows


def test_forced_splits_are_taken_as_given():
    p = plan(arr((1, 4, 1, 64)), arr((1, 4, 100, 64)), num_splits=8)
    assert p.num_splits == 8 and p.tiles_per_split == 1  # 1 key tile: 7 splits stay empty
    p = plan(arr((1, 4, 1, 64)), arr((1, 4, 100000, 64)), num_splits=1)
    assert p.num_splits == 1 and p.combine is None and p.tiles_per_split == -(-100000 // p.variant.block_cols)


def test_empty_cache_plans_one_split():
    p = plan(arr((2, 4, 1, 64)), arr((2, 4, 0, 64)))
    assert p.num_splits == 1 and p.combine is None and p.capacity == 0


def test_two_ctas_fit_an_sm():
    for v in _config.all_decode_variants():
        if isinstance(v, _variants.SplitKvDecode):
            assert 2 * (v.smem_bytes() + 1024) <= 228 * 1024  # two CTAs an H100 / H200 SM (1 KB reserved each)
            assert v.smem_bytes() <= 163 * 1024  # one fits an A100


# ---- NVRTC ------------------------------------------------------------------------------------


def test_decode_variants_are_listed_for_every_arch():
    for arch in compile_check.DEFAULT_ARCHS:
        keys = {v.key for v in _config.variants_for(arch)}
        assert {v.key for v in _config.all_decode_variants()} <= keys
    decode = [v for v in _config.all_decode_variants() if isinstance(v, _variants.SplitKvDecode)]
    # dtypes x dense/paged x (head dims x row warps, and the short-cache forms)
    forms = len(_tiles.DECODE_HEAD_DIM_BUCKETS) * len(_tiles.DECODE_ROW_WARPS) + len(_tiles.DECODE_TILES_SHORT)
    assert len(decode) == len({v.key for v in decode}) == 2 * 2 * forms


def test_every_decode_variant_builds_within_the_spill_budget():
    reports = compile_check.check(compile_check.DEFAULT_ARCHS, _config.all_decode_variants())
    assert {(v.key, arch) for v, arch, _ in reports} == {
        (v.key, arch) for arch in compile_check.DEFAULT_ARCHS for v in _config.all_decode_variants()}
    over = [(v.key, arch, r["spill_stores"]) for v, arch, r in reports
            if r["spill_stores"] > compile_check.SPILL_BUDGET_BYTES]
    assert not over, over


def test_the_public_docstrings_quote_the_routing_rule_and_the_split_limit():
    """attention's docstring (and the adapters') state the decoding path's numbers in words: they
    must be the numbers the code uses."""
    import re

    import cuflash

    doc = " ".join(cuflash.attention.__doc__.split())
    assert f"at least {_config.DECODE_MIN_KEYS} keys" in doc
    assert f"1 to {_constants.MAX_DECODE_SPLITS} (None" in doc
    assert f"1-{_constants.MAX_DECODE_QUERIES} queries a head" in doc
    assert not re.search(r"cuflash\._\w+", doc), "the public docstring points to a private module"
    for adapter in ("torch.py", "jax.py"):
        text = " ".join((Path(cuflash.__file__).parent / adapter).read_text().split())
        assert f"against at least {_config.DECODE_MIN_KEYS} keys" in text, adapter
