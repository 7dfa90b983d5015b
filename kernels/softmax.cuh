// softmax.cuh: the online-softmax state of the rows one thread holds (the paper's m and l).
//
// Scores stay raw (s = q.k, unscaled) until they are exponentiated: exp(scale*(s - m)) is
// computed as exp2((s - m) * scale_log2). The difference comes first so that the row's
// largest score gives exactly exp2(0) = 1 even when scale * s is ~1e4; the single FFMA
// s*scale_log2 - m*scale_log2 would leave the rounding error of m*scale_log2 (~1e-3 there)
// in every exponent. The sum l is
// kept per thread over its own columns and reduced across the threads of the row only once,
// at the end (finalize); this is exact because every thread of a row applies the same
// rescale factor each tile.
//
// A row that has seen no allowed key keeps l = 0 and m = -inf, and its output is o = 0: the
// forward kernels store exactly that, and merge treats such a state as empty.
#pragma once
#include "common.cuh"

namespace cuflash {

// Max and sum across the 4 threads (a quad) that share a row of an mma accumulator.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// Max and sum across a warp (the fp32 forward: one key a lane).
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
// Sum across the LANES threads that share a row: a quad (4) or a warp (32).
template <int LANES>
__device__ __forceinline__ float row_sum(float x) {
    static_assert(LANES == 4 || LANES == 32, "a row is shared by a quad or by a warp");
    if constexpr (LANES == 4) return quad_sum(x);
    else return warp_sum(x);
}

template <int ROWS>
struct OnlineSoftmax {
    float m[ROWS];  // running max of raw scores; -inf until the row has seen an allowed key
    float l[ROWS];  // running (thread-partial) sum of exp(scale*(s - m))

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) { m[r] = neg_inf(); l[r] = 0.f; }
    }

    // Folds a tile's row maximum into m. Returns the factor that rescales everything
    // accumulated so far (l and O) and sets `base`, the raw score this tile's scores are taken
    // from: p = exp2((s - base) * scale_log2). A row that has seen only masked keys keeps
    // m = -inf; its base is 0 so that (-inf - base) = -inf instead of -inf - (-inf) = NaN.
    __device__ __forceinline__ float advance(int r, float tile_max, float scale_log2,
                                             float& base) {
        const float m_new = fmaxf(m[r], tile_max);
        base = (m_new == neg_inf()) ? 0.f : m_new;
        const float correction = fast_exp2((m[r] - base) * scale_log2);
        m[r] = m_new;
        l[r] *= correction;
        return correction;
    }

    // Ends row r: l becomes the row's full sum over the LANES threads that share it (every
    // one of them must call this), and the factor that turns the accumulated O into the
    // output is returned: 1 / l, or 0 for a row with no allowed key (l = 0), whose o is 0.
    template <int LANES>
    __device__ __forceinline__ float finalize(int r) {
        l[r] = row_sum<LANES>(l[r]);
        return l[r] > 0.f ? 1.f / l[r] : 0.f;
    }

    // Row r's statistics, after finalize, as the forward stores them: l, and m in the units
    // of the scaled scores (m * scale), -inf for a row with no allowed key.
    __device__ __forceinline__ void store(int r, float scale, float* l_out, float* m_out) const {
        *l_out = l[r];
        *m_out = (m[r] == neg_inf()) ? m[r] : m[r] * scale;
    }

    // Folds into row r another state of the same query row over a disjoint set of keys (raw
    // max m_b, sum l_b; both states partial over the same lanes, or both finalized): the
    // exact combination m = max(m, m_b), l = l * exp(scale*(m - m_new)) + l_b * exp(scale*(m_b
    // - m_new)). Returns the factors the two parts' unnormalised O are scaled by before they
    // are added, o = o * fa + o_b * fb. An empty part (l = 0, m = -inf) gets factor 0; two
    // empty parts stay empty (base 0 as in advance: no -inf - (-inf)).
    __device__ __forceinline__ void merge(int r, float m_b, float l_b, float scale_log2, float& fa,
                                          float& fb) {
        const float m_new = fmaxf(m[r], m_b);
        const float base = (m_new == neg_inf()) ? 0.f : m_new;
        fa = fast_exp2((m[r] - base) * scale_log2);
        fb = fast_exp2((m_b - base) * scale_log2);
        m[r] = m_new;
        l[r] = l[r] * fa + l_b * fb;
    }
};

}  // namespace cuflash
