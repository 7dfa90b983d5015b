"""Shared test fixtures: GPU (and wgmma) detection, output poisoning, the scripts/ modules."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are programs, not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no libcuda, no device: all mean "no GPU here"
        return False


HAS_GPU = _gpu_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


def _wgmma_available() -> bool:
    if not HAS_GPU:
        return False
    import cupy

    from cuflash import _config

    return _config.has_wgmma(cupy.cuda.Device().compute_capability)


HAS_WGMMA = _wgmma_available()
requires_wgmma = pytest.mark.skipif(not HAS_WGMMA, reason="needs compute capability 9.0")


@pytest.fixture
def poisoned_pool():
    """Every CuPy allocation inside the test starts as all-ones bytes: NaN in fp16, bf16, fp32.

    cuflash allocates its outputs itself, so poisoning the allocator is how a test makes sure
    every output element was written by the kernel.
    """
    import cupy

    pool = cupy.cuda.MemoryPool()

    def poisoning_malloc(size):
        mem = pool.malloc(size)
        mem.memset_async(0xFF, size)
        return mem

    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(poisoning_malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(previous)
        pool.free_all_blocks()


@pytest.fixture
def rng(request):
    """Fresh random inputs per test: the seed comes from the test's id and numpy's entropy."""
    return np.random.default_rng()


def pytest_runtest_logreport(report):
    """With CUFLASH_TEST_TIMES=FILE, each test's call time is appended to FILE as it finishes,
    so a run cut off by the GPU suite's time limit still says which tests took it."""
    import os

    path = os.environ.get("CUFLASH_TEST_TIMES")
    if path and report.when == "call" and not os.environ.get("PYTEST_XDIST_WORKER"):  # once: in the controller
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f} {report.outcome} {report.nodeid}\n")


def jax_has_gpu(jax) -> bool:
    """Whether ``jax`` (imported by the caller, which skips without it) sees a CUDA GPU."""
    try:
        return HAS_GPU and bool(jax.devices("gpu"))
    except Exception:  # no CUDA plugin, or it found no device
        return False
