"""Tensor-map arithmetic of cuflash._tma (no GPU: the encoding itself is exercised by the GPU
tests of the wgmma forward)."""

from cuflash import _tma


def test_slice_stride_of_contiguous_heads():
    # (B=2, H=4) slices of 1000 x 64: the heads are 64000 elements apart, the batches 256000
    assert _tma.slice_stride((2, 4), (256000, 64000)) == (64000, 8)


def test_slice_stride_of_strided_heads_and_broadcast():
    # a (B, N, H, d) buffer seen as (B, H, N, d): heads d apart, batches N * H * d apart;
    # a broadcast dim (stride 0) adds nothing
    assert _tma.slice_stride((2, 3, 8), (1000 * 8 * 64, 0, 64)) == (64, 1000 * 8 + 8)


def test_slice_stride_of_grouped_heads():
    # 8 query heads on 2 k/v heads: the k/v offsets span 2 heads, not 8
    assert _tma.slice_stride((3, 8), (2 * 500 * 64, 500 * 64), kv_group=4) == (500 * 64, 6)


def test_slice_stride_of_one_slice():
    assert _tma.slice_stride((1, 1), (123, 456)) == (1, 1)
    assert _tma.slice_stride((), ()) == (1, 1)


def test_encode_refuses_what_the_copy_engine_cannot_take():
    # checked before the driver is asked: misaligned base, strides off 16 bytes, ragged columns
    assert _tma.encode(8, 64, 100, 64, 6400, 2, 128) is None
    assert _tma.encode(256, 64, 100, 68, 6800, 2, 128) is None
    assert _tma.encode(256, 64, 100, 64, 6404, 2, 128) is None
    assert _tma.encode(256, 96, 100, 96, 9600, 2, 128) is None


def test_one_slice_is_mapped_whatever_its_stride(monkeypatch):
    """Batch 1 with one k/v head has slice stride 1 (slice_stride's answer when nothing is
    stepped): the map gets a stride the copy engine takes instead of falling back to cp.async
    (the sanitizer's one-case-a-variant run, batch 1, never reached the TMA forms before)."""
    calls = []

    def fake_encoder(out, dtype, rank, ptr, dims, strides, *rest):
        calls.append((tuple(dims), tuple(strides)))
        return 0

    monkeypatch.setattr(_tma, "_encoder", lambda: fake_encoder)
    assert _tma.encode(256, 64, 77, 128, 1, 1, 128) is not None
    (dims, strides), = calls
    assert dims == (64, 77, 1) and strides[0] == 256 and strides[1] % 16 == 0 and strides[1] >= 77 * 256
    assert _tma.encode(256, 64, 77, 128, 1, 2, 128) is None  # two slices 1 element apart: refused
