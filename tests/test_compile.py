"""Every kernel variant the dispatcher can pick compiles through NVRTC, within the spill budget.

Needs only NVRTC (no GPU, no driver), so it runs in CI.
"""

import pytest

from cuflash import _config, _loader, compile_check

pytestmark = pytest.mark.nvrtc  # builds kernels: left out by -m "not nvrtc"


@pytest.fixture(scope="module")
def reports():
    return compile_check.check(compile_check.DEFAULT_ARCHS)


def test_every_variant_builds_for_each_arch(reports):
    built = {(v.key, arch) for v, arch, _ in reports}
    assert built == {(v.key, arch) for arch in compile_check.DEFAULT_ARCHS
                     for v in _config.variants_for(arch)}


def test_spill_allowances_are_exceptions():
    """Only the wgmma forward carries its own allowance; everything else has the common budget."""
    variants = _config.all_variants(True, True)
    allowed = {type(v).__name__ for v in variants if compile_check.spill_budget(v) > compile_check.SPILL_BUDGET_BYTES}
    assert allowed == {"HopperForward"}


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
    than without overlap, until its last tile was peeled off the loop. C7520 (an arrive it
    inserted on a divergent path) serializes them too."""
    serialized = [(v.key, arch) for v, arch, r in reports if _loader.serializes_wgmma(r)]
    assert not serialized, serialized


def test_dispatcher_only_picks_listed_variants():
    listed = {v.key for v in _config.all_variants()}
    for dtype in _config.SUPPORTED_DTYPES:
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


class _BrokenVariant:
    source = "flash_fwd.cu"
    key = "broken"
    name_expression = "cuflash::flash_fwd_kernel<cuflash::bf16, 24, 24, 128, 64, 8, 1, false>"


def test_bulk_dq_follows_the_head_dim_unless_forced():
    def bulk(d):
        return _config.backward_plan("bfloat16", d, d, False, False, wgmma=True).key_passes[0].bulk_dq

    assert [bulk(64), bulk(128)] == [_config._SM90_BULK_DQ[64], _config._SM90_BULK_DQ[128]] == [False, True]
    for forced in (False, True):
        with _config.sm90_bulk_dq(forced):
            assert [bulk(64), bulk(128)] == [forced, forced]
    assert _config.backward_plan("bfloat16", 128, 128, False, True, wgmma=True).key_passes[0].bulk_dq is False


def _probe_forms():
    """The persistent TMA forms with the probe switches on, at each head dim's scheduling (bf16):
    early_next everywhere, snake (with and without it) causal."""
    forms = []
    for d, (bc, stages, overlap, pingpong, _, _) in sorted(_config._SM90_FORWARD_TILES.items()):
        for early, snake, causals in ((True, False, (False, True)), (False, True, (True,)), (True, True, (True,))):
            with _config.sm90_tiles_override({d: (bc, stages, overlap, pingpong, True, True)}), \
                    _config.sm90_early_next_override({d: early}), _config.sm90_snake_override({d: snake}):
                for causal in causals:
                    for sparse in (False, True) if not snake else (False,):
                        forms.append(_config.forward_config("bfloat16", d, d, causal, sparse=sparse, wgmma=True, nq=4096))
    return forms


def test_probe_forms_build_within_budget():
    """Off by default (untimed), but a probe or a test may pick them: they must build for
    sm_90a within their spill allowance, with no serialized wgmma."""
    forms = _probe_forms()
    assert len({v.key for v in forms}) == len(forms) == 18
    assert all(v.loads_early or v.walks_snake for v in forms)
    reports = compile_check.check(["sm_90a"], forms, chunk=2)
    over = [(v.key, r["spill_stores"]) for v, _, r in reports if r["spill_stores"] > compile_check.spill_budget(v)]
    assert not over, over
    assert not [v.key for v, _, r in reports if _loader.serializes_wgmma(r)]


def test_probe_switches_apply_only_where_they_mean_something():
    import dataclasses

    variants = _config.all_variants(True, True)
    assert not any(getattr(v, "loads_early", False) or getattr(v, "walks_snake", False) for v in variants)
    with _config.sm90_early_next_override({128: True}), _config.sm90_snake_override({128: True}):
        long = _config.forward_config("bfloat16", 128, 128, True, wgmma=True, nq=2**20)
        short = _config.forward_config("bfloat16", 128, 128, True, wgmma=True, nq=1024)
    assert not long.persistent and not (long.early_next or long.snake)
    assert short.loads_early and short.walks_snake and short.key.endswith("_n1_z1")
    assert short.name_expression.endswith(", 0, true, true>")
    # The dispatcher's fallbacks: cp.async keeps the snake order but cannot load early; one
    # item a CTA has neither. Names and keys follow.
    cp_async = dataclasses.replace(short, tma=False)
    assert not cp_async.loads_early and cp_async.walks_snake
    assert cp_async.key.endswith("_z1") and cp_async.name_expression.endswith(", 0, false, true>")
    single = dataclasses.replace(short, persistent=False)
    assert not (single.loads_early or single.walks_snake) and single.name_expression.endswith(", 0>")
    with _config.sm90_early_next_override({128: True}):
        early_only = _config.forward_config("bfloat16", 128, 128, False, wgmma=True, nq=1024)
    assert early_only.key.endswith("_n1") and early_only.name_expression.endswith(", 0, true>")
