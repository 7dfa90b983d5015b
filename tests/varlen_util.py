"""Packed variable-length batches for the GPU tests: inputs, and the error rule of the forward
and the gradients against the float64 reference sequence by sequence (cuflash.reference.varlen)."""

import functools

import numpy as np

from cuflash import reference as ref
from gpu_util import compare_gradients, max_err, random_array, to_host64


def boundaries(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(rng, dtype, lengths_q, lengths_k, hq=4, hk=2, d=64, dv=None):
    cu_q, cu_k = boundaries(lengths_q), boundaries(lengths_k)
    q = random_array(rng, (hq, int(cu_q[-1]), d), dtype)
    k = random_array(rng, (hk, int(cu_k[-1]), d), dtype)
    v = random_array(rng, (hk, int(cu_k[-1]), dv or d), dtype)
    return q, k, v, cu_q, cu_k


def check_forward(out, q, k, v, cu_q, cu_k, *, dtype, causal=False, window=None, rows=None):
    """o, l, m (or ``out`` = (o,) alone, from an API that returns no statistics) on the rows
    ``rows`` (default: every covered row) against the reference."""
    got = [to_host64(x) for x in out]
    exact = ref.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window=window)
    rows = ref.covered_rows(cu_q, q.shape[1]) if rows is None else rows
    o, eo, em = got[0], exact.o[:, rows], exact.m[:, rows]
    assert o.shape == exact.o.shape
    o = o[:, rows]
    assert not np.isnan(o).any(), "an unwritten row"
    err = max_err(o, eo)
    if dtype == "float32":
        assert err <= 1e-5 * max(np.max(np.abs(eo), initial=0.0), 1e-30), f"float32 error {err:.3g}"
    else:
        plain = ref.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                     attention=functools.partial(ref.lowp_attention, dtype=dtype))
        bound = 2 * max_err(plain.o[:, rows], eo) + 1e-6
        assert err <= bound, f"max |o - ref| = {err:.3g} > 2 x plain {dtype} error ({bound:.3g})"
    empty = np.isneginf(em)
    np.testing.assert_array_equal(o[empty], 0.0)
    if len(got) == 1:
        return
    l, m = got[1], got[2]
    assert l.shape == exact.l.shape == m.shape
    l, m, el = l[:, rows], m[:, rows], exact.l[:, rows]
    assert not np.isnan(l).any() and not np.isnan(m).any(), "an unwritten row"
    np.testing.assert_array_equal(np.isneginf(m), empty)
    np.testing.assert_array_equal(l[empty], 0.0)
    np.testing.assert_allclose(m[~empty], em[~empty], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(l[~empty], el[~empty], rtol=1e-4)


def check_backward(grads, do, q, k, v, cu_q, cu_k, *, dtype, causal=False, window=None, q_rows=None, k_rows=None):
    options = dict(causal=causal, window=window)
    exact = ref.varlen_attention_backward(do, q, k, v, cu_q, cu_k, **options)
    plain = None
    if dtype != "float32":
        plain = ref.varlen_attention_backward(do, q, k, v, cu_q, cu_k, **options,
                                              backward=functools.partial(ref.lowp_attention_backward, dtype=dtype))
    q_rows = ref.covered_rows(cu_q, q.shape[1]) if q_rows is None else q_rows
    k_rows = ref.covered_rows(cu_k, k.shape[1]) if k_rows is None else k_rows
    return compare_gradients([to_host64(g) for g in grads], exact, plain, dtype, (q_rows, k_rows, k_rows))
