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
