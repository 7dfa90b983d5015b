"""scripts/sanitize_cases.py without a GPU: shard arguments, and the coverage line merged from
the shards' launched-variant lists."""

import argparse

import numpy as np
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def cases_module():
    return load_script("sanitize_cases")


def test_shard_argument(cases_module):
    assert cases_module.shard("0/4") == (0, 4) and cases_module.shard("3/4") == (3, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(argparse.ArgumentTypeError):
            cases_module.shard(bad)


def test_coverage_line(cases_module):
    known = {"a", "b", "c"}
    assert cases_module.coverage_line(known, {"a", "b", "c"}) == "covered 3 of 3 dispatcher variants"
    line = cases_module.coverage_line(known, {"a", "x"})
    assert line.startswith("covered 1 of 3") and "1 more not in" in line and line.endswith("missing: b, c")


@pytest.mark.parametrize("subset", ("all", "one"))
def test_decode_cases_reach_every_decode_variant(cases_module, subset):
    from cuflash import _config, _variants

    reached = {_config.decode_config(c.dtype, c.d, c.d, c.page_size is not None, c.heads[0] // c.heads[1] * c.nq,
                                     cases_module.DECODE_BATCH * c.heads[1], cases_module.DECODE_CAPACITY, 132).key
               for c in cases_module.decode_cases(subset)}
    assert reached == {v.key for v in _config.all_decode_variants() if isinstance(v, _variants.SplitKvDecode)}
    assert all(any(c.num_splits == 3 and c.dtype == dtype for c in cases_module.decode_cases(subset))
               for dtype in ("float16", "bfloat16"))  # both combines run


@pytest.mark.parametrize("subset", ("all", "one"))
def test_a_case_walks_several_items_a_persistent_key_pass_cta(cases_module, subset):
    """Under every tool, the persistent wgmma key pass gets enough (key tile, slice) items that
    each of its CTAs walks several and refills both K, V buffers (on an H100 / H200's 132 SMs)."""
    from cuflash import _config

    many = [c for c in cases_module.cases(subset) if c.slices]
    assert {c.dtype for c in many} == {"float16", "bfloat16"}
    for c in many:
        batch, hq, hkv = c.slices
        key_pass = _config.backward_plan(c.dtype, c.d, c.dv, c.causal, False, wgmma=True).key_passes[0]
        assert key_pass.persistent and hq == hkv  # not grouped: the persistent form
        assert batch * hq * -(-c.nk // key_pass.block_cols) >= 5 * 132


# ---- every family of the variant enumeration has a case -----------------------------------------

@pytest.mark.parametrize("arch", ("8.0", "9.0"))
@pytest.mark.parametrize("subset", ("all", "one"))
def test_the_runs_reach_every_family_of_the_enumeration(cases_module, subset, arch):
    """Every family (sanitize_cases.family) of _config.variants_for(arch) has a run that
    launches one of its variants: a new kernel, or a new form flag of one, fails here until a
    case reaches it. The runs' variants are all enumerated ones (launched_by models the
    dispatch with its own choice functions)."""
    from cuflash import _config

    enumerated = set(_config.variants_for(arch))
    launched = set()
    for case, form in cases_module.runs(subset, arch):
        launched |= cases_module.launched_by(case, form, subset, arch)
    assert launched <= enumerated, sorted(v.key for v in launched - enumerated)
    missing = {cases_module.family(v) for v in enumerated} - {cases_module.family(v) for v in launched}
    assert not missing, sorted(missing)


def test_families_name_kind_dtype_and_form_flags(cases_module):
    from cuflash import _variants

    key_pass = _variants.HopperBackward("bfloat16", 128, True, True, varlen=True, grouped=True, tma=True)
    assert cases_module.family(key_pass) == "bwd_sm90 bfloat16 grouped tma varlen"
    assert cases_module.family(_variants.Float32Forward(2, causal=True, sparse=True)) == "fwd float32 sparse"
    line = cases_module.families_line([key_pass, _variants.GradientReduce("float32")], {key_pass.key})
    assert line == "families covered 1 of 2; families missing: grad_reduce float32"


@pytest.mark.parametrize("subset", ("all", "one"))
def test_packed_cases_cover_every_head_dim_and_clamp_their_boundaries(cases_module, subset):
    from cuflash import _tiles

    packed = [c for c in cases_module.cases(subset) if c.varlen]
    for dtype in ("float16", "bfloat16"):
        assert {c.d for c in packed if c.dtype == dtype} == set(_tiles.HEAD_DIM_BUCKETS)
    lengths = cases_module.packed_lengths(131, 77)
    assert (0, 1) in lengths and (1, 0) in lengths and max(lengths) == (131, 77)
    cu = cases_module.packed_boundaries([q for q, _ in lengths])
    assert cu[0] < 0 and cu[-1] > sum(q for q, _ in lengths) and (np.diff(cu[1:-1]) >= 0).all()
