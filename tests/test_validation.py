"""Argument checking. The metadata checks run on the CPU; the rest need a GPU."""

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import _api


def test_numpy_arrays_are_refused_with_their_shape():
    q = np.ones((2, 16, 64), np.float16)
    with pytest.raises(TypeError, match=r"q is a NumPy array.*\(2, 16, 64\)"):
        _api.as_cupy(q, "q")


def test_non_arrays_are_refused():
    with pytest.raises(TypeError, match="k must be a GPU array.*list"):
        _api.as_cupy([1.0, 2.0], "k")


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
        _api.check_head_dims(*shapes)


def test_dtype_checks():
    with pytest.raises(TypeError, match="q float16, k float32, v float16"):
        _api.check_dtypes(np.float16, np.float32, np.float16)
    with pytest.raises(TypeError, match="float64 is not supported"):
        _api.check_dtypes(np.float64, np.float64, np.float64)
    assert _api.check_dtypes(np.float32, np.float32, np.float32) == "float32"


def _contiguous_strides(shape):
    return tuple(int(s) for s in np.cumprod((1,) + tuple(shape[::-1]))[-2::-1])


def layout(q, k, v):
    return _api.broadcast_layout(q, _contiguous_strides(q), k, _contiguous_strides(k), v, _contiguous_strides(v))


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
        _api._resolve_scale(scale, 64)


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
