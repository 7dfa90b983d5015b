"""scripts/sanitize_cases.py without a GPU: shard arguments, and the coverage line merged from
the shards' launched-variant lists."""

import argparse

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
