"""The loader: where kernels are found, and a cache key that covers every header."""

import shutil

from cuflash import _loader


def test_kernels_found_with_every_header():
    names = {p.name for p in _loader.KERNEL_DIR.iterdir()}
    assert {"common.cuh", "softmax.cuh", "mask.cuh", "flash_fwd.cu", "flash_fwd_f32.cu"} <= names


def test_cache_key_changes_when_a_header_changes(tmp_path, monkeypatch):
    for path in _loader.KERNEL_DIR.iterdir():
        shutil.copy(path, tmp_path / path.name)
    monkeypatch.setattr(_loader, "KERNEL_DIR", tmp_path)
    _loader.source_hash.cache_clear()
    try:
        before = _loader.base_options()
        (tmp_path / "softmax.cuh").write_text((tmp_path / "softmax.cuh").read_text() + "\n// edit\n")
        _loader.source_hash.cache_clear()
        after = _loader.base_options()
    finally:
        _loader.source_hash.cache_clear()
    assert any(o.startswith("-DCUFLASH_SRC_HASH=") for o in before)
    assert before != after


def test_options_carry_every_shared_number(monkeypatch):
    """The kernels' shared numbers arrive as defines in the options, so that CuPy's disk-cache
    key (source and options) changes with them."""
    from cuflash import _constants, _variants

    before = _loader.base_options()
    assert {f"-D{name}={value}" for name, value in _variants.kernel_defines().items()} <= set(before)
    monkeypatch.setattr(_constants, "STATS_ROW_MULTIPLE", 256)
    after = _loader.base_options()
    assert "-DCUFLASH_STATS_ROW_MULTIPLE=256" in after and before != after


def test_hopper_gets_the_arch_specific_target():
    assert _loader.arch_options("90") == ("-arch=sm_90a",)
    assert _loader.arch_options("80") == ()


class _FakeKernel:
    """Stands in for a cupy.RawKernel: the shared-memory attribute and the launches."""

    def __init__(self):
        self.max_dynamic_shared_size_bytes = 48 * 1024
        self.launches = []

    def __call__(self, grid, block, args, shared_mem=0):
        assert shared_mem <= self.max_dynamic_shared_size_bytes, "launch above the kernel's allowance"
        self.launches.append(shared_mem)


class _FakeVariant:
    threads = 128

    def smem_bytes(self, d, dv):
        return 200 * 1024


def test_every_kernel_gets_its_shared_memory_allowance(monkeypatch):
    """A plan's Kernel raises the dynamic shared-memory limit of the kernel object it launches
    (once, when the plan is built) whenever the variant needs more than the default 48 KB."""
    from cuflash import _driver

    class _Function:
        ptr = 1234

    kernel = _FakeKernel()
    kernel.kernel = _Function()
    monkeypatch.setattr(_loader, "get_kernel", lambda variant, device=None: kernel)
    monkeypatch.setattr(_driver, "device", lambda device_id: None)
    launch = _driver.Kernel(_FakeVariant(), 0, (1, 1, 1), [], 64, 64)
    assert kernel.max_dynamic_shared_size_bytes == 200 * 1024 == launch.smem
    assert launch.func == 1234


def test_serialized_wgmma_notes_are_recognised():
    """ptxas's note C7518 (seen when a wgmma was issued on one warpgroup's branch ahead of a
    common one) serializes every wgmma like C7514 and C7520; C7519 alone does not."""
    line = ("ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are "
            "serialized due to program dependence on compiler-inserted WG.DP in divergent path in the "
            "function '_ZN7cuflash4someE'")
    code, function = _loader._PTXAS_WGMMA_NOTE.search(line).groups()
    assert (code, function) == ("C7518", "_ZN7cuflash4someE")
    assert _loader.serializes_wgmma({"wgmma_notes": (code,)})
    assert _loader.serializes_wgmma({"wgmma_notes": ("C7519", "C7514")})
    assert not _loader.serializes_wgmma({"wgmma_notes": ("C7519",)})
