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


def test_hopper_gets_the_arch_specific_target():
    assert _loader.arch_options("90") == ("-arch=sm_90a",)
    assert _loader.arch_options("80") == ()
