"""Argument checking. The metadata checks run on the CPU; the rest need a GPU."""

import itertools

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import _arrays, _broadcast, _checks, _constants, _launch, _params


def test_numpy_arrays_are_refused_with_their_shape():
    q = np.ones((2, 16, 64), np.float16)
    with pytest.raises(TypeError, match=r"q is a NumPy array.*\(2, 16, 64\)"):
        _arrays.as_cupy(q, "q")


def test_non_arrays_are_refused():
    with pytest.raises(TypeError, match="k must be a GPU array.*list"):
        _arrays.as_cupy([1.0, 2.0], "k")


@pytest.mark.parametrize(
    "shapes,match",
    (
        (((16, 64), (16, 32), (16, 64)), r"head dims differ.*\(16, 64\).*\(16, 32\)"),
        (((16, 64), (16, 64), (17, 64)), r"sequence lengths differ"),
        (((16, 264), (16, 264), (16, 264)), r"multiple of 8 between 8 and 256, got 264"),
        (((16, 60), (16, 60), (16, 60)), r"got 60"),
        (((16, 64), (16, 64), (16, 12)), r"head dim of v .* got 12"),
        (((64,), (16, 64), (16, 64)), r"q must have shape \(..., N, head_dim\)"),
    ),
)
def test_head_dim_checks(shapes, match):
    with pytest.raises(ValueError, match=match):
        _checks.check_head_dims(*shapes)


def test_dtype_checks():
    with pytest.raises(TypeError, match="q float16, k float32, v float16"):
        _checks.check_dtypes(np.float16, np.float32, np.float16)
    with pytest.raises(TypeError, match="float64 is not supported"):
        _checks.check_dtypes(np.float64, np.float64, np.float64)
    assert _checks.check_dtypes(np.float32, np.float32, np.float32) == "float32"


def test_dtype_names_are_cached_per_dtype_object():
    import ml_dtypes

    for t in (np.float16, np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.float32):
        assert _checks.check_dtypes(t, t, t) == np.dtype(t).name  # first call and cached call alike
        assert _checks.check_dtypes(t, t, t) == np.dtype(t).name
    with pytest.raises(TypeError, match="q float16, k bfloat16, v float16"):
        _checks.check_dtypes(np.float16, np.dtype(ml_dtypes.bfloat16), np.float16)


def test_layouts_are_cached_and_bad_shapes_refused_every_time():
    args = ((2, 8, 100, 64), (51200, 6400, 64, 1), (2, 2, 90, 64), (11520, 5760, 64, 1),
            (2, 2, 90, 64), (11520, 5760, 64, 1))
    first = _broadcast.broadcast_layout(*args)
    assert _broadcast.broadcast_layout(*args) is first and first.kv_group == 4
    bad = ((2, 8, 100, 64), (51200, 6400, 64, 1), (3, 2, 90, 64), (11520, 5760, 64, 1),
           (3, 2, 90, 64), (11520, 5760, 64, 1))
    for _ in range(2):  # a refusal is never cached as an answer
        with pytest.raises(ValueError, match="do not broadcast"):
            _broadcast.broadcast_layout(*bad)


def _contiguous_strides(shape):
    return tuple(int(s) for s in np.cumprod((1,) + tuple(shape[::-1]))[-2::-1])


def layout(q, k, v):
    return _broadcast.broadcast_layout(q, _contiguous_strides(q), k, _contiguous_strides(k), v, _contiguous_strides(v))


def test_layout_merges_contiguous_batch_dims():
    lay = layout((2, 3, 4, 10, 8), (2, 3, 4, 12, 8), (2, 3, 4, 12, 8))
    assert lay.out_lead_shape == (2, 3, 4)
    assert lay.lead_shape == (1, 1, 1, 24) and lay.kv_group == 1
    assert lay.q_strides[-1] == 80 and lay.k_strides[-1] == 96


def test_layout_grouped_heads_keep_their_own_dim():
    lay = layout((2, 8, 10, 8), (2, 2, 12, 8), (2, 2, 12, 8))
    assert lay.out_lead_shape == (2, 8) and lay.kv_group == 4
    assert lay.lead_shape[-2:] == (2, 8)
    assert lay.k_strides[-2:] == (2 * 12 * 8, 12 * 8)


def test_layout_broadcast_dims_get_stride_zero():
    lay = layout((3, 4, 10, 8), (1, 4, 12, 8), (12, 8))
    assert lay.out_lead_shape == (3, 4)
    assert lay.v_strides == (0, 0, 0, 0)
    assert lay.k_strides[-2:] == (0, 96)


def test_layout_multi_query_is_plain_broadcast():
    lay = layout((2, 8, 10, 8), (2, 1, 12, 8), (2, 1, 12, 8))
    assert lay.kv_group == 1 and lay.out_lead_shape == (2, 8)


@pytest.mark.parametrize(
    "q,k,v",
    (
        ((2, 6, 10, 8), (2, 4, 12, 8), (2, 4, 12, 8)),  # 6 heads, 4 kv heads
        ((3, 10, 8), (2, 12, 8), (2, 12, 8)),
        ((2, 10, 8), (2, 12, 8), (3, 12, 8)),
    ),
)
def test_layout_refuses_shapes_that_do_not_broadcast(q, k, v):
    with pytest.raises(ValueError, match=r"do not broadcast.*\d+, \d+, \d+"):
        layout(q, k, v)


def test_layout_refuses_too_many_unmergeable_dims():
    q = (2, 3, 2, 3, 2, 10, 8)
    k = (2, 1, 2, 1, 2, 12, 8)
    with pytest.raises(ValueError, match="at most 4 leading dims"):
        layout(q, k, k)


@pytest.mark.parametrize("scale", (0.0, -1.0, float("inf"), float("nan")))
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="scale must be finite and positive"):
        _checks.resolve_scale(scale, 64)


@requires_gpu
class TestOnGpu:
    def arrays(self, *shapes, dtype=np.float16):
        import cupy

        return [cupy.ones(s, dtype=dtype) for s in shapes]

    def test_mismatched_dtypes(self):
        import cupy

        import cuflash

        q, k = self.arrays((16, 64), (16, 64))
        with pytest.raises(TypeError, match="v float32"):
            cuflash.attention(q, k, cupy.ones((16, 64), cupy.float32))

    def test_last_dim_not_contiguous(self):
        import cupy

        import cuflash

        q, k = self.arrays((16, 64), (16, 64))
        v = cupy.ones((64, 16), cupy.float16).T
        with pytest.raises(ValueError, match=r"last dim of v must be contiguous.*\(16, 64\)"):
            cuflash.attention(q, k, v)

    def test_misaligned_view(self):
        import cuflash

        q, k, v = self.arrays((16, 72), (16, 64), (16, 64))
        cuflash.attention(q[:, 8:], k, v)  # shifted by 16 bytes, row stride 72: readable
        with pytest.raises(ValueError, match="16-byte aligned"):
            cuflash.attention(q[:, 3:67], k, v)

    def test_shapes_that_do_not_broadcast(self):
        import cuflash

        q, k, v = self.arrays((3, 16, 64), (2, 16, 64), (2, 16, 64))
        with pytest.raises(ValueError, match=r"q \(3, 16, 64\), k \(2, 16, 64\)"):
            cuflash.attention(q, k, v)

    def test_head_dim_too_large(self):
        import cuflash

        q, k, v = self.arrays((16, 512), (16, 512), (16, 512))
        with pytest.raises(ValueError, match="got 512"):
            cuflash.attention(q, k, v)

    def test_bad_scale_type(self):
        import cuflash

        q, k, v = self.arrays((16, 64), (16, 64), (16, 64))
        with pytest.raises(TypeError, match="scale must be a real number"):
            cuflash.attention(q, k, v, scale="big")


# ---- the parameter blocks ---------------------------------------------------------------------
# Their sizes and the words a call writes reach the kernels as defines, checked there by
# static_asserts (kernels/common.cuh); what is left is Python's own packing.


def test_dense_sparsity_fills_the_block_between_scale_and_cu_seqlens():
    # A dense launch: window (-1, -1), then null lists and zero sizes / strides.
    assert _launch.DENSE_SPARSITY == (-1, -1) + (0,) * 13
    # ... and the varlen fields last: two pointers (cu_seqlens_q, cu_seqlens_k), num_seqs and
    # varlen_tiles.
    after_scale = _params.FWD_PARAM_FORMAT.split("dd", 1)[1]
    assert len(_launch.DENSE_SPARSITY) == len(after_scale) - 4 and after_scale.endswith("QQqq")
    assert _params.CU_SEQLENS_WORD == len(_params.FWD_PARAM_FORMAT) - 1 - 4


# ---- block masks and windows ---------------------------------------------------------------


def test_check_sparsity_accepts_masks_arrays_and_windows():
    from cuflash import masks

    bm = masks.butterfly(8, block_size=(128, 64))
    assert _checks.check_sparsity(bm, None, None, 1000, 500, (2, 3)) == (bm, None)
    assert _checks.check_sparsity(bm, (128, 64), (5, -1), 1000, 500, ())[1] == (5, -1)
    assert _checks.check_sparsity(None, None, (-1, -1), 10, 10, ()) == (None, None)
    assert _checks.check_sparsity(None, None, [3, 0], 10, 10, ()) == (None, (3, 0))
    blocks = np.eye(8, dtype=bool)
    mask, _ = _checks.check_sparsity(blocks, None, None, 1024, 1000, (4,))
    assert mask.block_size == (128, 128) and mask.shape == (8, 8)  # the default block size
    np.testing.assert_array_equal(mask.to_dense(), blocks)
    again, _ = _checks.check_sparsity(blocks.copy(), 128, None, 1024, 1000, (4,))
    assert again is mask  # equal arrays: one conversion, one set of cached lists
    other, _ = _checks.check_sparsity(blocks, 64, None, 512, 500, (4,))
    assert other is not mask and other.block_size == (64, 64)


@pytest.mark.parametrize(
    "kwargs,error,match",
    (
        (dict(block_mask="butterfly"), TypeError, r"block_mask must be a cuflash.masks.BlockMask or a boolean array"),
        (dict(block_mask=np.ones((8, 8))), TypeError, r"boolean array.*float64"),
        (dict(block_mask=np.ones(8, bool)), ValueError, r"\(\.\.\., Tq, Tk\), got shape \(8,\)"),
        (dict(block_mask=np.ones((8, 7), bool)), ValueError, r"Nk=1000 needs ceil\(1000/128\) = 8 key blocks, the mask has Tk=7"),
        (dict(block_mask=np.ones((8, 8), bool), block_size=(64, 128)), ValueError, r"Nq=1000 needs ceil\(1000/64\) = 16"),
        (dict(block_mask=np.ones((3, 8, 8), bool)), ValueError, r"\(3,\).*do not broadcast to the attention batch shape \(2, 4\)"),
        (dict(block_mask=np.ones((1, 2, 4, 8, 8), bool)), ValueError, r"\(1, 2, 4\).*\(2, 4\)"),
        (dict(block_size=64), ValueError, r"block_size=64 was given without a block_mask"),
        (dict(block_mask=np.ones((8, 8), bool), block_size=0), ValueError, r"block_size must be >= 1"),
        (dict(window=5), ValueError, r"window must be a \(left, right\) pair, got 5"),
        (dict(window=(3, -2)), ValueError, r"window right must be >= -1, got -2"),
        (dict(window=(1.5, 0)), TypeError, r"window left must be an integer"),
    ),
)
def test_check_sparsity_errors_name_the_argument(kwargs, error, match):
    args = dict(block_mask=None, block_size=None, window=None, nq=1000, nk=1000, out_lead_shape=(2, 4))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        _checks.check_sparsity(*args.values())


def test_block_size_must_agree_with_a_block_mask():
    from cuflash import masks

    bm = masks.local(4, 1, block_size=(64, 32))
    assert _checks.as_block_mask(bm, (64, 32)) is bm
    with pytest.raises(ValueError, match=r"block_size=128 differs from the block size \(64, 32\)"):
        _checks.as_block_mask(bm, 128)


def test_mask_strides_follow_the_merged_batch_dims():
    from cuflash import masks

    def with_mask(q_shape, kv_shape, mask_batch):
        qkv = (q_shape, _contiguous_strides(q_shape), kv_shape, _contiguous_strides(kv_shape),
               kv_shape, _contiguous_strides(kv_shape))
        bm = masks.BlockMask.from_dense(np.ones(mask_batch + (2, 2), bool), 8)
        return _checks.layout_with_mask(qkv, (), bm)

    per_head = with_mask((3, 4, 16, 8), (3, 4, 16, 8), (4,))
    assert per_head.lead_shape == (1, 1, 3, 4) and per_head.extra_strides[-1] == (0, 0, 0, 1)
    per_batch_head = with_mask((3, 4, 16, 8), (3, 4, 16, 8), (3, 4))
    assert per_batch_head.lead_shape == (1, 1, 1, 12) and per_batch_head.extra_strides[-1] == (0, 0, 0, 1)
    per_batch = with_mask((3, 4, 16, 8), (3, 4, 16, 8), (3, 1))
    assert per_batch.extra_strides[-1] == (0, 0, 1, 0)
    grouped = with_mask((2, 8, 16, 8), (2, 2, 16, 8), (8,))  # per q head, q heads grouped on k/v
    assert grouped.kv_group == 4 and grouped.extra_strides[-1] == (0, 0, 0, 1)
    shared = with_mask((3, 4, 16, 8), (3, 4, 16, 8), ())
    assert shared.extra_strides[-1] == (0, 0, 0, 0) and shared.lead_shape == (1, 1, 1, 12)
    # Without a mask the layout is exactly the dense one.
    qkv = ((3, 4, 16, 8), _contiguous_strides((3, 4, 16, 8))) * 3
    assert _checks.layout_with_mask(qkv, (), None) == _broadcast.broadcast_layout(*qkv)


def test_mask_that_blocks_merging_is_named():
    from cuflash import masks

    q = (2, 3, 2, 3, 2, 10, 8)  # contiguous: merges into one dim on its own
    qkv = (q, _contiguous_strides(q)) * 3
    assert _checks.layout_with_mask(qkv, (), None).lead_shape == (1, 1, 1, 72)
    bm = masks.BlockMask.from_dense(np.ones((2, 1, 2, 1, 2, 2, 2), bool), 8)  # 5 dims apart
    with pytest.raises(ValueError, match=r"at most 4 leading dims.*block_mask of shape \(2, 1, 2, 1, 2, 2, 2\)"):
        _checks.layout_with_mask(qkv, (), bm)


def test_every_launch_has_a_tile_shape():
    # _launch.sparsity_fields counts each launch's lists in its variant's block_rows x block_cols.
    from cuflash import _config

    for dtype in _constants.SUPPORTED_DTYPES:
        for d in (32, 64, 128, 256):
            for deterministic, hopper in itertools.product((False, True), repeat=2):
                plan = _config.backward_plan(dtype, d, d, False, deterministic, hopper=hopper, sparse=True, wgmma=hopper)
                forward = _config.forward_config(dtype, d, d, False, sparse=True, wgmma=hopper, nq=100)
                for variant in (forward, *plan.key_passes, plan.dq):
                    if variant is None:
                        continue
                    rows, cols = variant.block_rows, variant.block_cols
                    assert rows >= 1 and cols >= 1 and isinstance(rows, int) and isinstance(cols, int)
    f32 = _config.backward_plan("float32", 64, 64, False, False, sparse=True)
    assert f32.key_passes[0].block_rows == 32  # one query per lane
    assert f32.dq.block_cols == 32  # one key per lane


def test_dense_sparsity_fields_carry_the_window():
    fields, lists = _launch.sparsity_fields(None, (), 10, 10, None, transpose=False, causal=False, window=None)
    assert fields == _launch.DENSE_SPARSITY and lists is None
    fields, lists = _launch.sparsity_fields(None, (), 10, 10, None, transpose=True, causal=True, window=(4, 0))
    assert fields == (4, 0) + _launch.DENSE_SPARSITY[2:] and lists is None


def test_a_batch_beyond_the_launch_grid_is_refused():
    assert _launch.slice_grid(3, 65535 * 65535) == (3, 65535, 65535)
    assert _launch.slice_grid(3, 70000) == (3, 65535, 2)
    with pytest.raises(ValueError, match="exceed"):
        _launch.slice_grid(3, 65535 * 65535 + 1)
