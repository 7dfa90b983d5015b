"""The wgmma backward key pass (kernels/flash_bwd_sm90.cu, the default on Hopper) on an
H100/H200, against the float64 reference with the dense tests' error rule, with dQ added by
vector atomics (head dim 64) and by bulk reductions (128). Skipped elsewhere."""

import contextlib

import pytest

from conftest import requires_gpu, requires_wgmma
from cuflash import _config, _variants
from cuflash import masks as M
from cuflash import reference as ref
from gpu_util import (check_backward, check_forward, head_group_forced, launched_variants, random_array, to_device,
                      tma_refused)

pytestmark = [requires_gpu, requires_wgmma, pytest.mark.usefixtures("poisoned_pool")]


def run_checked(q, k, v, do, *, dtype, causal=False, deterministic=False, mask=None, **options):
    import cuflash

    q_d, k_d, v_d, do_d = (to_device(x) for x in (q, k, v, do))
    with _config.wgmma_backward(True):
        out = cuflash.attention(q_d, k_d, v_d, causal=causal, **options)
        grads = cuflash.attention_backward(do_d, q_d, k_d, v_d, *out, causal=causal,
                                           deterministic=deterministic, **options)
    check_forward(out, q, k, v, causal=causal, dtype=dtype, mask=mask)
    check_backward(grads, do, q, k, v, causal=causal, dtype=dtype, mask=mask)


def test_dispatcher_picks_it_only_when_on():
    plan = _config.backward_plan("bfloat16", 128, 128, False, False, wgmma=True, wgmma_backward_on=True)
    assert isinstance(plan.key_passes[0], _variants.HopperBackward)
    plan = _config.backward_plan("bfloat16", 128, 128, False, False, wgmma=True, wgmma_backward_on=False)
    assert not isinstance(plan.key_passes[0], _variants.HopperBackward)


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_lengths(dtype, d, causal, deterministic, rng):
    for nq, nk in ((1, 1), (63, 65), (200, 129), (129, 300), (1000, 1000)):
        q = random_array(rng, (1, 2, nq, d), dtype)
        k, v = (random_array(rng, (1, 2, nk, d), dtype) for _ in range(2))
        do = random_array(rng, (1, 2, nq, d), dtype)
        run_checked(q, k, v, do, dtype=dtype, causal=causal, deterministic=deterministic)


@pytest.mark.parametrize("loads", ("tma", "cp.async"))
@pytest.mark.parametrize("d", (64, 128))
def test_every_load_form(d, loads, rng):
    """The key pass loading through TMA (the default: one thread copies K, V, Q, dO and the
    statistics) and through cp.async where the copy engine cannot map the inputs; one query
    head a CTA and every query head of a k/v head a CTA (the maps' slice for each head in
    turn). The inputs are (batch, heads, seq, d) views of (batch, seq, heads, d) arrays, so the
    maps' slice strides are the heads' and their rows strided; both ends of the sequences are
    ragged tiles."""
    import cupy

    import cuflash

    dtype = "bfloat16"
    q, do = (random_array(rng, (2, 8, 300, d), dtype) for _ in range(2))
    k, v = (random_array(rng, (2, 2, 200, d), dtype) for _ in range(2))

    def heads_inside(x):  # the same values as a view of a (batch, seq, heads, d) array
        return cupy.ascontiguousarray(to_device(x).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    for form in (None, "all"):
        refused = tma_refused() if loads == "cp.async" else contextlib.nullcontext()
        with head_group_forced(form), launched_variants() as launched, refused, _config.wgmma_backward(True):
            q_d, k_d, v_d, do_d = (heads_inside(x) for x in (q, k, v, do))
            assert not q_d.flags.c_contiguous
            out = cuflash.attention(q_d, k_d, v_d, causal=True)
            grads = cuflash.attention_backward(do_d, q_d, k_d, v_d, *out, causal=True)
        check_forward(out, q, k, v, causal=True, dtype=dtype)
        check_backward(grads, do, q, k, v, causal=True, dtype=dtype)
        forms = {(x.tma, x.grouped) for x in launched if isinstance(x, _variants.HopperBackward)}
        assert forms == {(loads == "tma", form is not None)}


@pytest.mark.parametrize("form", (None, "all", "half"), ids=("rule", "all_heads_a_cta", "half_the_heads_a_cta"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("d", (64, 128))
def test_grouped_heads(d, causal, form, rng):
    """GQA: a CTA walks every query head of its k/v head (dK, dV written once, in bf16), half
    of them (two float32 partial sums a k/v head, then grad_reduce.cu), or what the rule picks
    for this small shape (one head a CTA)."""
    dtype = "bfloat16"
    q, do = (random_array(rng, (2, 8, 300, d), dtype) for _ in range(2))
    k, v = (random_array(rng, (2, 2, 300, d), dtype) for _ in range(2))
    with head_group_forced(form) as chosen, launched_variants() as launched:
        run_checked(q, k, v, do, dtype=dtype, causal=causal)
    assert chosen == [{None: 1, "all": 4, "half": 2}[form]]
    grouped = [x for x in launched if isinstance(x, _variants.HopperBackward) and x.grouped]
    assert len(grouped) == (form is not None)
    reduces = [x for x in launched if isinstance(x, _variants.GradientReduce)]
    assert len(reduces) == {None: 3, "all": 1, "half": 3}[form]  # dQ always; dK, dV unless summed whole


@pytest.mark.parametrize("d", (64, 128))
def test_windows_and_block_masks(d, rng):
    dtype = "bfloat16"
    n = 1100
    q, k, v, do = (random_array(rng, (1, 2, n, d), dtype) for _ in range(4))
    window = (150, 40)
    run_checked(q, k, v, do, dtype=dtype, window=window, mask=ref.element_mask(n, n, window=window))
    tq = -(-n // 100)
    blocks = M.BlockMask.from_dense(M.butterfly(16).to_dense()[:tq, :tq], 100)
    run_checked(q, k, v, do, dtype=dtype, causal=True, block_mask=blocks, mask=ref.element_mask(n, n, block_mask=blocks))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("d", (64, 128), ids=("one_warpgroup_d64", "two_warpgroups_d128"))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_atomic_dq_forms(dtype, d, causal, rng):
    """Atomic dQ's tile, added by the copy engine's bulk reductions, in the form of each head
    dim (warpgroup 1 alone at 64, both at 128): ragged last query tiles (only their rows are
    added), many query tiles a CTA (the tile buffer's reuse), grouped heads."""
    assert _config.backward_plan(dtype, d, d, causal, False, wgmma=True).key_passes[0].atomic_dq
    for nq, nk in ((1, 1), (63, 65), (200, 129), (1000, 1000)):
        q, do = (random_array(rng, (2, 4, nq, d), dtype) for _ in range(2))
        k, v = (random_array(rng, (2, 2, nk, d), dtype) for _ in range(2))
        run_checked(q, k, v, do, dtype=dtype, causal=causal)


@pytest.mark.parametrize("d", (64, 128))
def test_causal_grids_walk_groups_of_slices_tile_by_tile(d, rng):
    """Causal dense grids start their CTAs tile by tile in groups of SLICE_GROUP slices
    (grid_cell, kernels/slice.cuh). Four heads more than a group make one full group and a
    short one; 1100 rows are 9 key tiles of the backward and 9 query tiles of the forward, one
    more than the persistent forward takes, so both kernels take that order. Every tile of every
    head is checked against float64: a tile run twice or never shows there."""
    from cuflash import _constants

    heads = _constants.SLICE_GROUP + 4
    assert 1100 // 128 + 1 <= min(_constants.TILE_MAJOR_FORWARD_TILES, _constants.TILE_MAJOR_BACKWARD_TILES)
    dtype = "bfloat16"
    q, k, v, do = (random_array(rng, (1, heads, 1100, d), dtype) for _ in range(4))
    with launched_variants() as launched:
        run_checked(q, k, v, do, dtype=dtype, causal=True)
    forwards = [x for x in launched if isinstance(x, _variants.HopperForward)]
    backwards = [x for x in launched if isinstance(x, _variants.HopperBackward)]
    assert forwards and not any(x.persistent for x in forwards) and all(x.causal for x in forwards)
    assert backwards and all(x.causal and not x.varlen for x in backwards)


def test_persistent_key_pass_walks_many_items_a_cta(rng):
    """The persistent key pass (head dim 64, not causal: _tiles.SM90_PERSISTENT_BACKWARD_DIMS):
    3 key tiles (the last ragged) x 332 heads are 996 items, 7-8 a CTA on 132 SMs, so each of
    its two K, V buffers is refilled several times (their release barriers' phases turn over)
    while the ring of query tiles counts on across items; fewer queries than keys, ragged too."""
    dtype = "bfloat16"
    q, do = (random_array(rng, (4, 83, 250, 64), dtype) for _ in range(2))
    k, v = (random_array(rng, (4, 83, 300, 64), dtype) for _ in range(2))
    with launched_variants() as launched:
        run_checked(q, k, v, do, dtype=dtype)
    backwards = [x for x in launched if isinstance(x, _variants.HopperBackward)]
    assert backwards and all(x.persistent and not x.causal for x in backwards)
