"""The forward kernels' online-softmax state (kernels/softmax.cuh): finalize and merge.

Each is run on its own through a small probe kernel: finalize's row sum over a quad or a
warp and the rule for a row with no allowed key (o = 0, l = 0, m = -inf); merge against the
float64 softmax over random splits of a row's keys into two disjoint parts, empty parts
included. The probe builds with NVRTC alone (no GPU); the runs need one.
"""

import numpy as np
import pytest

from conftest import requires_gpu
from cuflash import _loader

pytestmark = pytest.mark.nvrtc  # builds a probe kernel: left out by -m "not nvrtc"

PROBE = r"""
#include "softmax.cuh"
namespace cuflash {
// One thread a row: state a (m_a, l_a) merged with part b; out[4 r ..] = m, l, fa, fb.
__global__ void softmax_merge_probe(const float* m_a, const float* l_a, const float* m_b, const float* l_b,
                                    int rows, float scale_log2, float* out) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    OnlineSoftmax<1> s;
    s.m[0] = m_a[r];
    s.l[0] = l_a[r];
    float fa, fb;
    s.merge(0, m_b[r], l_b[r], scale_log2, fa, fb);
    out[4 * r] = s.m[0];
    out[4 * r + 1] = s.l[0];
    out[4 * r + 2] = fa;
    out[4 * r + 3] = fb;
}
// LANES adjacent threads share a row: thread t holds the partial sum l[t] of row t / LANES
// (raw max m[t / LANES]); the grid is whole warps.
template <int LANES>
__global__ void softmax_finalize_probe(const float* l, const float* m, float scale, float* inv_l, float* l_out,
                                       float* m_out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x, row = t / LANES;
    OnlineSoftmax<1> s;
    s.m[0] = m[row];
    s.l[0] = l[t];
    inv_l[t] = s.finalize<LANES>(0);
    if (t % LANES == 0) s.store(0, scale, l_out + row, m_out + row);
}
}  // namespace cuflash
"""
NAMES = ["cuflash::softmax_merge_probe", "cuflash::softmax_finalize_probe<4>",
         "cuflash::softmax_finalize_probe<32>"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_probe_builds(arch):
    _, lowered, _ = _loader.nvrtc_build(PROBE, "softmax_probe.cu", NAMES, (*_loader.base_options(), f"-arch={arch}"))
    assert sorted(lowered.values()) == sorted(NAMES)


def _module():
    import cupy

    cc = cupy.cuda.Device().compute_capability
    return cupy.RawModule(code=PROBE, options=_loader.base_options() + _loader.arch_options(cc),
                          name_expressions=NAMES)


def _part_state(s, keep, scale):
    """(raw max, sum of exp(scale (s - max)), unnormalised o weights) of the kept keys of each
    row, in float64; (-inf, 0, 0) for a row with none kept."""
    masked = np.where(keep, s, -np.inf)
    m = masked.max(axis=1)
    base = np.where(np.isfinite(m), m, 0.0)
    w = np.where(keep, np.exp(scale * (s - base[:, None])), 0.0)
    return m, w.sum(axis=1), w


@requires_gpu
def test_merge_is_the_softmax_over_both_parts(rng):
    """Random rows split at random into two disjoint key sets (some parts empty, some rows
    with no key at all): o = (o_a fa + o_b fb) / l is the float64 attention over the union."""
    import cupy

    rows, keys, dv, scale = 512, 48, 8, 0.125
    # float32 scores, so that the float64 reference and the kernel see the same maxima
    s = (rng.normal(0, 8, (rows, keys)) * rng.choice([1, 100], (rows, 1))).astype(np.float32).astype(np.float64)
    v = rng.normal(size=(keys, dv))
    allowed = rng.random((rows, keys)) < rng.random((rows, 1))
    allowed[:32] = False  # rows with no allowed key
    in_a = rng.random((rows, keys)) < rng.choice([0.0, 0.5, 1.0], (rows, 1))
    m_a, l_a, w_a = _part_state(s, allowed & in_a, scale)
    m_b, l_b, w_b = _part_state(s, allowed & ~in_a, scale)
    f32 = lambda x: cupy.asarray(np.asarray(x, np.float32))  # noqa: E731
    out = cupy.empty((rows, 4), cupy.float32)
    _module().get_function(NAMES[0])(((rows + 127) // 128,), (128,),
                                     (f32(m_a), f32(l_a), f32(m_b), f32(l_b), np.int32(rows),
                                      np.float32(scale * np.log2(np.e)), out))
    m, l, fa, fb = cupy.asnumpy(out).astype(np.float64).T

    m_ref, l_ref, w = _part_state(s, allowed, scale)
    empty = ~allowed.any(axis=1)
    assert np.array_equal(m, np.maximum(m_a.astype(np.float32), m_b.astype(np.float32)))
    assert np.all(m[empty] == -np.inf) and np.all(l[empty] == 0) and np.all(fa[empty] == 0) and np.all(fb[empty] == 0)
    assert np.all(fa[l_a == 0] == 0) and np.all(fb[l_b == 0] == 0)
    np.testing.assert_allclose(l, l_ref, rtol=2e-5)
    o_parts = (w_a @ v) * fa[:, None] + (w_b @ v) * fb[:, None]
    o = np.divide(o_parts, l[:, None], out=np.zeros_like(o_parts), where=l[:, None] > 0)
    o_ref = np.divide(w @ v, l_ref[:, None], out=np.zeros_like(o_parts), where=l_ref[:, None] > 0)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-5)


@requires_gpu
@pytest.mark.parametrize("lanes", [4, 32])
def test_finalize_sums_the_row_and_empties_rows_without_keys(rng, lanes):
    import cupy

    threads, scale = 1024, 0.3
    rows = threads // lanes
    l = rng.random(threads).astype(np.float32)
    m = rng.normal(0, 5, rows).astype(np.float32)
    empty = rng.random(rows) < 0.25
    l.reshape(rows, lanes)[empty] = 0.0
    m[empty] = -np.inf
    inv_l, l_out, m_out = cupy.empty(threads, cupy.float32), cupy.empty(rows, cupy.float32), cupy.empty(rows, cupy.float32)
    _module().get_function(NAMES[1 if lanes == 4 else 2])(
        (threads // 128,), (128,), (cupy.asarray(l), cupy.asarray(m), np.float32(scale), inv_l, l_out, m_out))
    l_ref = l.reshape(rows, lanes).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(cupy.asnumpy(l_out), l_ref, rtol=1e-6)
    inv = cupy.asnumpy(inv_l).reshape(rows, lanes)
    assert np.all(inv == inv[:, :1])  # every lane of a row gets the same factor
    assert np.all(inv[empty] == 0) and np.all(cupy.asnumpy(l_out)[empty] == 0)
    np.testing.assert_allclose(inv[~empty, 0], 1 / l_ref[~empty], rtol=1e-6)
    m_stored = cupy.asnumpy(m_out)
    assert np.all(m_stored[empty] == -np.inf)
    assert np.array_equal(m_stored[~empty], m[~empty] * np.float32(scale))
