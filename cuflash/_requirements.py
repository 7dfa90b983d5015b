"""What cuflash needs that a plain ``pip install cuflash`` may not bring, and the one line a user
reads when it is missing: CuPy (the kernels are compiled and launched through it), a framework
for an adapter, a CUDA device.

Importing cuflash works without CuPy (the masks, the float64 reference, merge on NumPy arrays
and the benchmark's IO table need none); a call that needs CuPy raises ModuleNotFoundError with
the extra that installs it. The pip extras themselves are defined in pyproject.toml.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable, Optional

CUPY_INSTALL = 'pip install "cuflash[cuda12]" for a CUDA 12 driver, "cuflash[cuda13]" for CUDA 13'

# adapter module -> (what it needs, in words; the top-level modules that are part of it; its pip extra)
FRAMEWORKS = {
    "cuflash.torch": ("PyTorch", ("torch",), "torch"),
    # buffer_callback, through which the adapter launches inside XLA, came in JAX 0.6.1
    "cuflash.jax": ("JAX 0.6.1 or later (jax.experimental.buffer_callback)", ("jax", "jaxlib"), "jax"),
}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (it may be slow or need CUDA)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def missing_cupy(what: str) -> ModuleNotFoundError:
    """The error of ``what`` (a function or command of cuflash) run without CuPy."""
    return ModuleNotFoundError(f"{what} needs CuPy, which is not installed: {CUPY_INSTALL}", name="cupy")


def needs_cupy(function: Callable) -> Callable:
    """``function`` behind a check that CuPy is installed, for a cuflash imported without it.

    The check runs on every call, so a CuPy installed after cuflash was imported is found.
    """

    @functools.wraps(function)
    def call(*args, **kwargs):
        if not installed("cupy"):
            raise missing_cupy(f"cuflash.{function.__name__}")
        return function(*args, **kwargs)

    return call


def framework_error(error: ModuleNotFoundError, adapter: str) -> BaseException:
    """What to raise for ``error``, met while ``adapter`` (a key of FRAMEWORKS) imports its
    framework: one line naming the pip extra when the framework itself is missing (or too old
    to have a module the adapter imports); ``error`` unchanged when something else is."""
    needs, modules, extra = FRAMEWORKS[adapter]
    if (error.name or "").split(".")[0] not in modules:
        return error
    return ModuleNotFoundError(f'{adapter} needs {needs}, which is not installed: pip install "cuflash[{extra}]"',
                               name=error.name)


def gpu_unavailable() -> Optional[str]:
    """Why no kernel can run here, in one line, or None when CuPy sees a CUDA device."""
    if not installed("cupy"):
        return f"CuPy is not installed: {CUPY_INSTALL}"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no libcuda, CUDA_VISIBLE_DEVICES="": CuPy says which
        text = str(exc).strip().splitlines()
        return f"no usable CUDA device: {type(exc).__name__}{': ' + text[0] if text else ''}"
    return None if count else "no CUDA device found"
