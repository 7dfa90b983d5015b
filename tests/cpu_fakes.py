"""Stand-ins that let the benchmark code run on a machine without a GPU (tests only)."""

import types

import numpy as np


class NumpyAsCupy:
    """NumPy under CuPy's name, with the bits of cupy.cuda the benchmark touches."""

    cuda = types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None),
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))

    def __getattr__(self, name):
        return getattr(np, name)


class HostArrayAsDevice:
    """A NumPy array dressed as a GPU array's metadata (shape, strides, dtype, data.ptr,
    device.id, flags): what host-side argument checks read, without a GPU."""

    def __init__(self, array, device_id=0):
        self.array = array
        self.device = types.SimpleNamespace(id=device_id)
        self.data = types.SimpleNamespace(ptr=array.__array_interface__["data"][0])

    shape = property(lambda self: self.array.shape)
    strides = property(lambda self: self.array.strides)
    dtype = property(lambda self: self.array.dtype)
    ndim = property(lambda self: self.array.ndim)
    size = property(lambda self: self.array.size)
    flags = property(lambda self: self.array.flags)

    def swapaxes(self, a, b):
        return HostArrayAsDevice(self.array.swapaxes(a, b), self.device.id)

    def __getitem__(self, index):
        return HostArrayAsDevice(self.array[index], self.device.id)
