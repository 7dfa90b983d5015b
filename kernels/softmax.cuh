// softmax.cuh: the online-softmax state of the rows one thread holds (the paper's m and l).
//
// Scores stay raw (s = q.k, unscaled) until they are exponentiated: exp(scale*(s - m)) is
// computed as exp2((s - m) * scale_log2). The difference comes first so that the row's
// largest score gives exactly exp2(0) = 1 even when scale * s is ~1e4; the single FFMA
// s*scale_log2 - m*scale_log2 would leave the rounding error of m*scale_log2 (~1e-3 there)
// in every exponent. The sum l is
// kept per thread over its own columns and reduced across the quad only once, at the end;
// this is exact because every thread of a row applies the same rescale factor each tile.
#pragma once
#include "common.cuh"

namespace cuflash {

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
};

// Max and sum across the 4 threads (a quad) that share a row of an mma accumulator.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cuflash
