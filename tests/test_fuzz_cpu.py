"""Property-based tests on the CPU: the float64 reference against itself (tiled == standard,
flash backward == analytic, block-sparse == dense with the expanded mask) and the argument
checks and batch layout the GPU path runs before any launch.
"""

import math

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuflash import _api, _broadcast, _checks, _constants, masks  # noqa: E402
from cuflash import reference as ref  # noqa: E402
from fuzz_strategies import SEEDS, element_mask_of, fuzz_settings, lead_dims, sparsity  # noqa: E402

RTOL, ATOL = 1e-10, 1e-12
SETTINGS = fuzz_settings(max_examples=60)


@st.composite
def small_problems(draw, masked=True):
    """q, k, v (float64, scaled up to 3 so some softmax rows are peaked) and keyword arguments
    for the reference: causal, scale and, when ``masked``, an element mask over (Nq, Nk)."""
    lead = draw(lead_dims())
    nq, nk = draw(st.integers(1, 40)), draw(st.integers(0, 40))
    d, dv = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(SEEDS))
    spread = draw(st.sampled_from((0.5, 1.0, 3.0)))
    q = rng.standard_normal(lead.q + (nq, d)) * spread
    k = rng.standard_normal(lead.kv + (nk, d)) * spread
    v = rng.standard_normal(lead.kv + (nk, dv))
    kwargs = {"causal": draw(st.booleans()), "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0)))}
    if masked and draw(st.booleans()):
        kwargs["mask"] = rng.random((nq, nk)) < draw(st.sampled_from((0.2, 0.8)))
    return q, k, v, kwargs


def assert_close(got, want):
    for name, g, w in zip(("first", "second", "third"), got, want):
        assert g.shape == w.shape, f"{name} output: shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{name} output")


@SETTINGS
@given(problem=small_problems(), block_rows=st.integers(1, 20), block_cols=st.integers(1, 20))
def test_algorithm_1_equals_standard_attention(problem, block_rows, block_cols):
    q, k, v, kwargs = problem
    got = ref.flash_forward_tiled(q, k, v, block_rows=block_rows, block_cols=block_cols, **kwargs)
    assert_close(got, ref.standard_attention(q, k, v, **kwargs))


@SETTINGS
@given(problem=small_problems(), block_rows=st.integers(1, 20), block_cols=st.integers(1, 20))
def test_flash_backward_equals_analytic_gradients(problem, block_rows, block_cols):
    q, k, v, kwargs = problem
    o, l, m = ref.standard_attention(q, k, v, **kwargs)
    do = np.random.default_rng(0).standard_normal(o.shape)
    got = ref.flash_backward_tiled(do, q, k, v, o, l, m, block_rows=block_rows, block_cols=block_cols, **kwargs)
    assert_close(got, ref.standard_attention_backward(do, q, k, v, **kwargs))


@SETTINGS
@given(problem=small_problems(masked=False), data=st.data())
def test_block_sparse_equals_dense_with_the_expanded_mask(problem, data):
    q, k, v, kwargs = problem
    nq, nk = q.shape[-2], k.shape[-2]
    seed = data.draw(SEEDS)
    sparse = data.draw(sparsity(nq, nk, np.random.default_rng(seed)))
    block_mask = sparse.pop("block_mask", None)
    if block_mask is None:  # Algorithm 5 always takes a mask; a dense one checks the window alone
        block_mask = masks.BlockMask.from_dense(np.ones((-(-nq // 16), -(-nk // 16)), bool), 16)
    got = ref.block_sparse_forward_tiled(q, k, v, block_mask, **kwargs, **sparse)
    mask = element_mask_of(nq, nk, {"block_mask": block_mask, **sparse})
    assert_close(got, ref.standard_attention(q, k, v, mask=mask, **kwargs))


# ---- argument checks and the batch layout of the launch --------------------------------------

HEAD_DIMS = st.one_of(st.integers(1, 32).map(lambda x: 8 * x), st.integers(0, 300))


@SETTINGS
@given(d=HEAD_DIMS, dv=HEAD_DIMS, data=st.data())
def test_head_dim_checks_accept_exactly_the_supported_shapes(d, dv, data):
    dk = data.draw(st.one_of(st.just(d), HEAD_DIMS))
    nq, nk = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 4))
    nv = data.draw(st.one_of(st.just(nk), st.integers(0, 4)))
    shapes = ((nq, d), (nk, dk), (nv, dv))

    def supported(x):
        return x % _constants.HEAD_DIM_MULTIPLE == 0 and _constants.HEAD_DIM_MULTIPLE <= x <= _constants.MAX_HEAD_DIM

    if dk == d and nv == nk and supported(d) and supported(dv):
        assert _checks.check_head_dims(*shapes) == (nq, nk, d, dv)
    else:
        with pytest.raises(ValueError) as error:
            _checks.check_head_dims(*shapes)
        assert any(str(s) in str(error.value) for s in shapes), "the message quotes a shape"


@SETTINGS
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5)))
def test_scale_must_be_finite_and_positive(scale):
    if math.isfinite(scale) and scale > 0:
        assert _checks.resolve_scale(scale, 64) == float(scale)
    else:
        with pytest.raises(ValueError, match="scale must be finite and positive"):
            _checks.resolve_scale(scale, 64)


@st.composite
def strided_lead_shapes(draw):
    """Leading dims of q, k, v, do (up to 5 each, some 1 or missing) with element strides that
    sometimes nest (mergeable) and sometimes do not."""
    base = draw(st.lists(st.integers(1, 3), min_size=0, max_size=5))
    group = draw(st.integers(1, 3))

    def derive(grouped):
        shape = list(base[draw(st.integers(0, len(base))):])
        shape = [1 if draw(st.booleans()) and draw(st.booleans()) else n for n in shape]
        if grouped and shape:
            shape[-1] *= group
        return tuple(shape)

    q, k, v = derive(True), derive(False), derive(False)
    all_contiguous = draw(st.booleans())  # then neighbouring dims merge wherever none is broadcast

    def strides(shape, rows):
        if shape and (all_contiguous or draw(st.booleans())):  # C-contiguous over (lead..., rows, 8)
            return tuple(int(s) for s in np.cumprod((8 * rows,) + shape[:0:-1])[::-1])
        return tuple(draw(st.integers(1, 5000)) for _ in shape)

    return [(shape, strides(shape, rows)) for shape, rows in ((q, 5), (k, 7), (v, 7))]


def kernel_offsets(layout, strides, flat, group=1):
    """Element offset of batch slice ``flat`` as kernels/common.cuh computes it (batch_offsets /
    lead_offset): coordinates innermost first, the last one divided by the group for k and v."""
    offset = 0
    for i in reversed(range(len(layout.lead_shape))):
        coordinate = flat % layout.lead_shape[i]
        flat //= layout.lead_shape[i]
        offset += (coordinate // group if i == len(layout.lead_shape) - 1 else coordinate) * strides[i]
    return offset


@SETTINGS
@given(strided_lead_shapes(), st.data())
def test_batch_layout_addresses_what_the_reference_broadcasts(tensors, data):
    """For every batch slice, the offsets the kernel derives from broadcast_layout are the
    offsets of the q, k, v slices the reference's broadcasting (and grouping) pairs up."""
    (q_lead, q_str), (k_lead, k_str), (v_lead, v_str) = tensors
    q_shape, k_shape, v_shape = q_lead + (5, 8), k_lead + (7, 8), v_lead + (7, 8)
    try:
        plan = ref.broadcast_plan(q_shape, k_shape, v_shape)
    except ValueError:
        with pytest.raises(ValueError, match="do not broadcast"):
            _broadcast.broadcast_layout(q_shape, q_str + (8, 1), k_shape, k_str + (8, 1), v_shape, v_str + (8, 1))
        return
    out_lead = plan.batch_shape
    do_str = tuple(data.draw(st.integers(1, 5000)) for _ in out_lead)
    try:
        layout = _broadcast.broadcast_layout(q_shape, q_str + (8, 1), k_shape, k_str + (8, 1), v_shape, v_str + (8, 1),
                                       extras=((out_lead + (5, 8), do_str + (8, 1)),))
    except ValueError as error:
        assert f"at most {_constants.MAX_LEAD_DIMS} leading dims" in str(error)
        return
    assert layout.out_lead_shape == out_lead
    assert layout.kv_group == plan.group_size
    assert math.prod(layout.lead_shape) == math.prod(out_lead)

    def offsets(lead, strides):  # (*lead, 1, 1): each slice's offset in its own tensor
        if not lead:
            return np.zeros((1, 1), np.int64)
        index = np.indices(lead, dtype=np.int64).reshape(len(lead), -1)
        return (np.asarray(strides, np.int64) @ index).reshape(lead + (1, 1))

    want = ref.expand_kv(offsets(q_lead, q_str), offsets(k_lead, k_str), offsets(v_lead, v_str))
    want = [w.reshape(-1) for w in want] + [offsets(out_lead, do_str).reshape(-1)]
    for flat in range(math.prod(out_lead)):
        got = (kernel_offsets(layout, layout.q_strides, flat),
               kernel_offsets(layout, layout.k_strides, flat, layout.kv_group),
               kernel_offsets(layout, layout.v_strides, flat, layout.kv_group),
               kernel_offsets(layout, layout.extra_strides[0], flat))
        assert got == tuple(int(w[flat]) for w in want), f"batch slice {flat}"
