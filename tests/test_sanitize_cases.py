"""scripts/sanitize_cases.py without a GPU: shard arguments, the coverage line merged from the
shards' launched-variant lists, and its model of which run launches which variant against the
plan layer's own choice."""

import argparse
import contextlib
import types

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

    many = [c for c in cases_module.cases(subset) if c.slices == cases_module.MANY_ITEMS]
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
    dispatch with its choice functions, test_launched_by_is_what_the_plan_layer_builds checks it)."""
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


# ---- launched_by is the plan layer's choice ------------------------------------------------------

@pytest.fixture
def planned(monkeypatch, cases_module):
    """plan(case, form, subset): the variants cuflash's plans (cuflash/_forward.py,
    _backward.py, through cuflash/_spine.py) build for a run's forward and backwards, as the GPU
    run's coverage line records them (every get_kernel), on a stand-in H100: compute capability
    9.0 and sanitize_cases.SM_COUNT SMs, tensor maps encoded (the cases' inputs are ones the copy
    engine takes: their TMA forms ran), block-sparse tile lists kept on the host, kernels
    recorded instead of compiled."""
    from cuflash import _cache, _driver, _launch, _loader, _tma

    built = set()
    raw = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=1), max_dynamic_shared_size_bytes=0)
    monkeypatch.setattr(_loader, "get_kernel", lambda variant, device=None: built.add(variant) or raw)
    monkeypatch.setattr(_driver, "compute_capability", lambda device_id: "90")
    monkeypatch.setattr(_driver, "sm_count", lambda device_id: cases_module.SM_COUNT)
    monkeypatch.setattr(_driver, "device_context", lambda device_id: 0)
    monkeypatch.setattr(_driver, "device", lambda device_id: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "sparsity_fields", lambda *args, **kwargs: (_launch.DENSE_SPARSITY, None))
    monkeypatch.setattr(_tma, "encode", lambda *args: bytes(_tma.MAP_BYTES))

    def plan(case, form, subset):
        built.clear()
        _cache.clear()
        with cases_module._form(form):
            _build_plans(cases_module, case, subset)
        return set(built)

    yield plan
    _cache.clear()


def _strided(lead, heads, n, d):
    """(shape, element strides) of sanitize_cases.strided's (lead..., heads, n, d) view of a
    (lead..., n, heads, d) buffer."""
    shape = (*lead, heads, n, d)
    strides = (n * heads * d,) * len(lead) + (d, heads * d, 1)
    return shape, strides


def _build_plans(cases_module, case, subset):
    """The plans cuflash.attention and attention_backward build for a run_case (strided inputs,
    its mask and window; packed: run_varlen_case's layout, neither mask nor window), through cuflash/_spine.py as
    cuflash/_api.py calls it."""
    from cuflash import _spine, masks

    batch, hq, hkv = cases_module.slices_of(case, subset)
    ptrs = tuple(0x100000 * (i + 1) for i in range(5))  # aligned and apart
    varlen = None
    if case.varlen:
        lengths_q, lengths_k = zip(*cases_module.packed_lengths(case.nq, case.nk))
        lead, nq, nk = (), sum(lengths_q), sum(lengths_k)
        varlen = _spine.Varlen(len(cases_module.packed_boundaries(lengths_q)) - 1, case.nq, case.nk)
    else:
        lead, nq, nk = (batch,), case.nq, case.nk
    q, do, o = _strided(lead, hq, nq, case.d), _strided(lead, hq, nq, case.dv), _strided(lead, hq, nq, case.dv)
    k, v = _strided(lead, hkv, nk, case.d), _strided(lead, hkv, nk, case.dv)
    kwargs = cases_module.mask_kwargs(case, np.random.default_rng(0)) if case.sparse and not case.varlen else {}
    mask, window = kwargs.get("block_mask"), masks.window_option(kwargs.get("window"))
    stats = ((lead + (hq, nq), _spine.contiguous_strides(lead + (hq, nq)), "float32"),) * 2
    options = dict(causal=case.causal, mask=mask, window=window, varlen=varlen)
    shapes, strides = zip(q, k, v)
    _spine.forward(_spine.forward_problem(shapes, strides, (case.dtype,) * 3, 0, **options), ptrs[:3])
    shapes, strides = zip(do, q, k, v, o)
    for deterministic in (False, True) if case.dtype != "float32" else (False,):
        problem = _spine.backward_problem(shapes, strides, (case.dtype,) * 5, stats, 0, deterministic=deterministic,
                                          **options)
        _spine.backward(problem, ptrs)


@pytest.mark.parametrize("subset", ("all", "one"))
def test_launched_by_is_what_the_plan_layer_builds(cases_module, planned, subset):
    """For every run but decoding's (tested above), the variants launched_by predicts, on which
    the subset 'one' prunes its runs and the families test counts, are the ones the plan layer
    builds for it: what the GPU run's coverage line counts. Grouped forms on heads that are not
    grouped, or a reduce kernel for broadcast heads, fail here rather than as a family the GPU
    run missed."""
    runs = [(case, form) for case, form in cases_module.runs(subset, "9.0")
            if not isinstance(case, cases_module.DecodeCase)]
    assert any("grouped" in form for _, form in runs) and any(case.sparse == cases_module.EVERY_BLOCK
                                                               for case, _ in runs)
    for case, form in runs:
        assert cases_module.launched_by(case, form, subset, "9.0") == planned(case, form, subset), (case, form)
