"""Packed variable-length batches (cu_seqlens) on the GPU against the float64 reference.

Error rule as everywhere: the kernel's error against float64 at most 2x (gradients 3x) that of
plain attention in the same dtype, here computed sequence by sequence
(cuflash.reference.varlen) and compared over every row some sequence covers. Outputs are
poisoned first (the poisoned_pool fixture), so a covered row the kernels skip reads NaN.
"""

import numpy as np
import pytest

from conftest import HAS_WGMMA, requires_gpu
from gpu_util import DTYPES, head_group_forced, launched_variants, random_array, tma_refused, to_device
from varlen_util import boundaries, check_backward, check_forward, packed_inputs
from cuflash import reference as ref
from cuflash import _variants

pytestmark = [requires_gpu, pytest.mark.usefixtures("poisoned_pool")]


def run_forward(q, k, v, cu_q, cu_k, **kwargs):
    import cuflash

    return cuflash.attention(to_device(q), to_device(k), to_device(v), cu_seqlens_q=to_device(cu_q),
                             cu_seqlens_k=to_device(cu_k), **kwargs)


# Empty sequences, length 1, nq != nk, a query sequence against no key, lengths past a tile.
LENGTHS_Q = (1, 17, 0, 113, 9, 300)
LENGTHS_K = (17, 1, 5, 113, 0, 257)


@pytest.mark.parametrize("window", (None, (7, 0), (40, 13)), ids=("nowindow", "window7_0", "window40_13"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype,d", (("bfloat16", 64), ("float16", 128), ("bfloat16", 256), ("float16", 96),
                                     ("float32", 64)))
def test_forward(dtype, d, causal, window, rng):
    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, LENGTHS_Q, LENGTHS_K, d=d)
    out = run_forward(q, k, v, cu_q, cu_k, causal=causal, window=window, max_seqlen_q=300, max_seqlen_k=257)
    check_forward(out, q, k, v, cu_q, cu_k, dtype=dtype, causal=causal, window=window)


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype,d", (("bfloat16", 64), ("float16", 128), ("bfloat16", 256), ("float32", 64)))
def test_backward(dtype, d, causal, deterministic, rng):
    import cuflash

    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, LENGTHS_Q, LENGTHS_K, d=d)
    window = (50, 3) if causal else None
    out = run_forward(q, k, v, cu_q, cu_k, causal=causal, window=window)
    do = random_array(rng, out.o.shape, dtype)
    grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k), to_device(v), *out, causal=causal,
                                       window=window, deterministic=deterministic, cu_seqlens_q=to_device(cu_q),
                                       cu_seqlens_k=to_device(cu_k))
    check_backward(grads, do, q, k, v, cu_q, cu_k, dtype=dtype, causal=causal, window=window)


@pytest.mark.parametrize("hq,hk", ((4, 4), (6, 2), (4, 1)), ids=("mha", "gqa", "mqa"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_grouped_heads_forward_and_backward(dtype, hq, hk, rng):
    import cuflash

    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, (33, 1, 200), (64, 1, 190), hq=hq, hk=hk, d=128)
    out = run_forward(q, k, v, cu_q, cu_k, causal=True)
    check_forward(out, q, k, v, cu_q, cu_k, dtype=dtype, causal=True)
    do = random_array(rng, out.o.shape, dtype)
    grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k), to_device(v), *out, causal=True,
                                       cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k))
    check_backward(grads, do, q, k, v, cu_q, cu_k, dtype=dtype, causal=True)


@pytest.mark.skipif(not HAS_WGMMA, reason="the grouped key pass is the wgmma one")
@pytest.mark.parametrize("form", ("all", "half"), ids=("all_heads_a_cta", "half_the_heads_a_cta"))
@pytest.mark.parametrize("d", (64, 128))
def test_grouped_key_pass(d, form, rng):
    """A CTA walks every (or half of every) k/v group's query heads of its sequence."""
    import cuflash

    q, k, v, cu_q, cu_k = packed_inputs(rng, "bfloat16", (33, 1, 200, 129), (64, 1, 190, 300), hq=8, hk=2, d=d)
    out = run_forward(q, k, v, cu_q, cu_k, causal=True)
    do = random_array(rng, out.o.shape, "bfloat16")
    with head_group_forced(form) as chosen, launched_variants() as launched:
        grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k), to_device(v), *out, causal=True,
                                           cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k))
    assert chosen == [4 if form == "all" else 2]
    assert any(getattr(x, "grouped", False) and x.varlen for x in launched)
    check_backward(grads, do, q, k, v, cu_q, cu_k, dtype="bfloat16", causal=True)


@pytest.mark.parametrize("dtype,d", (("bfloat16", 64), ("float16", 128), ("bfloat16", 256), ("float32", 64)))
@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
def test_max_seqlen_below_the_longest_sequence_still_computes_it_whole(dtype, d, deterministic, rng):
    """A grid sized for 1 row a sequence: every CTA walks its sequence's further tiles."""
    import cuflash

    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, (700, 3, 130), (650, 300, 129), d=d)
    out = run_forward(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=1, max_seqlen_k=1)
    check_forward(out, q, k, v, cu_q, cu_k, dtype=dtype, causal=True)
    do = random_array(rng, out.o.shape, dtype)
    grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k), to_device(v), *out, causal=True,
                                       deterministic=deterministic, cu_seqlens_q=to_device(cu_q),
                                       cu_seqlens_k=to_device(cu_k), max_seqlen_q=1, max_seqlen_k=0)
    check_backward(grads, do, q, k, v, cu_q, cu_k, dtype=dtype, causal=True)


@pytest.mark.skipif(not HAS_WGMMA, reason="the persistent and tile-major varlen forms are the wgmma ones")
@pytest.mark.parametrize("longest", (500, 1000, 1100))
@pytest.mark.parametrize("d", (64, 128))
def test_wgmma_grids_of_long_and_short_sequences(d, longest, rng):
    """Up to 1024 rows (8 query tiles) the head-dim-64 forward is persistent (causal head dim
    128: up to 512 rows, _config.persistent_query_tiles): one CTA an SM
    walks (tile, sequence, head) items, skipping tiles a shorter sequence lacks; otherwise one
    item a CTA. The backward's grid of up to TILE_MAJOR_VARLEN_BACKWARD_TILES key tiles is read
    tile-major in groups of SLICE_GROUP slices (kernels/slice.cuh): here 3 sequences of
    SLICE_GROUP + 4 heads, 60 slices, three full groups and a short one. Every covered row is
    checked against float64, so a tile run twice or never shows there."""
    import cuflash
    from cuflash import _config, _constants, _variants

    heads = _constants.SLICE_GROUP + 4
    persistent = -(-longest // 128) <= _config.persistent_query_tiles(d, causal=True)
    # 1000 rows: the backward's grid is tile-major; 1100: not.
    assert -(-1000 // 128) <= _constants.TILE_MAJOR_VARLEN_BACKWARD_TILES < -(-1100 // 128)
    lengths = (longest, 0, 301)
    q, k, v, cu_q, cu_k = packed_inputs(rng, "bfloat16", lengths, lengths, hq=heads, hk=heads, d=d)
    with launched_variants() as launched:
        out = run_forward(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=longest, max_seqlen_k=longest)
        do = random_array(rng, out.o.shape, "bfloat16")
        grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k), to_device(v), *out,
                                           causal=True, cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k),
                                           max_seqlen_q=longest, max_seqlen_k=longest)
    forwards = [x for x in launched if isinstance(x, _variants.HopperForward)]
    assert forwards and all(x.varlen and x.persistent == persistent for x in forwards)
    assert any(isinstance(x, _variants.HopperBackward) and x.varlen for x in launched)
    check_forward(out, q, k, v, cu_q, cu_k, dtype="bfloat16", causal=True)
    check_backward(grads, do, q, k, v, cu_q, cu_k, dtype="bfloat16", causal=True)


def clean_rows(cu_q, cu_k, total_q, total_k):
    """Rows of the sequences whose query and key ranges no other sequence's overlap."""
    rows_q, rows_k = ref.sequence_rows(cu_q, total_q), ref.sequence_rows(cu_k, total_k)
    q_rows, k_rows = np.zeros(total_q, bool), np.zeros(total_k, bool)

    def overlaps(ranges, i):
        s, e = ranges[i]
        return any(j != i and s < e2 and s2 < e for j, (s2, e2) in enumerate(ranges))

    for i in range(len(rows_q)):
        if not overlaps(rows_q, i) and not overlaps(rows_k, i):
            q_rows[slice(*rows_q[i])] = True
            k_rows[slice(*rows_k[i])] = True
    return q_rows, k_rows


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_bad_boundaries_stay_in_bounds_and_leave_other_sequences_right(dtype, rng):
    """Boundaries past the end, negative, decreasing: clamped in the kernels (kernels/slice.cuh),
    so nothing outside the tensors is touched (a fault would fail the next CUDA call) and the
    sequences that no bad one overlaps come out as the reference computes them."""
    import cupy

    import cuflash

    total_q, total_k = 200, 180
    q = random_array(rng, (4, total_q, 64), dtype)
    k = random_array(rng, (2, total_k, 64), dtype)
    v = random_array(rng, (2, total_k, 64), dtype)
    # Sequence 0 is clean; 1 is overlapped by 3, which starts below 2's start (2 is empty); 4's
    # queries lie past the end (empty) while its keys run to the end; 5 ends before it starts.
    cu_q = np.array([0, 30, 90, 60, 10**9, 10**9 + 5, -7], np.int32)
    cu_k = np.array([0, 40, 100, 70, 150, 2**31 - 1, -2**31], np.int32)
    q_rows, k_rows = clean_rows(cu_q, cu_k, total_q, total_k)
    assert q_rows.sum() == 30 and k_rows.sum() == 40 + 30  # the test checks something
    out = run_forward(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=64, max_seqlen_k=64)
    check_forward(out, q, k, v, cu_q, cu_k, dtype=dtype, causal=True, rows=q_rows)
    do = random_array(rng, out.o.shape, dtype)
    grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k), to_device(v), *out, causal=True,
                                       cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k))
    cupy.cuda.runtime.deviceSynchronize()  # an out-of-bounds access would surface here
    check_backward(grads, do, q, k, v, cu_q, cu_k, dtype=dtype, causal=True, q_rows=q_rows, k_rows=k_rows)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_transposed_total_heads_views_are_read_in_place(dtype, rng):
    """(total, H, d) buffers, as flash_attn_varlen_func takes them, pass as .transpose(0, 1)."""
    import cuflash

    cu_q, cu_k = boundaries((50, 129, 1)), boundaries((70, 129, 3))
    qt = to_device(random_array(rng, (int(cu_q[-1]), 8, 128), dtype))
    kt = to_device(random_array(rng, (int(cu_k[-1]), 2, 128), dtype))
    vt = to_device(random_array(rng, (int(cu_k[-1]), 2, 128), dtype))
    q, k, v = qt.transpose(1, 0, 2), kt.transpose(1, 0, 2), vt.transpose(1, 0, 2)
    with launched_variants() as launched:
        out = cuflash.attention(q, k, v, causal=True, cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k))
    assert all(variant.varlen for variant in launched)
    if HAS_WGMMA:
        assert launched[0].tma  # the tensor maps take the strided views as they are
    host = [np.asarray(x.get()) for x in (q, k, v)]
    check_forward(out, *host, cu_q, cu_k, dtype=dtype, causal=True)
    do = to_device(random_array(rng, out.o.shape, dtype))
    with launched_variants() as launched:
        grads = cuflash.attention_backward(do, q, k, v, *out, causal=True, cu_seqlens_q=to_device(cu_q),
                                           cu_seqlens_k=to_device(cu_k))
    if HAS_WGMMA:  # the backward's maps too
        assert [x.tma for x in launched if isinstance(x, _variants.HopperBackward)] == [True]
    check_backward(grads, np.asarray(do.get()), *host, cu_q, cu_k, dtype=dtype, causal=True)


@pytest.mark.skipif(not HAS_WGMMA, reason="the wgmma kernels' cp.async forms")
def test_cp_async_form_where_the_copy_engine_cannot_map(rng):
    import cuflash

    q, k, v, cu_q, cu_k = packed_inputs(rng, "bfloat16", LENGTHS_Q, LENGTHS_K, d=128)
    do = random_array(rng, q.shape, "bfloat16")
    with tma_refused(), launched_variants() as launched:
        out = run_forward(q, k, v, cu_q, cu_k, causal=True)
        grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k), to_device(v), *out,
                                           causal=True, cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k))
    assert not launched[0].tma and launched[0].varlen
    key_passes = [x for x in launched if isinstance(x, _variants.HopperBackward)]
    assert key_passes and not any(x.tma for x in key_passes) and all(x.varlen for x in key_passes)
    check_forward(out, q, k, v, cu_q, cu_k, dtype="bfloat16", causal=True)
    check_backward(grads, do, q, k, v, cu_q, cu_k, dtype="bfloat16", causal=True)


def test_max_seqlen_none_is_computed_from_the_boundaries(rng):
    q, k, v, cu_q, cu_k = packed_inputs(rng, "bfloat16", (5, 400, 17), (9, 380, 1))
    given = run_forward(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=400, max_seqlen_k=380)
    computed = run_forward(q, k, v, cu_q, cu_k, causal=True)
    for a, b in zip(given, computed):
        np.testing.assert_array_equal(a.get(), b.get())


def test_no_sequences_and_no_keys(rng):
    import cuflash

    q, k, v, _, _ = packed_inputs(rng, "float16", (20,), (10,))
    out = run_forward(q, k, v, np.array([0], np.int32), np.array([0], np.int32))  # batch 0: nothing runs
    assert out.o.shape == (4, 20, 64) and out.l.shape == (4, 20)
    # queries against an empty key tensor: every row without keys
    k0, v0 = k[:, :0], v[:, :0]
    cu_q, cu_k = np.array([0, 20], np.int32), np.array([0, 0], np.int32)
    out = run_forward(q, k0, v0, cu_q, cu_k)
    check_forward(out, q, k0, v0, cu_q, cu_k, dtype="float16")
    do = random_array(rng, out.o.shape, "float16")
    grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k0), to_device(v0), *out,
                                       cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k))
    assert not np.any(grads.dq.get())


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype,d", (("bfloat16", 64), ("float16", 128), ("bfloat16", 256), ("float32", 64)))
def test_equal_lengths_give_the_dense_result_bit_for_bit(dtype, d, causal, rng):
    """B sequences of one length, packed, against the dense (B, H, N, d) call: the same tiles in
    the same order (the varlen forms differ only in where a slice lies), so o, l, m and the
    deterministic backward's gradients are bitwise equal; the atomic backward within the
    usual bound (its float atomics add in a different order run to run)."""
    import cupy

    import cuflash

    b, h, n = 3, 4, 300
    q, k, v = (random_array(rng, (b, h, n, d), dtype) for _ in range(3))
    do = random_array(rng, (b, h, n, d), dtype)
    dense = cuflash.attention(to_device(q), to_device(k), to_device(v), causal=causal)
    dense_grads = cuflash.attention_backward(to_device(do), to_device(q), to_device(k), to_device(v), *dense,
                                             causal=causal, deterministic=True)

    def packed(x):  # (B, H, N, d) -> (H, B N, d)
        return cupy.ascontiguousarray(to_device(x).transpose(1, 0, 2, 3).reshape(h, b * n, d))

    cu = to_device(boundaries((n,) * b))
    out = cuflash.attention(packed(q), packed(k), packed(v), causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                            max_seqlen_q=n, max_seqlen_k=n)
    for got, want in zip(out, dense):
        np.testing.assert_array_equal(got.get(), want.transpose(1, 0, *range(2, want.ndim)).reshape(got.shape).get())
    grads = cuflash.attention_backward(packed(do), packed(q), packed(k), packed(v), *out, causal=causal,
                                       deterministic=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
                                       max_seqlen_k=n)
    for got, want in zip(grads, dense_grads):
        np.testing.assert_array_equal(got.get(), packed(want.get()).get())


# ---- the torch adapter -------------------------------------------------------------------

# Not importorskip at module level: that would skip every test of this file where torch is
# missing, the CuPy ones above included.
try:
    import torch
except ImportError:
    torch = None
gpu_torch = pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs torch with CUDA")
TORCH_DTYPES = {name: getattr(torch, name) for name in ("float16", "bfloat16", "float32")} if torch else {}


def torch_packed(rng, dtype, lengths_q, lengths_k, hq=8, hk=2, d=64):
    """(total, H, d) tensors as flash_attn_varlen_func takes them, and their (H, total, d) views."""
    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype if dtype != "bfloat16" else "float32", lengths_q, lengths_k,
                                        hq=hq, hk=hk, d=d)
    tensors = [torch.tensor(x.astype(np.float32)).to("cuda", TORCH_DTYPES[dtype]).transpose(0, 1).contiguous()
               for x in (q, k, v)]
    views = [t.transpose(0, 1).requires_grad_() for t in tensors]
    host = [t.detach().float().cpu().numpy() for t in views]
    cus = [torch.tensor(c, device="cuda") for c in (cu_q, cu_k)]
    return views, host, cus, (cu_q, cu_k)


@gpu_torch
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_torch_autograd_against_the_reference(dtype, rng):
    import cuflash.torch as ct

    (q, k, v), host, (cu_q, cu_k), cus = torch_packed(rng, dtype, (1, 77, 0, 200), (5, 77, 3, 190))
    o = ct.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200,
                     max_seqlen_k=190)
    do = torch.randn_like(o)
    o.backward(do)
    rows = ref.covered_rows(cus[0], q.shape[1])
    exact = ref.varlen_attention(*host, *cus, causal=True)
    err = float(np.max(np.abs(o.detach().double().cpu().numpy()[:, rows] - exact.o[:, rows])))
    assert err < (1e-5 if dtype == "float32" else 2e-2)
    grads = [t.grad for t in (q, k, v)]
    check_backward([_CupyLike(g) for g in grads], do.float().cpu().numpy(), *host, *cus,
                   dtype=dtype if dtype == "float32" else "bfloat16", causal=True)


class _CupyLike:
    """A torch tensor with cupy's .get(), for gpu_util.to_host64."""

    def __init__(self, t):
        self.t = t

    def get(self):
        return self.t.detach().float().cpu().numpy()


@gpu_torch
def test_torch_deterministic_backward_repeats_bit_for_bit(rng):
    import cuflash.torch as ct

    (q, k, v), _, (cu_q, cu_k), _ = torch_packed(rng, "bfloat16", (129, 3, 64), (100, 3, 64))
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            o = ct.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            o.float().pow(2).sum().backward()
            runs.append([t.grad.clone() for t in (q, k, v)])
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@gpu_torch
def test_torch_compile_fullgraph(rng):
    import cuflash.torch as ct

    torch._dynamo.reset()
    (q, k, v), _, (cu_q, cu_k), _ = torch_packed(rng, "bfloat16", (40, 1, 90), (40, 7, 90))

    def step(q, k, v, cu_q, cu_k):
        return ct.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=90,
                            max_seqlen_k=90).float().pow(2).sum()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(q, k, v, cu_q, cu_k)
    loss.backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = step(q, k, v, cu_q, cu_k)
    eager.backward()
    assert abs(loss.item() - eager.item()) <= 1e-3 * abs(eager.item())
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=2e-2, atol=2e-2)


@gpu_torch
def test_torch_opcheck(rng):
    import cuflash.torch  # noqa: F401  (registers torch.ops.cuflash, whichever test ran before)

    (q, k, v), _, (cu_q, cu_k), _ = torch_packed(rng, "bfloat16", (48, 1, 30), (80, 2, 30))
    args = (q, k, v, True, None, None, -1, -1, cu_q, cu_k, 48, 80)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, args)
    with torch.no_grad():
        o, l, m = torch.ops.cuflash.attention_fwd(*args)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default,
                          (do, q.detach(), k.detach(), v.detach(), o, l, m, True, None, None, -1, -1, cu_q, cu_k,
                           -1, -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cu_seqlens_on_the_host_are_refused(dtype, rng):
    import cuflash

    q, k, v, cu_q, cu_k = packed_inputs(rng, dtype, (3,), (3,))
    with pytest.raises(TypeError, match="cu_seqlens_q is a NumPy array"):
        cuflash.attention(to_device(q), to_device(k), to_device(v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
