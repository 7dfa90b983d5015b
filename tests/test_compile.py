"""Every kernel variant the dispatcher can pick compiles through NVRTC, within the spill budget.

Needs only NVRTC (no GPU, no driver), so it runs in CI.
"""

import pytest

from cuflash import _config, _constants, _loader, _variants, compile_check

pytestmark = pytest.mark.nvrtc  # builds kernels: left out by -m "not nvrtc"


@pytest.fixture(scope="module")
def reports():
    return compile_check.check(compile_check.DEFAULT_ARCHS)


def test_every_variant_builds_for_each_arch(reports):
    built = {(v.key, arch) for v, arch, _ in reports}
    assert built == {(v.key, arch) for arch in compile_check.DEFAULT_ARCHS
                     for v in _config.variants_for(arch)}


def test_spill_allowances_are_exceptions():
    """Only the block-sparse head-dim-128 mma.sync forwards (which Hopper runs only with the
    wgmma forward switched off) carry their own allowance; everything else has the common
    budget."""
    variants = _config.all_variants(True, True)
    allowed = [v for v in variants if compile_check.spill_budget(v) > compile_check.SPILL_BUDGET_BYTES]
    assert {type(v).__name__ for v in allowed} == {"TensorCoreForward"}
    assert all(v.sparse and v.head_dim == 128 for v in allowed if type(v).__name__ == "TensorCoreForward")


def test_wgmma_variants_only_for_sm90a():
    sm80 = {v.source for v in _config.variants_for("sm_80")}
    sm90 = {v.source for v in _config.variants_for("sm_90a")}
    assert "flash_fwd_sm90.cu" not in sm80 and "flash_fwd_sm90.cu" in sm90
    assert not _config.has_wgmma("sm_100") and _config.has_wgmma("90")


def test_no_variant_spills(reports):
    over = [(v.key, arch, r) for v, arch, r in reports if r["spill_stores"] > compile_check.spill_budget(v)]
    assert not over, over


def test_no_variant_serializes_its_wgmmas(reports):
    """ptxas serializes every wgmma of a kernel (note C7514) when it cannot prove that no other
    instruction reads an accumulator in flight: the overlapped forward did so, and ran slower
    than without overlap, until its last tile was peeled off the loop. C7518 and C7520 (a wait or
    an arrive it inserted on a divergent path) serialize them too."""
    serialized = [(v.key, arch) for v, arch, r in reports if _loader.serializes_wgmma(r)]
    assert not serialized, serialized


def test_dispatcher_only_picks_listed_variants():
    listed = {v.key for v in _config.all_variants()}
    for dtype in _constants.SUPPORTED_DTYPES:
        for d in range(8, 257, 8):
            for dv in (8, d, 256):
                for causal in (False, True):
                    for wgmma in (False, True):
                        for nq in (None, 1, 1024, 1025, 2**30):
                            assert _config.forward_config(dtype, d, dv, causal, wgmma=wgmma, nq=nq).key in listed
                        for deterministic in (False, True):
                            plan = _config.backward_plan(dtype, d, dv, causal, deterministic, wgmma=wgmma)
                            for kernel in (plan.preprocess, *plan.key_passes, plan.dq):
                                assert kernel is None or kernel.key in listed


def test_compile_error_is_reported():
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        compile_check.check(["sm_80"], [_BrokenVariant()])


def test_kernels_check_the_numbers_python_gives_them(monkeypatch):
    """A shared-memory size that is not the kernel's layout, and a padding the kernel was not
    written for, stop the build (static_assert) instead of reaching a GPU."""
    import dataclasses

    variant = _config.forward_config("bfloat16", 64, 64, False)
    assert compile_check.check(["sm_80"], [variant], jobs=1)
    wrong_size = _BrokenVariant()
    wrong_size.name_expression = variant.name_expression.replace(f"{variant.smem_bytes()}>", f"{variant.smem_bytes() + 16}>")
    assert wrong_size.name_expression != variant.name_expression
    with pytest.raises(RuntimeError, match="TensorCoreForward.fixed_smem"):
        _loader.compile_offline(variant.source, [wrong_size.name_expression], "sm_80")
    monkeypatch.setattr(_constants, "SMEM_PAD", 16)
    padded = dataclasses.replace(variant)  # smem_bytes follows the new padding: only the pad is wrong
    with pytest.raises(RuntimeError, match="one 16-byte chunk of padding"):
        _loader.compile_offline(padded.source, [padded.name_expression], "sm_80")
    monkeypatch.undo()
    hopper = _config.forward_config("bfloat16", 128, 128, False, wgmma=True)
    monkeypatch.setattr(_variants.HopperForward, "block_rows", 192)
    with pytest.raises(RuntimeError, match="two consumer warpgroups"):
        _loader.compile_offline(hopper.source, [hopper.name_expression], "sm_90a")


def test_kernels_check_the_parameter_blocks_python_packs(monkeypatch):
    """A parameter block packed otherwise than the kernels lay it out stops the build: its size,
    the words a call writes (the pointers first, the varlen pair), and each member's word."""
    from cuflash import _params

    forward = _config.forward_config("bfloat16", 64, 64, False)
    decode = _config.all_decode_variants()[0]
    for name, value, message in (
            ("BWD_PARAM_FORMAT", _params.BWD_PARAM_FORMAT[:-1], "BwdParams against _params.BWD_PARAM_FORMAT"),
            ("FWD_PARAM_FORMAT", "<q" + _params.FWD_PARAM_FORMAT[2:], "the pointers a call writes"),
            ("CU_SEQLENS_WORD", _params.CU_SEQLENS_WORD + 1, "_params.CU_SEQLENS_WORD")):
        with monkeypatch.context() as patch:
            patch.setattr(_params, name, value)
            with pytest.raises(RuntimeError, match=message):
                _loader.compile_offline(forward.source, [forward.name_expression], "sm_80")
    for name, variant, first, message in (
            ("DECODE_PARAM_FIELDS", decode, "kv_heads", "DecodeParams::kv_heads against cuflash/_params.py"),
            ("FWD_PARAM_FIELDS", forward, "scale", "FwdParams::scale against cuflash/_params.py"),
            ("BWD_PARAM_FIELDS", forward, "do_row_stride", "BwdParams::do_row_stride against cuflash/_params.py")):
        fields = list(getattr(_params, name))  # a member swapped with the next: both move
        at = [field[0] for field in fields].index(first)
        fields[at], fields[at + 1] = fields[at + 1], fields[at]
        with monkeypatch.context() as patch:
            patch.setattr(_params, name, tuple(fields))
            with pytest.raises(RuntimeError, match=message):
                _loader.compile_offline(variant.source, [variant.name_expression], "sm_80")


class _BrokenVariant:
    source = "flash_fwd.cu"
    key = "broken"
    # head dim 24: not a whole number of 16-wide mma tiles
    name_expression = ("cuflash::flash_fwd_kernel<cuflash::FwdTraits<cuflash::bf16, 24, 24, 128, 64, 8, 1, false, 2, "
                       "false, false, 0>>")
