// tile_io.cuh: moving tiles between device memory and shared memory.
#pragma once
#include "common.cuh"

namespace cuflash {

// Shared-memory rows are padded by one 16-byte chunk (8 16-bit elements). Rows hold an even
// number of 16-byte chunks, so the padded pitch is an odd number of chunks and the 8 rows one
// ldmatrix phase reads fall in 8 distinct 16-byte bank groups.
constexpr int kSmemPad = CUFLASH_SMEM_PAD;
static_assert(kSmemPad * 2 == 16, "one 16-byte chunk of padding a row");

// Copies rows [row0, row0 + ROWS) and columns [0, COLS) of a row-major global matrix into
// shared memory (pitch PITCH). Rows at or past `nrows` and columns at or past `ncols` (both
// multiples of 8) are zero-filled, never read: ragged ends and padded head dims become 0.
template <int ROWS, int COLS, int PITCH, int NT, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, i64 row_stride, i64 row0,
                                                i64 nrows, i64 ncols, int tid) {
    constexpr int CHUNKS = COLS / 8;
    constexpr int TOTAL = ROWS * CHUNKS;
    constexpr int ITERS = (TOTAL + NT - 1) / NT;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int i = tid + it * NT;
        if (TOTAL % NT == 0 || i < TOTAL) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool valid = (row0 + r < nrows) && (c * 8 < ncols);
            const T* src = valid ? gmem + (row0 + r) * row_stride + c * 8 : gmem;
            cp_async_16(smem_addr(smem + r * PITCH + c * 8), src, valid);
        }
    }
}

// Copies keys [k0, k0 + BC) of a slice's K (HD columns) and V (HDV) into their shared-memory
// tiles (pitches K_PITCH, V_PITCH), as load_tile_async does each.
template <int BC, int HD, int HDV, int K_PITCH, int V_PITCH, int NT, typename T>
__device__ __forceinline__ void load_kv_async(T* sK, T* sV, const T* gK, const T* gV, const FwdParams& p, i64 k0,
                                              i64 nk, int tid) {
    load_tile_async<BC, HD, K_PITCH, NT>(sK, gK, p.k_row_stride, k0, nk, p.d, tid);
    load_tile_async<BC, HDV, V_PITCH, NT>(sV, gV, p.v_row_stride, k0, nk, p.dv, tid);
}

// Copies COUNT floats (a multiple of 4, 16-byte aligned at both ends) into shared memory.
template <int COUNT, int NT>
__device__ __forceinline__ void load_floats_async(float* smem, const float* gmem, int tid) {
    static_assert(COUNT % 4 == 0, "whole 16-byte chunks");
    for (int i = tid; i < COUNT / 4; i += NT) cp_async_16(smem_addr(smem + 4 * i), gmem + 4 * i, true);
}

}  // namespace cuflash
