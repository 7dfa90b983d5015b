// flash_fwd_f32.cu: the tiled forward pass for float32 inputs, in exact fp32 FMA arithmetic.
//
// float32 users ask for float32 accuracy, which tf32 tensor cores (10-bit mantissa) do not
// give; this kernel keeps every product and sum in fp32 on the CUDA cores instead. The
// algorithm is the same as flash_fwd.cu (query tile outer, key tiles inner, online softmax),
// with a layout that suits scalar code: a key tile is 32 rows, one key per lane, and each warp
// owns RPW query rows. For a row, lane j computes s_j = q . k_j; the warp reduces the max; then
// every lane accumulates O columns lane, lane+32, ... with p_j broadcast by shuffles.
#include "common.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "slice.cuh"

namespace cuflash {

// Rows [row0, row0 + rows) and columns [0, ncols) of a strided global matrix into shared
// memory with pitch `pitch`; missing rows and columns up to `cols` are zero-filled.
template <int NT>
__device__ __forceinline__ void load_tile_f32(float* smem, const float* gmem, i64 row_stride,
                                              i64 row0, i64 nrows, int rows, int cols,
                                              int ncols, int pitch, int tid) {
    for (int i = tid; i < rows * cols; i += NT) {
        const int r = i / cols, c = i % cols;
        const bool valid = row0 + r < nrows && c < ncols;
        smem[r * pitch + c] = valid ? gmem[(row0 + r) * row_stride + c] : 0.f;
    }
}

// One variant: a parameter for each field of cuflash/_variants.py's Float32Forward, in its
// order. value_tiles (DVT): O columns per lane, ceil(dv / 32); the key tile is the warp width,
// 32; rows_per_warp (RPW) query rows a warp. varlen: the CTA walks the query tiles of its
// sequence that its grid position names (slice.cuh).
template <int value_tiles, bool causal, int warps, int rows_per_warp, bool sparse, bool varlen>
struct Fwd32Traits {
    static constexpr int DVT = value_tiles, NWARPS = warps, RPW = rows_per_warp;
    static constexpr bool CAUSAL = causal, SPARSE = sparse, VARLEN = varlen;
};

template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32)
flash_fwd_f32_kernel(const __grid_constant__ FwdParams p) {
    constexpr int DVT = K::DVT, NWARPS = K::NWARPS, RPW = K::RPW;
    constexpr bool CAUSAL = K::CAUSAL, SPARSE = K::SPARSE, VARLEN = K::VARLEN;
    constexpr int NT = NWARPS * 32, BR = NWARPS * RPW, BC = 32, VP = DVT * 32;
    extern __shared__ __align__(16) float smem_f32[];
    const int d = (int)p.d, dv = (int)p.dv, k_pitch = d + 1;  // odd pitch: lane j reads row j
    require_dynamic_smem((u32)(4 * (BR * d + BC * k_pitch + BC * VP)));
    float* sQ = smem_f32;
    float* sK = sQ + BR * d;
    float* sV = sK + BC * k_pitch;

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const SliceGeometry g = slice_geometry<VARLEN>(p, bidx);
    const i64 nq = g.nq, nk = g.nk;
    const float* gQ = static_cast<const float*>(p.q) + g.q;
    const float* gK = static_cast<const float*>(p.k) + g.k;
    const float* gV = static_cast<const float*>(p.v) + g.v;
    const Band band = g.band<CAUSAL>(p);
#pragma unroll 1
    for (ItemWalk<VARLEN, CAUSAL> walk(tiles_of(nq, BR)); walk.more(); walk.next()) {
        const int tid = walk.start(), warp = tid / 32, lane = tid % 32;
        const int q_tile = walk.tile();
        const i64 q0 = (i64)q_tile * BR;
        const i64 q_end = q0 + BR < nq ? q0 + BR : nq;
        const auto tiles = key_tiles<SPARSE>(p, band, bidx, q_tile, q0, q_end, BC, nk);
        const int n_tiles = tiles.count;
        const float scale_log2 = (float)p.scale_log2;

        load_tile_f32<NT>(sQ, gQ, p.q_row_stride, q0, nq, BR, d, d, d, tid);
        float acc[RPW][DVT];
        zero(acc);
        OnlineSoftmax<RPW> softmax;
        softmax.init();

        for (int t = 0; t < n_tiles; ++t) {
            const i64 k0 = (i64)tiles.tile(t) * BC;
            __syncthreads();  // every warp is done with the previous tile
            load_tile_f32<NT>(sK, gK, p.k_row_stride, k0, nk, BC, d, d, k_pitch, tid);
            load_tile_f32<NT>(sV, gV, p.v_row_stride, k0, nk, BC, VP, dv, VP, tid);
            __syncthreads();
            const i64 key = k0 + lane;
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                const int row = warp * RPW + i;
                // -- s = q . k for this lane's key --
                float s = 0.f;
                for (int c = 0; c < d; ++c) s = fmaf(sQ[row * d + c], sK[lane * k_pitch + c], s);
                if (!pair_allowed(p, band, tiles, tiles.partial(t), q0 + row, key, nq, nk)) s = neg_inf();
                // -- online softmax --
                float base;
                const float correction = softmax.advance(i, warp_max(s), scale_log2, base);
                const float pj = fast_exp2((s - base) * scale_log2);
                softmax.l[i] += pj;
#pragma unroll
                for (int u = 0; u < DVT; ++u) acc[i][u] *= correction;
                // -- o += p v --
                for (int j = 0; j < BC; ++j) {
                    const float pb = __shfl_sync(0xffffffffu, pj, j);
#pragma unroll
                    for (int u = 0; u < DVT; ++u) acc[i][u] = fmaf(pb, sV[j * VP + lane + 32 * u], acc[i][u]);
                }
            }
        }

        float* gO = static_cast<float*>(p.o) + g.rows * dv;
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const i64 q = q0 + warp * RPW + i;
            const float inv_l = softmax.finalize<32>(i);
            if (q >= nq) continue;
#pragma unroll
            for (int u = 0; u < DVT; ++u) {
                const int c = lane + 32 * u;
                if (c < dv) gO[q * dv + c] = acc[i][u] * inv_l;
            }
            if (lane == 0) softmax.store(i, (float)p.scale, p.l + g.rows + q, p.m + g.rows + q);
        }
    }  // items
}

}  // namespace cuflash
