"""What the front ends and the plans share about arrays: the named results, CuPy's view of an
input, element strides, and the one-allocation layout of a call's outputs with the checks of
caller-given ones.

Nothing here chooses a kernel or launches one. The CuPy API (cuflash/_api.py) and the decoding
plans (cuflash/_decode.py) both stand on it, and the plans lay out their workspaces with
:func:`align`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import _checks, _views


class AttentionOutput(NamedTuple):
    """What :func:`cuflash.attention` returns.

    o: (..., Nq, dv), q's dtype.  l, m: (..., Nq), float32, where S = scale * q k^T with masked
    entries excluded, ``m = max_j S``, ``l = sum_j exp(S - m)``; ``m + log(l)`` is the
    log-sum-exp. A row with no allowed key has o = 0, l = 0, m = -inf.
    """

    o: Any
    l: Any
    m: Any


class AttentionGradients(NamedTuple):
    """What :func:`cuflash.attention_backward` returns: dq, dk, dv shaped and typed like q, k, v."""

    dq: Any
    dk: Any
    dv: Any


# ---- inputs ------------------------------------------------------------------------------


def as_cupy(x, name: str):
    """Take a GPU array zero-copy as a cupy.ndarray, or raise TypeError naming ``name``."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} is a NumPy array (host memory, shape {x.shape}, dtype {x.dtype}); cuflash "
            f"needs a GPU array: pass cupy.asarray({name}) or a CUDA tensor"
        )
    if hasattr(x, "__dlpack__"):
        if _views.is_cuda_tensor(x) and not x.requires_grad:
            return _views.torch_view(x)
        if hasattr(x, "__dlpack_device__"):
            dev_type, _ = x.__dlpack_device__()
            if int(dev_type) not in _checks._DLPACK_CUDA_DEVICES:
                raise TypeError(
                    f"{name} ({type(x).__module__}.{type(x).__name__}) lives on DLPack device "
                    f"type {int(dev_type)}, not on a CUDA GPU"
                )
        if getattr(x, "requires_grad", False):
            raise TypeError(
                f"{name} is a torch tensor that requires grad; use cuflash.torch.attention for "
                f"autograd, or pass {name}.detach()"
            )
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(
        f"{name} must be a GPU array (cupy.ndarray or an object exporting __dlpack__ or "
        f"__cuda_array_interface__), got {type(x).__module__}.{type(x).__name__}"
    )


def element_strides(x) -> tuple:
    """The strides of an array with byte strides (NumPy's and CuPy's), in elements."""
    itemsize = x.dtype.itemsize
    return tuple(s // itemsize for s in x.strides)


def contiguous_strides(shape) -> tuple:
    """Row-major element strides of ``shape`` (the layout XLA gives a custom call's operands)."""
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def one_device(arrays, what) -> int:
    """The one device of CuPy ``arrays``, or ValueError naming ``what`` and their devices."""
    devices = [x.data.device_id for x in arrays]
    if len(set(devices)) != 1:
        raise ValueError(f"{what} must be on one device, got devices {devices}")
    return devices[0]


def stream_on(device_id):
    """CuPy's current stream on ``device_id`` as a pointer, and whether that device is current."""
    import cupy

    current = cupy.cuda.runtime.getDevice() == device_id
    if current:
        return cupy.cuda.get_current_stream().ptr, True
    with cupy.cuda.Device(device_id):
        return cupy.cuda.get_current_stream().ptr, False


def longest_sequence(cu, total: int) -> int:
    """The longest sequence that boundaries ``cu`` (a 1-D CuPy or NumPy array or torch tensor)
    delimit in ``total`` packed rows, by the kernels' clamping rule (kernels/slice.cuh); for a
    device array one device-to-host copy."""
    bounded = cu.clip(0, total)
    return max(0, int((bounded[1:] - bounded[:-1]).max())) if len(cu) > 1 else 0


# ---- outputs -------------------------------------------------------------------------------

WORKSPACE_ALIGN = 256  # bytes: where each array of an allocation, or part of a workspace, starts


def align(n: int) -> int:
    """n bytes rounded up to WORKSPACE_ALIGN."""
    return -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def output_specs(shapes_and_dtypes) -> tuple:
    """((shape, dtype, byte offset, C-contiguous byte strides, bytes), ...) of arrays laid out
    one after another in one allocation (each start aligned by :func:`align`), and the
    allocation's size in bytes."""
    specs, end = [], 0
    for shape, dtype in shapes_and_dtypes:
        dtype, shape = np.dtype(dtype), tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        strides = tuple(s * dtype.itemsize for s in contiguous_strides(shape))
        specs.append((shape, dtype, end, strides, nbytes))
        end += align(nbytes)
    return tuple(specs), end


def new_outputs(specs, nbytes: int) -> list:
    """The arrays of :func:`output_specs` on the current device: one allocation from CuPy's
    pool (one allocation costs the host less than one each), which every array keeps alive."""
    import cupy

    if not nbytes:
        return [cupy.empty(spec[0], spec[1]) for spec in specs]
    memory = cupy.cuda.alloc(nbytes)
    return [cupy.ndarray(shape, dtype, memory + offset if offset else memory) for shape, dtype, offset, _, _ in specs]


def extent(shape, strides, itemsize: int):
    """(first, end) byte offsets an array of ``shape`` and element ``strides`` touches from its
    pointer, or None for an empty array."""
    if not math.prod(shape):
        return None
    first = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides)) * itemsize
    last = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) * itemsize
    return first, last + itemsize


def given_outputs(out, names, specs, device_id: int, inputs) -> list:
    """``out`` (the caller's arrays for ``names``) as CuPy arrays, each checked against its
    spec (shape, dtype, C-contiguous, on ``device_id``) and against overlapping another output
    or one of ``inputs``: ((name, pointer, (first, end) or None), ...)."""
    import cupy

    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise TypeError(f"out must be a tuple ({', '.join(names)}) of {len(names)} arrays, got "
                        f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
    arrays = [x if type(x) is cupy.ndarray else as_cupy(x, f"out's {name}") for x, name in zip(out, names)]
    spans = []
    for x, (shape, dtype, _, strides, nbytes), name in zip(arrays, specs, names):
        if (x.shape != shape or x.dtype != dtype or (x.strides != strides and not x.flags.c_contiguous)
                or x.data.device_id != device_id):
            _refuse_output(x, name, shape, dtype, device_id)
        if nbytes:
            spans.append((name, x.data.ptr, x.data.ptr + nbytes))
    for i, (name, start, end) in enumerate(spans):
        for other, other_start, other_end in spans[i + 1:]:
            if start < other_end and other_start < end:
                raise ValueError(f"out's {name} overlaps out's {other}: outputs must not share memory "
                                 f"with the inputs or with each other")
        for other, ptr, span in inputs:
            if span is not None and start < ptr + span[1] and ptr + span[0] < end:
                raise ValueError(f"out's {name} overlaps {other}: outputs must not share memory with the "
                                 f"inputs or with each other")
    return arrays


def _refuse_output(x, name, shape, dtype, device_id):
    if x.data.device_id != device_id:
        raise ValueError(f"out's {name} is on device {x.data.device_id}, the inputs on device {device_id}")
    raise ValueError(f"out's {name} must be a C-contiguous {dtype} array of shape {shape}, got shape "
                     f"{x.shape}, dtype {x.dtype}, strides {x.strides}")
