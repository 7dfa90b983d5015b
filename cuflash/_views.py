"""Zero-copy CuPy views of torch tensors, without DLPack's per-call cost.

``cupy.from_dlpack`` on a torch tensor costs about 90 microseconds of host time on the H200's
host (torch's ``__dlpack__`` resolves devices and streams in Python each time): three inputs
made a small attention call 20 times slower on the host than SDPA. A view built from the
tensor's pointer, shape and strides costs a few microseconds. It skips DLPack's stream
hand-off, so it is taken only when the kernels will run on the stream torch is using for the
tensor's device (the adapters set that up; a direct ``cuflash.attention`` call checks it), and
the first tensor of each dtype still goes through DLPack, which tells us CuPy's dtype for it.
"""

from __future__ import annotations

_CUPY_DTYPES: dict = {}  # torch dtype -> the dtype cupy.from_dlpack gives it


def _on_current_stream(t) -> bool:
    import cupy
    import torch

    index = t.device.index
    return torch.cuda.current_stream(index).cuda_stream == cupy.cuda.get_current_stream(index).ptr


def torch_view(t, *, same_stream: bool = False):
    """A cupy.ndarray over the memory of ``t``, a CUDA torch tensor, holding ``t`` alive.

    ``same_stream``: the caller guarantees that CuPy's current stream on t's device is torch's
    current stream there; otherwise that is checked, and DLPack's hand-off used when it is not.
    """
    import cupy

    dtype = _CUPY_DTYPES.get(t.dtype)
    if dtype is None or t.numel() == 0 or not (same_stream or _on_current_stream(t)):
        view = cupy.from_dlpack(t.detach())
        _CUPY_DTYPES.setdefault(t.dtype, view.dtype)
        return view
    itemsize = dtype.itemsize
    shape, strides = tuple(t.shape), t.stride()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), extent * itemsize, t, t.device.index)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0),
                        tuple(s * itemsize for s in strides))


def is_cuda_tensor(x) -> bool:
    """Whether x is a torch tensor on a CUDA device (without importing torch)."""
    return type(x).__module__.startswith("torch") and getattr(getattr(x, "device", None), "type", None) == "cuda"
