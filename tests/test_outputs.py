"""The output layout and the checks of caller-given outputs (``out=``), on the host alone."""

import types

import numpy as np
import pytest

from cuflash import _arrays


class FakeDeviceArray:
    """What given_outputs reads of a device array, over a host array (its address as the pointer)."""

    def __init__(self, array, device_id=0):
        self.array = array
        self.data = types.SimpleNamespace(ptr=array.__array_interface__["data"][0], device_id=device_id)

    shape = property(lambda self: self.array.shape)
    strides = property(lambda self: self.array.strides)
    dtype = property(lambda self: self.array.dtype)
    nbytes = property(lambda self: self.array.nbytes)
    flags = property(lambda self: self.array.flags)


@pytest.fixture
def fake_arrays(monkeypatch):
    monkeypatch.setattr(_arrays, "as_cupy", lambda x, name: x)


def test_output_specs_align_each_array():
    specs, nbytes = _arrays.output_specs((((2, 3, 5, 8), np.float16), ((2, 3, 5), np.float32), ((2, 3, 5), np.float32)))
    assert [spec[2] for spec in specs] == [0, _arrays.align(480), _arrays.align(480) + _arrays.align(120)]
    assert nbytes == _arrays.align(480) + 2 * _arrays.align(120)
    assert specs[0] == ((2, 3, 5, 8), np.dtype(np.float16), 0, (240, 80, 16, 2), 480)
    assert specs[1][:2] == ((2, 3, 5), np.dtype(np.float32)) and specs[1][3:] == ((60, 20, 4), 120)


def test_extent_covers_strided_and_reversed_views():
    a = np.zeros((4, 6, 8), np.float32)
    view = a[:, ::2, :]
    strides = tuple(s // 4 for s in view.strides)
    assert _arrays.extent(view.shape, strides, 4) == (0, (3 * 48 + 2 * 16 + 7 + 1) * 4)
    assert _arrays.extent((3, 8), (-8, 1), 2) == (-2 * 8 * 2, 8 * 2)
    assert _arrays.extent((0, 8), (8, 1), 2) is None


def _specs(*shapes_and_dtypes):
    return _arrays.output_specs(shapes_and_dtypes)[0]


def test_given_outputs_checked_one_by_one(fake_arrays):
    specs = _specs(((2, 4, 8), np.float16), ((2, 4), np.float32), ((2, 4), np.float32))
    names = ("o", "l", "m")
    ok = [FakeDeviceArray(np.empty(s[0], s[1])) for s in specs]
    assert _arrays.given_outputs(tuple(ok), names, specs, 0, []) == ok
    with pytest.raises(TypeError, match=r"out must be a tuple \(o, l, m\) of 3 arrays, got dict"):
        _arrays.given_outputs({}, names, specs, 0, [])
    wrong_dtype = FakeDeviceArray(np.empty((2, 4), np.float64))
    with pytest.raises(ValueError, match=r"out's m must be a C-contiguous float32 array of shape \(2, 4\), got "
                                         r"shape \(2, 4\), dtype float64"):
        _arrays.given_outputs((ok[0], ok[1], wrong_dtype), names, specs, 0, [])
    transposed = FakeDeviceArray(np.empty((4, 2), np.float32).T)
    with pytest.raises(ValueError, match=r"out's l must be a C-contiguous .* strides \(4, 8\)"):
        _arrays.given_outputs((ok[0], transposed, ok[2]), names, specs, 0, [])
    elsewhere = FakeDeviceArray(np.empty((2, 4), np.float32), device_id=1)
    with pytest.raises(ValueError, match="out's l is on device 1, the inputs on device 0"):
        _arrays.given_outputs((ok[0], elsewhere, ok[2]), names, specs, 0, [])


def test_given_outputs_must_not_overlap(fake_arrays):
    specs = _specs(((4, 8), np.float32), ((4,), np.float32), ((4,), np.float32))
    names = ("o", "l", "m")
    block = np.empty(64, np.float32)
    o, l, m = (FakeDeviceArray(x) for x in (block[:32].reshape(4, 8), block[32:36], block[40:44]))
    assert len(_arrays.given_outputs((o, l, m), names, specs, 0, [])) == 3
    overlapping_m = FakeDeviceArray(block[30:34])
    with pytest.raises(ValueError, match="out's o overlaps out's m"):
        _arrays.given_outputs((o, l, overlapping_m), names, specs, 0, [])
    q_ptr = o.data.ptr + 64  # an input whose last bytes are o's middle
    with pytest.raises(ValueError, match="out's o overlaps q: outputs must not share memory"):
        _arrays.given_outputs((o, l, m), names, specs, 0, [("q", q_ptr - 128, (0, 130))])
    # an input ending where o begins, one starting past m, and an empty one: no overlap
    _arrays.given_outputs((o, l, m), names, specs, 0, [("q", o.data.ptr - 128, (0, 128)),
                                                     ("k", m.data.ptr + 16, (0, 16)), ("v", o.data.ptr, None)])
