"""Packed variable-length batches on the CPU: the float64 reference against hand-padded dense
attention, the boundaries' clamping rule, the dispatcher's varlen variants, the plans' sizes,
and every argument check (the GPU tests are in test_varlen_gpu.py)."""

import numpy as np
import pytest

from cuflash import _checks, _config, _constants, _launch
from cuflash import reference as ref


def packed_batch(rng, lengths_q, lengths_k, hq=4, hk=2, d=16, dv=24):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((hq, cu_q[-1], d))
    k = rng.standard_normal((hk, cu_k[-1], d))
    v = rng.standard_normal((hk, cu_k[-1], dv))
    return q, k, v, cu_q, cu_k


def padded_mask(nq, nk, pad_q, pad_k, causal, window):
    """(pad_q, pad_k) mask of one sequence padded at the end: its own band, aligned at its own
    bottom right, written out element by element."""
    allowed = np.zeros((pad_q, pad_k), dtype=bool)
    for i in range(nq):
        for j in range(nk):
            centre = i + nk - nq
            ok = not causal or j <= centre
            if window is not None:
                left, right = window
                ok &= (left < 0 or j >= centre - left) and (right < 0 or j <= centre + right)
            allowed[i, j] = ok
    return allowed


def padded_reference(q, k, v, cu_q, cu_k, causal, window, do=None):
    """Every sequence padded to the longest into a dense (B, H, L, d) batch with its own mask."""
    rows_q, rows_k = ref.sequence_rows(cu_q, q.shape[1]), ref.sequence_rows(cu_k, k.shape[1])
    lq = max(1, max(e - s for s, e in rows_q))
    lk = max(1, max(e - s for s, e in rows_k))
    b = len(rows_q)
    qp = np.zeros((b, q.shape[0], lq, q.shape[2]))
    kp = np.zeros((b, k.shape[0], lk, k.shape[2]))
    vp = np.zeros((b, v.shape[0], lk, v.shape[2]))
    dop = np.zeros((b, q.shape[0], lq, v.shape[2]))
    mask = np.zeros((b, 1, lq, lk), dtype=bool)
    for i, ((qs, qe), (ks, ke)) in enumerate(zip(rows_q, rows_k)):
        qp[i, :, :qe - qs], kp[i, :, :ke - ks], vp[i, :, :ke - ks] = q[:, qs:qe], k[:, ks:ke], v[:, ks:ke]
        if do is not None:
            dop[i, :, :qe - qs] = do[:, qs:qe]
        mask[i, 0] = padded_mask(qe - qs, ke - ks, lq, lk, causal, window)
    if do is None:
        return ref.standard_attention(qp, kp, vp, mask=mask), rows_q
    return ref.standard_attention_backward(dop, qp, kp, vp, mask=mask), rows_q, rows_k


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("window", (None, (5, 0), (3, 7)))
def test_reference_equals_hand_padded_dense_attention(causal, window):
    rng = np.random.default_rng(17)
    lengths_q, lengths_k = [1, 17, 0, 9, 13], [5, 17, 4, 0, 21]  # nq != nk, empty, length 1
    q, k, v, cu_q, cu_k = packed_batch(rng, lengths_q, lengths_k)
    got = ref.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window=window)
    want, rows_q = padded_reference(q, k, v, cu_q, cu_k, causal, window)
    assert got.o.shape == (4, cu_q[-1], 24) and got.l.shape == got.m.shape == (4, cu_q[-1])
    for i, (qs, qe) in enumerate(rows_q):
        np.testing.assert_allclose(got.o[:, qs:qe], want.o[i, :, :qe - qs], atol=1e-12)
        np.testing.assert_allclose(got.l[:, qs:qe], want.l[i, :, :qe - qs], atol=1e-12)
        # m is a largest score: the two sides' matmuls differ in shape, and BLAS may sum their
        # dot products in different orders (one ulp apart on some machines), so a few ulps of
        # the O(1) scores, not bit equality; -inf (no key) still has to match exactly.
        np.testing.assert_allclose(got.m[:, qs:qe], want.m[i, :, :qe - qs], rtol=1e-13, atol=1e-13)
    # the sequence of one query against no key: o = 0, l = 0, m = -inf
    qs = cu_q[3]
    assert np.all(got.o[:, qs:qs + 9] == 0) and np.all(got.l[:, qs:qs + 9] == 0)
    assert np.all(np.isneginf(got.m[:, qs:qs + 9]))


@pytest.mark.parametrize("causal", (False, True))
def test_reference_backward_equals_hand_padded_dense_backward(causal):
    rng = np.random.default_rng(113)
    q, k, v, cu_q, cu_k = packed_batch(rng, [3, 1, 11, 0], [7, 1, 11, 2])
    do = rng.standard_normal((q.shape[0], q.shape[1], v.shape[2]))
    got = ref.varlen_attention_backward(do, q, k, v, cu_q, cu_k, causal=causal, window=(4, -1))
    (dq, dk, dv), rows_q, rows_k = padded_reference(q, k, v, cu_q, cu_k, causal, (4, -1), do=do)
    assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
    for i, ((qs, qe), (ks, ke)) in enumerate(zip(rows_q, rows_k)):
        np.testing.assert_allclose(got[0][:, qs:qe], dq[i, :, :qe - qs], atol=1e-12)
        np.testing.assert_allclose(got[1][:, ks:ke], dk[i, :, :ke - ks], atol=1e-12)
        np.testing.assert_allclose(got[2][:, ks:ke], dv[i, :, :ke - ks], atol=1e-12)
    assert np.all(got[1][:, rows_k[3][0]:rows_k[3][1]] == 0)  # keys no query of theirs has


def test_boundaries_are_clamped_and_reversed_ranges_are_empty():
    assert ref.sequence_rows([-5, 3, 10, 7, 99], 12) == [(0, 3), (3, 10), (10, 10), (7, 12)]
    assert ref.sequence_rows([0], 4) == []
    np.testing.assert_array_equal(ref.covered_rows([2, 4, 4, 5], 7), [0, 0, 1, 1, 1, 0, 0])


def test_statistics_regions_of_sequences_never_overlap_and_fit_the_pitch():
    """slice_geometry's rule: sequence s starts at R (ceil(start / R) + s) and owns
    round_up(n, R) rows; _launch.varlen_stats_rows is the pitch they must fit in."""
    r = _constants.STATS_ROW_MULTIPLE
    rng = np.random.default_rng(5)
    for _ in range(200):
        lengths = rng.integers(0, 3 * r, size=rng.integers(1, 9))
        cu = np.concatenate([[0], np.cumsum(lengths)])
        total = int(cu[-1]) + int(rng.integers(0, 2 * r))  # rows past the last sequence, too
        if rng.random() < 0.3:  # bad boundaries: clamping keeps every region inside the pitch
            cu = rng.integers(-r, total + r, size=cu.size)
        end_before = 0
        for s, (start, end) in enumerate(ref.sequence_rows(cu, total)):
            first = r * (-(-start // r) + s)
            last = first + -(-(end - start) // r) * r
            assert last <= _launch.varlen_stats_rows(total, len(cu) - 1)
            if np.all(np.diff(cu) >= 0):
                assert first >= end_before
            end_before = last


def test_varlen_grid_covers_the_announced_longest_sequence():
    assert _launch.grid_tiles(1000, 5000, 128) == 8
    assert _launch.grid_tiles(10**9, 300, 128) == 3  # never more than the packed rows hold
    assert _launch.grid_tiles(0, 300, 128) == 1


@pytest.mark.parametrize("wgmma", (False, True))
@pytest.mark.parametrize("dtype", _constants.SUPPORTED_DTYPES)
def test_varlen_variants_are_listed_and_persistent_where_measured(wgmma, dtype):
    listed = {v.key for v in _config.all_variants(hopper=True, wgmma=wgmma)}
    for d in (64, 128, 256, 96):
        for causal in (False, True):
            for nq in (1, 512, 2**20):
                variant = _config.forward_config(dtype, d, d, causal, wgmma=wgmma, nq=nq, varlen=True)
                assert variant.varlen and variant.key.endswith("varlen") and variant.key in listed
                # persistent as a dense batch of the longest sequence
                dense = _config.forward_config(dtype, d, d, causal, wgmma=wgmma, nq=nq)
                want = getattr(dense, "persistent", False)
                assert getattr(variant, "persistent", False) == want
                assert not getattr(variant, "sparse", False)
            for deterministic in (False, True):
                plan = _config.backward_plan(dtype, d, d, causal, deterministic, wgmma=wgmma, varlen=True)
                kernels = [plan.preprocess, *plan.key_passes] + ([plan.dq] if plan.dq else [])
                assert all(k.varlen and k.key in listed for k in kernels)
                assert (plan.dq is not None) == (deterministic or dtype == "float32")


def test_dense_variants_stay_dense():
    assert not _config.forward_config("bfloat16", 128, 128, True, wgmma=True, nq=1024).varlen
    plan = _config.backward_plan("bfloat16", 128, 128, True, False, wgmma=True)
    assert not any(k.varlen for k in (plan.preprocess, *plan.key_passes))


# ---- argument checks ---------------------------------------------------------------------


def test_shapes_must_have_three_dims():
    with pytest.raises(ValueError, match=r"q must have shape \(heads, total_tokens, head_dim\).*\(2, 4, 10, 64\)"):
        _checks.check_varlen_shapes((2, 4, 10, 64), (4, 10, 64), (4, 10, 64))
    with pytest.raises(ValueError, match=r"v must have shape.*\(10, 64\)"):
        _checks.check_varlen_shapes((4, 10, 64), (4, 10, 64), (10, 64))


CU = ((5,), "int32", 0)


@pytest.mark.parametrize("cu_q,cu_k,match", (
    (CU, None, "only cu_seqlens_q was given"),
    (None, CU, "only cu_seqlens_k was given"),
    (((5,), "int64", 0), CU, r"cu_seqlens_q must be a 1-D int32 array.*\(5,\), dtype int64"),
    (CU, ((5, 1), "int32", 0), r"cu_seqlens_k must be a 1-D int32 array.*\(5, 1\)"),
    (CU, ((0,), "int32", 0), r"cu_seqlens_k must be a 1-D int32 array of length batch \+ 1.*\(0,\)"),
    (CU, ((5,), "int32", 1), "cu_seqlens_k must be on q's device 0, got device 1"),
    (CU, ((4,), "int32", 0), r"one length \(batch \+ 1\), got shapes \(5,\) and \(4,\)"),
))
def test_cu_seqlens_errors_name_the_argument(cu_q, cu_k, match):
    with pytest.raises(ValueError, match=match):
        _checks.check_cu_seqlens(cu_q, cu_k, 0)


def test_cu_seqlens_give_the_batch():
    assert _checks.check_cu_seqlens(CU, CU, 0) == 4
    assert _checks.check_cu_seqlens(((1,), "int32", 0), ((1,), "int32", 0), 0) == 0


def test_max_seqlen_must_be_a_host_int():
    assert _checks.check_max_seqlen("max_seqlen_q", None) is None
    assert _checks.check_max_seqlen("max_seqlen_q", np.int64(7)) == 7
    with pytest.raises(ValueError, match="max_seqlen_k must be >= 0, got -1"):
        _checks.check_max_seqlen("max_seqlen_k", -1)
    for bad in (True, 3.0, "8", np.ones(1)):
        with pytest.raises(TypeError, match="max_seqlen_q must be a host int"):
            _checks.check_max_seqlen("max_seqlen_q", bad)


def test_block_mask_and_decoding_arguments_are_refused():
    with pytest.raises(ValueError, match="block_mask cannot be combined with cu_seqlens"):
        _checks.check_varlen_options(block_mask=object())
    with pytest.raises(ValueError, match="page_table, num_splits .*cannot be combined with cu_seqlens"):
        _checks.check_varlen_options(page_table=object(), num_splits=2)
    with pytest.raises(ValueError, match="seqlens_k .*cannot be combined"):
        _checks.check_varlen_options(seqlens_k=object())


class TestTorchAdapterChecks:
    """cuflash.torch.attention checks its varlen arguments before anything reaches a GPU."""

    @pytest.fixture(autouse=True)
    def _torch(self):
        # Here, not in the class body: importorskip at collection would skip the whole module.
        self.torch = pytest.importorskip("torch")

    def args(self, cu_dtype=None):
        torch = self.torch
        q = torch.zeros(4, 10, 64, dtype=torch.float16)
        cu = torch.tensor([0, 4, 10], dtype=cu_dtype or torch.int32)
        return q, cu

    def test_dtype_and_pairing(self):
        import cuflash.torch as ct

        q, cu = self.args(self.torch.int64)
        with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 array.*int64"):
            ct.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)
        q, cu = self.args()
        with pytest.raises(ValueError, match="only cu_seqlens_q was given"):
            ct.attention(q, q, q, cu_seqlens_q=cu)

    def test_refused_combinations_and_max_seqlen(self):
        import cuflash.torch as ct
        from cuflash import masks

        q, cu = self.args()
        with pytest.raises(ValueError, match="block_mask cannot be combined"):
            ct.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, block_mask=masks.butterfly(2))
        with pytest.raises(ValueError, match="num_splits .*cannot be combined"):
            ct.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, num_splits=2)
        with pytest.raises(TypeError, match="max_seqlen_k must be a host int"):
            ct.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=4.0)

    def test_cpu_tensors_are_refused_after_the_checks(self):
        import cuflash.torch as ct

        q, cu = self.args()
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            ct.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)

    def test_fake_tensors_give_the_packed_shapes(self):
        torch = self.torch
        import cuflash.torch as ct
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            q = torch.empty(8, 37, 64, dtype=torch.bfloat16, device="cuda")
            k = torch.empty(2, 50, 64, dtype=torch.bfloat16, device="cuda")
            v = torch.empty(2, 50, 32, dtype=torch.bfloat16, device="cuda")
            cu = torch.empty(4, dtype=torch.int32, device="cuda")
            o, l, m = ct._attention_fwd(q, k, v, True, None, None, -1, -1, cu, cu, 20, 30)
            dq, dk, dv = ct._attention_bwd(o, q, k, v, o, l, m, True, None, None, -1, -1, cu, cu, 20, 30)
        assert tuple(o.shape) == (8, 37, 32) and tuple(l.shape) == tuple(m.shape) == (8, 37)
        assert l.dtype == torch.float32 and o.dtype == torch.bfloat16
        assert [tuple(g.shape) for g in (dq, dk, dv)] == [(8, 37, 64), (2, 50, 64), (2, 50, 32)]
