"""CPU tests of cuflash.reference, the float64 oracle for the GPU kernels."""

import itertools
import zlib

import numpy as np
import pytest

from cuflash import reference as ref

SIZES = (1, 17, 64, 113, 130)
BLOCKS = ((16, 16), (32, 8), (7, 13), (64, 64))
RTOL, ATOL = 1e-10, 1e-12


@pytest.fixture(autouse=True)
def no_float_warnings():
    """Any divide-by-zero, overflow or invalid op (NaN) is a test failure.

    Underflow is allowed: exp of a very negative score is meant to be 0.
    """
    with np.errstate(divide="raise", over="raise", invalid="raise", under="ignore"):
        yield


def rng_for(*key):
    """A generator seeded from the test's parameters: fresh data per case."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def random_qkv(rng, q_shape, k_shape, v_shape, spread=1.0):
    q = rng.standard_normal(q_shape) * spread
    k = rng.standard_normal(k_shape) * spread
    v = rng.standard_normal(v_shape)
    return q, k, v


def assert_outputs_close(got, want, rtol=RTOL, atol=ATOL):
    for name in ("o", "l", "m"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape, name
        assert not np.isnan(g).any(), name
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)


def assert_grads_close(got, want, rtol=1e-9, atol=1e-11):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)


def masked_logsumexp(s, allowed):
    """log(sum(exp(s))) over allowed entries, via np.logaddexp -- not via max/l."""
    return np.logaddexp.reduce(np.where(allowed, s, -np.inf), axis=-1)


# --------------------------------------------------------------------------
# The conventions themselves, checked against the literal definitions
# --------------------------------------------------------------------------


def test_causal_mask_is_bottom_right_aligned():
    # flash-attention >= 2.1 examples: Nq = 2, Nk = 5 and Nq = 5, Nk = 2.
    np.testing.assert_array_equal(
        ref.allowed_keys(2, 5, causal=True), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    )
    np.testing.assert_array_equal(
        ref.allowed_keys(5, 2, causal=True), [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    )
    for nq, nk in itertools.product(SIZES, SIZES):
        brute = [[j <= i + (nk - nq) for j in range(nk)] for i in range(nq)]
        np.testing.assert_array_equal(ref.allowed_keys(nq, nk, causal=True), brute)


@pytest.mark.parametrize("causal", [False, True])
def test_standard_attention_matches_row_by_row_definition(causal):
    rng = rng_for("naive", causal)
    nq, nk, scale = 13, 9, 0.4
    q, k, v = random_qkv(rng, (nq, 5), (nk, 5), (nk, 3), spread=2.0)
    mask = rng.random((nq, nk)) < 0.6
    mask[2] = False
    out = ref.standard_attention(q, k, v, causal=causal, scale=scale, mask=mask)
    for i in range(nq):
        keys = [j for j in range(nk) if mask[i, j] and (not causal or j <= i + nk - nq)]
        if not keys:
            assert out.m[i] == -np.inf and out.l[i] == 0 and np.all(out.o[i] == 0)
            continue
        scores = {j: scale * float(q[i] @ k[j]) for j in keys}
        m = max(scores.values())
        weights = {j: np.exp(scores[j] - m) for j in keys}
        l = sum(weights.values())
        o = sum(weights[j] / l * v[j] for j in keys)
        np.testing.assert_allclose([out.m[i], out.l[i]], [m, l], rtol=1e-13)
        np.testing.assert_allclose(out.o[i], o, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------
# Forward: tiled == standard
# --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", list(itertools.product(SIZES, SIZES)))
def test_forward_tiled_matches_standard(nq, nk, causal):
    rng = rng_for("fwd", nq, nk, causal)
    q, k, v = random_qkv(rng, (nq, 8), (nk, 8), (nk, 5), spread=1.5)
    want = ref.standard_attention(q, k, v, causal=causal)
    for block_rows, block_cols in BLOCKS:
        got = ref.flash_forward_tiled(q, k, v, causal=causal, block_rows=block_rows, block_cols=block_cols)
        assert_outputs_close(got, want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(17, 17), (64, 130), (130, 64), (113, 1), (1, 113)])
def test_forward_tiled_matches_standard_with_mask(nq, nk, causal):
    rng = rng_for("mask", nq, nk, causal)
    q, k, v = random_qkv(rng, (2, 3, nq, 6), (2, 3, nk, 6), (2, 3, nk, 9))
    mask = rng.random((2, 3, nq, nk)) < 0.7
    mask[0, 1, nq // 2] = False  # a fully masked row
    mask[1, :, 0] = False  # fully masked first row in every head of batch 1
    scale = rng.uniform(0.1, 1.0)
    want = ref.standard_attention(q, k, v, causal=causal, scale=scale, mask=mask)
    assert np.all(want.m[0, 1, nq // 2] == -np.inf)
    assert np.all(want.o[1, :, 0] == 0)
    for block_rows, block_cols in BLOCKS:
        got = ref.flash_forward_tiled(
            q, k, v, causal=causal, scale=scale, mask=mask, block_rows=block_rows, block_cols=block_cols
        )
        assert_outputs_close(got, want)


def test_forward_mask_broadcasts_over_batch():
    rng = rng_for("mask-broadcast")
    q, k, v = random_qkv(rng, (2, 4, 20, 8), (2, 4, 33, 8), (2, 4, 33, 8))
    key_padding = rng.random((2, 1, 1, 33)) < 0.8  # per-batch key padding
    key_padding[1, ..., :] = False  # batch 1 sees nothing at all
    want = ref.standard_attention(q, k, v, mask=key_padding, causal=True)
    got = ref.flash_forward_tiled(q, k, v, mask=key_padding, causal=True, block_rows=8, block_cols=16)
    assert_outputs_close(got, want)
    assert np.all(got.o[1] == 0) and np.all(got.l[1] == 0) and np.all(got.m[1] == -np.inf)
    # Same result as applying the mask head by head.
    for b, h in np.ndindex(2, 4):
        one = ref.standard_attention(q[b, h], k[b, h], v[b, h], mask=key_padding[b, 0], causal=True)
        assert_outputs_close(ref.ReferenceOutput(want.o[b, h], want.l[b, h], want.m[b, h]), one)


@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,batch_shape,kv_index",
    [
        # grouped-query heads: Hq = 6, Hk = 3, v's batch dim broadcasts
        ((2, 6, 19, 8), (1, 3, 23, 8), (3, 23, 5), (2, 6), lambda b, h: (0, h // 2)),
        # multi-query: Hk = 1 is ordinary broadcasting
        ((2, 4, 19, 8), (2, 1, 23, 8), (2, 1, 23, 5), (2, 4), lambda b, h: (b, 0)),
        # q broadcasts against more k/v heads (Hq = 1 < Hk)
        ((1, 19, 8), (3, 23, 8), (3, 23, 5), (3,), lambda h: (h,)),
        # 2-D k, v shared by every q head
        ((3, 2, 19, 8), (23, 8), (23, 5), (3, 2), lambda b, h: ()),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_batch_broadcast_and_grouped_heads(q_shape, k_shape, v_shape, batch_shape, kv_index, causal):
    rng = rng_for("batch", q_shape, k_shape, v_shape, causal)
    q, k, v = random_qkv(rng, q_shape, k_shape, v_shape)
    want = ref.standard_attention(q, k, v, causal=causal)
    assert want.o.shape == batch_shape + (19, 5)
    assert want.l.shape == want.m.shape == batch_shape + (19,)
    q_full = np.broadcast_to(q, batch_shape + q.shape[-2:])
    v_full = np.broadcast_to(v, np.broadcast_shapes(k.shape[:-2], v.shape[:-2]) + v.shape[-2:])
    k_full = np.broadcast_to(k, v_full.shape[:-2] + k.shape[-2:])
    for index in np.ndindex(*batch_shape):
        head = ref.standard_attention(q_full[index], k_full[kv_index(*index)], v_full[kv_index(*index)], causal=causal)
        assert_outputs_close(ref.ReferenceOutput(want.o[index], want.l[index], want.m[index]), head)
    got = ref.flash_forward_tiled(q, k, v, causal=causal, block_rows=7, block_cols=13)
    assert_outputs_close(got, want)


# --------------------------------------------------------------------------
# Forward: properties of the result
# --------------------------------------------------------------------------


@pytest.mark.parametrize("nq,nk", [(130, 17), (113, 64), (17, 1), (64, 64), (2, 0)])
def test_causal_rows_without_keys_are_exact_zero(nq, nk):
    rng = rng_for("empty", nq, nk)
    q, k, v = random_qkv(rng, (nq, 16), (nk, 16), (nk, 4))
    empty = max(nq - nk, 0)  # rows i < Nq - Nk see no key
    outputs = [ref.standard_attention(q, k, v, causal=True)]
    outputs += [ref.flash_forward_tiled(q, k, v, causal=True, block_rows=br, block_cols=bc) for br, bc in BLOCKS]
    for out in outputs:
        assert not np.isnan(out.o).any()
        assert np.all(out.m[:empty] == -np.inf)
        assert np.all(out.l[:empty] == 0)
        assert np.all(out.o[:empty] == 0)
        assert np.all(np.isfinite(out.m[empty:]))
        assert np.all(out.l[empty:] >= 1)  # the max term contributes exp(0) = 1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(17, 17), (130, 64), (64, 113), (1, 130)])
def test_output_rows_are_convex_combinations(nq, nk, causal):
    # With v = identity the output row is the attention-probability row itself.
    rng = rng_for("convex", nq, nk, causal)
    q, k, _ = random_qkv(rng, (nq, 8), (nk, 8), (nk, 1), spread=2.0)
    v = np.eye(nk)
    mask = rng.random((nq, nk)) < 0.6
    mask[nq // 3] = False
    allowed = ref.allowed_keys(nq, nk, causal=causal, mask=mask)
    nonempty = allowed.any(axis=1)
    for out in (
        ref.standard_attention(q, k, v, causal=causal, mask=mask),
        ref.flash_forward_tiled(q, k, v, causal=causal, mask=mask, block_rows=16, block_cols=16),
    ):
        p = out.o
        assert np.all(p >= 0)
        assert np.all(p[~allowed] == 0)  # masked keys get exactly zero weight
        np.testing.assert_allclose(p.sum(axis=1), nonempty.astype(float), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spread", [0.3, 1.0, 30.0])
def test_m_plus_log_l_is_logsumexp(causal, spread):
    # spread = 30 gives scores in the hundreds: exp(S) alone would overflow.
    rng = rng_for("lse", causal, spread)
    nq, nk = 113, 64
    q, k, v = random_qkv(rng, (2, nq, 16), (2, nk, 16), (2, nk, 8), spread=spread)
    mask = rng.random((2, nq, nk)) < 0.5
    mask[0, 5] = False
    scale = 0.25
    s = scale * (q @ np.swapaxes(k, -1, -2))
    allowed = ref.allowed_keys(nq, nk, causal=causal, mask=mask, batch_shape=(2,))
    nonempty = allowed.any(axis=-1)
    want = masked_logsumexp(s, allowed)
    for out in (
        ref.standard_attention(q, k, v, causal=causal, scale=scale, mask=mask),
        ref.flash_forward_tiled(q, k, v, causal=causal, scale=scale, mask=mask, block_rows=32, block_cols=8),
    ):
        lse = out.m[nonempty] + np.log(out.l[nonempty])
        np.testing.assert_allclose(lse, want[nonempty], rtol=1e-12, atol=1e-12)
        assert np.all(out.m[~nonempty] == -np.inf)
        # m is the max over allowed scores only; to a few ulps of the scores' size (spread^2),
        # since the tiled form's smaller matmuls may sum their dot products in another order
        np.testing.assert_allclose(out.m[nonempty], np.where(allowed, s, -np.inf).max(-1)[nonempty],
                                   rtol=1e-13, atol=1e-13 * spread**2)


def test_default_scale_and_input_dtypes():
    rng = rng_for("dtypes")
    q, k, v = random_qkv(rng, (9, 12), (11, 12), (11, 3))
    explicit = ref.standard_attention(q, k, v, scale=1 / np.sqrt(12))
    assert_outputs_close(ref.standard_attention(q, k, v), explicit)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    out32 = ref.standard_attention(q32, k32, v32)
    assert out32.o.dtype == np.float64
    assert_outputs_close(
        out32, ref.standard_attention(q32.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64))
    )


def test_mask_must_be_boolean_and_broadcast():
    rng = rng_for("mask-type")
    q, k, v = random_qkv(rng, (2, 5, 4), (2, 6, 4), (2, 6, 4))
    with pytest.raises(TypeError):
        ref.standard_attention(q, k, v, mask=np.ones((5, 6)))
    with pytest.raises(ValueError, match=r"\(3, 5, 6\)"):
        ref.standard_attention(q, k, v, mask=np.ones((3, 5, 6), dtype=bool))


# --------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------


def finite_difference_grads(do, q, k, v, h=1e-5, **kwargs):
    """Central differences of f = sum(o * do) with respect to q, k and v."""

    def loss(q_, k_, v_):
        return np.sum(ref.standard_attention(q_, k_, v_, **kwargs).o * do)

    grads = []
    args = [q, k, v]
    for which in range(3):
        x = args[which]
        grad = np.zeros_like(x)
        for index in np.ndindex(*x.shape):
            original = x[index]
            x[index] = original + h
            up = loss(*args)
            x[index] = original - h
            down = loss(*args)
            x[index] = original
            grad[index] = (up - down) / (2 * h)
        grads.append(grad)
    return grads


BACKWARD_CASES = [
    # (q shape, k shape, v shape, causal, with_mask)
    ((5, 3), (7, 3), (7, 4), False, False),
    ((7, 3), (5, 3), (5, 2), True, False),  # Nq > Nk: two rows without keys
    ((4, 3), (6, 3), (6, 3), True, False),
    ((2, 4, 3, 3), (2, 2, 5, 3), (1, 2, 5, 2), True, False),  # grouped heads
    ((3, 4, 2), (1, 5, 2), (5, 3), False, True),  # broadcast k, 2-D v, mask
    ((2, 1, 4, 3), (3, 4, 3), (3, 4, 2), False, True),  # q broadcast over heads
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,causal,with_mask", BACKWARD_CASES)
def test_standard_backward_matches_finite_differences(q_shape, k_shape, v_shape, causal, with_mask):
    rng = rng_for("fd", q_shape, k_shape, v_shape, causal, with_mask)
    q, k, v = random_qkv(rng, q_shape, k_shape, v_shape)
    plan = ref.broadcast_plan(q.shape, k.shape, v.shape)
    nq, nk = q.shape[-2], k.shape[-2]
    mask = None
    if with_mask:
        mask = rng.random(plan.batch_shape + (nq, nk)) < 0.7
        mask[(0,) * len(plan.batch_shape) + (1,)] = False  # one fully masked row
    do = rng.standard_normal(plan.batch_shape + (nq, v.shape[-1]))
    kwargs = dict(causal=causal, scale=0.7, mask=mask)

    analytic = ref.standard_attention_backward(do, q, k, v, **kwargs)
    numeric = finite_difference_grads(do, q.copy(), k.copy(), v.copy(), **kwargs)
    for name, a, n, x in zip(("dq", "dk", "dv"), analytic, numeric, (q, k, v)):
        assert a.shape == x.shape, name
        np.testing.assert_allclose(a, n, rtol=1e-6, atol=1e-8, err_msg=name)


def test_backward_rows_without_keys_have_zero_gradient():
    rng = rng_for("zero-grad")
    q, k, v = random_qkv(rng, (9, 4), (4, 4), (4, 3))
    do = rng.standard_normal((9, 3))
    dq, _, _ = ref.standard_attention_backward(do, q, k, v, causal=True)
    assert np.all(dq[:5] == 0)
    fwd = ref.flash_forward_tiled(q, k, v, causal=True, block_rows=4, block_cols=3)
    dq_tiled, _, _ = ref.flash_backward_tiled(do, q, k, v, *fwd, causal=True, block_rows=4, block_cols=3)
    assert np.all(dq_tiled[:5] == 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape",
    [
        ((17, 8), (17, 8), (17, 8)),
        ((130, 8), (64, 8), (64, 5)),
        ((1, 8), (113, 8), (113, 6)),
        ((64, 8), (130, 8), (130, 4)),
        ((2, 4, 33, 8), (2, 2, 40, 8), (2, 2, 40, 3)),  # grouped
        ((3, 1, 21, 8), (2, 19, 8), (1, 19, 4)),  # broadcast
    ],
)
def test_flash_backward_matches_standard(q_shape, k_shape, v_shape, causal):
    rng = rng_for("bwd", q_shape, k_shape, v_shape, causal)
    q, k, v = random_qkv(rng, q_shape, k_shape, v_shape, spread=1.5)
    plan = ref.broadcast_plan(q.shape, k.shape, v.shape)
    nq, nk = q.shape[-2], k.shape[-2]
    mask = rng.random((nq, nk)) < 0.8
    mask[nq // 2] = False
    do = rng.standard_normal(plan.batch_shape + (nq, v.shape[-1]))
    for use_mask in (False, True):
        kwargs = dict(causal=causal, mask=mask if use_mask else None)
        want = ref.standard_attention_backward(do, q, k, v, **kwargs)
        for block_rows, block_cols in BLOCKS:
            fwd = ref.flash_forward_tiled(q, k, v, block_rows=block_rows, block_cols=block_cols, **kwargs)
            got = ref.flash_backward_tiled(
                do, q, k, v, fwd.o, fwd.l, fwd.m, block_rows=block_rows, block_cols=block_cols, **kwargs
            )
            assert_grads_close(got, want)


# --------------------------------------------------------------------------
# Low precision
# --------------------------------------------------------------------------


def test_round_to_bfloat16_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = rng_for("bf16-bits")
    # Every float32 bit pattern class: normals, subnormals, ties, inf, NaN.
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    tie_bits = (bits & 0xFFFF0000) | 0x00008000
    special = np.array([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00008000, 0x0], np.uint32)
    x = np.concatenate([bits, tie_bits, special]).view(np.float32)
    got = ref.round_to(x, "bfloat16")
    with np.errstate(invalid="ignore", over="ignore"):  # ml_dtypes warns on NaN / overflow
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert got.dtype == np.float32
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # Also from float64, where both go through float32 first.
    x64 = rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)
    with np.errstate(over="ignore"):
        want64 = x64.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(ref.round_to(x64, ml_dtypes.bfloat16), want64)


def test_round_to_bfloat16_by_hand():
    ulp = 2.0**-7  # bfloat16 keeps 7 fraction bits
    x = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2**-20, -(1 + 3 * ulp / 2), 3.39e38, np.inf, -np.inf])
    # 3.39e38 lies just below the midpoint between the largest bfloat16 (2^128 - 2^120) and 2^128.
    want = np.array([1.0, 1 + 2 * ulp, 1 + ulp, -(1 + 2 * ulp), 2.0**128 - 2.0**120, np.inf, -np.inf])
    with np.errstate(over="ignore"):
        got = ref.round_to(x, "bfloat16")
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert ref.round_to(np.float32(np.finfo(np.float32).max), "bfloat16") == np.inf
    assert np.isnan(ref.round_to(np.array([np.nan]), "bfloat16")).all()
    nan_low_payload = np.array([0x7F800001], np.uint32).view(np.float32)  # would truncate to inf
    assert np.isnan(ref.round_to(nan_low_payload, "bfloat16")).all()


def test_round_to_float16_and_float32():
    rng = rng_for("fp16")
    x = rng.standard_normal(10_000) * 10.0 ** rng.integers(-9, 6, 10_000)
    with np.errstate(over="ignore"):
        got = ref.round_to(x, "float16")
        want = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    ulp = 2.0**-10
    ties = np.array([1 + ulp / 2, 1 + 3 * ulp / 2])
    np.testing.assert_array_equal(ref.round_to(ties, "float16"), [1.0, 1 + 2 * ulp])
    np.testing.assert_array_equal(ref.round_to(x, "float32"), x.astype(np.float32))
    for name in ("float16", "bfloat16", "float32"):
        once = ref.round_to(x, name)
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(ref.round_to(once, name), once)  # idempotent
    with pytest.raises(ValueError):
        ref.round_to(x, "int8")


def lowp_error(dtype, causal=False, nq=128, nk=128, seed=0):
    rng = rng_for("lowp", dtype, causal, nq, nk, seed)
    q, k, v = random_qkv(rng, (2, 3, nq, 64), (2, 3, nk, 64), (2, 3, nk, 64))
    q, k, v = (ref.round_to(x, dtype) for x in (q, k, v))  # inputs as the kernel sees them
    exact = ref.standard_attention(q, k, v, causal=causal)
    low = ref.lowp_attention(q, k, v, dtype=dtype, causal=causal)
    assert not np.isnan(low.o).any()
    return np.max(np.abs(low.o - exact.o)), low, exact


@pytest.mark.parametrize("causal", [False, True])
def test_lowp_attention_error_sizes(causal):
    err_bf16, low, _ = lowp_error("bfloat16", causal)
    err_fp16, _, _ = lowp_error("float16", causal)
    err_fp32, _, _ = lowp_error("float32", causal)
    assert 0 < err_bf16 < 2e-2
    assert 0 < err_fp16 < err_bf16
    assert 0 < err_fp32 < 1e-5
    # o holds values representable in bfloat16
    np.testing.assert_array_equal(ref.round_to(low.o, "bfloat16"), low.o)


def test_lowp_attention_empty_rows_and_stats():
    err, low, exact = lowp_error("bfloat16", causal=True, nq=100, nk=40)
    assert np.all(low.o[..., :60, :] == 0)
    assert np.all(low.l[..., :60] == 0)
    assert np.all(low.m[..., :60] == -np.inf)
    np.testing.assert_allclose(low.m[..., 60:], exact.m[..., 60:], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(low.l[..., 60:], exact.l[..., 60:], rtol=5e-2)
    with pytest.raises(ValueError):
        ref.lowp_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), dtype="float64")


# --------------------------------------------------------------------------
# Shapes: expand_kv / broadcast_plan
# --------------------------------------------------------------------------


def test_expand_kv_grouped_heads():
    rng = rng_for("expand")
    q, k, v = random_qkv(rng, (2, 8, 5, 4), (2, 2, 7, 4), (2, 7, 3))
    plan = ref.broadcast_plan(q.shape, k.shape, v.shape)
    assert plan == ref.BroadcastPlan((2, 8), (2, 2), 4)
    q_x, k_x, v_x = ref.expand_kv(q, k, v)
    assert q_x.shape == (2, 8, 5, 4) and k_x.shape == (2, 8, 7, 4) and v_x.shape == (2, 8, 7, 3)
    for b, h in np.ndindex(2, 8):
        np.testing.assert_array_equal(k_x[b, h], k[b, h // 4])
        np.testing.assert_array_equal(v_x[b, h], v[h // 4])


@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,names",
    [
        ((2, 3, 5, 8), (4, 7, 8), (4, 7, 8), ("q", "k")),  # Hq = 3, Hk = 4
        ((2, 6, 5, 8), (4, 7, 8), (4, 7, 8), ("q", "k")),  # 6 % 4 != 0
        ((2, 5, 8), (3, 7, 8), (3, 7, 8), ("q", "k")),  # batch 2 vs 3
        ((5, 8), (2, 7, 8), (3, 7, 8), ("k", "v")),  # k and v disagree
        ((5, 8), (7, 4), (7, 8), ("q", "k")),  # head dim d differs
        ((5, 8), (7, 8), (6, 8), ("k", "v")),  # Nk differs
        ((8,), (7, 8), (7, 8), ("q",)),  # too few dimensions
    ],
)
def test_expand_kv_errors_name_the_shapes(q_shape, k_shape, v_shape, names):
    rng = rng_for("errors", q_shape, k_shape, v_shape)
    q, k, v = random_qkv(rng, q_shape, k_shape, v_shape)
    shapes = {"q": q_shape, "k": k_shape, "v": v_shape}
    with pytest.raises(ValueError) as info:
        ref.expand_kv(q, k, v)
    message = str(info.value)
    for name in names:
        assert str(shapes[name]) in message, message
    with pytest.raises(ValueError):
        ref.standard_attention(q, k, v)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_lowp_backward_is_close_but_not_exact(dtype):
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, 3, 40, 16)) for _ in range(3))
    do = rng.standard_normal((2, 3, 40, 16))
    q, k, v, do = (ref.round_to(x, dtype).astype(np.float64) for x in (q, k, v, do))
    exact = ref.standard_attention_backward(do, q, k, v, causal=True)
    lowp = ref.lowp_attention_backward(do, q, k, v, dtype=dtype, causal=True)
    for e, g in zip(exact, lowp):
        assert g.shape == e.shape
        err = np.max(np.abs(g - e)) / np.max(np.abs(e))
        assert 0 < err < 5e-2


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_lowp_backward_stores_shared_head_sums_in_dtype(dtype):
    # One key: every P is 1, so each query head's dV is its dO exactly; two query heads share
    # the k/v head, and a framework stores their sum in dtype, rounded once.
    rng = np.random.default_rng()
    q, do = (ref.round_to(rng.standard_normal((1, 4, 1, 16)), dtype).astype(np.float64) for _ in range(2))
    k, v = (ref.round_to(rng.standard_normal((1, 2, 1, 16)), dtype).astype(np.float64) for _ in range(2))
    dv = ref.lowp_attention_backward(do, q, k, v, dtype=dtype)[2]
    summed = do.reshape(1, 2, 2, 1, 16).sum(axis=2)
    np.testing.assert_array_equal(dv, ref.round_to(summed, dtype))
    assert not np.array_equal(dv, summed)  # the sums of random pairs are not all representable
