// flash_bwd_f32.cu: the recomputing backward pass for float32, in exact fp32 FMA arithmetic.
//
// Same mathematics as flash_bwd.cu (see there), laid out for scalar code like
// flash_fwd_f32.cu: 32 rows of the "other" operand per tile, one per lane.
//   flash_bwd_dkdv_f32_kernel  a CTA owns NWARPS * KPW keys; lane j takes query j of each
//                              32-query tile; dK and dV columns lane, lane+32, ... per key.
//   flash_bwd_dq_f32_kernel    a CTA owns NWARPS * RPW queries; lane j takes key j of each
//                              32-key tile.
// No atomics: both are deterministic. D and (m, log2 l) come from flash_bwd_preprocess<float>.
#include "common.cuh"
#include "mask.cuh"
#include "bwd_common.cuh"

namespace cuflash {

__device__ __forceinline__ void load_rows_f32(float* smem, const float* gmem, i64 row_stride, i64 row0,
                                              i64 nrows, int rows, int cols, int ncols, int pitch,
                                              int tid, int nthreads) {
    for (int i = tid; i < rows * cols; i += nthreads) {
        const int r = i / cols, c = i % cols;
        smem[r * pitch + c] = (row0 + r < nrows && c < ncols) ? gmem[(row0 + r) * row_stride + c] : 0.f;
    }
}

// One variant of each kernel: a parameter for each field of cuflash/_variants.py's
// Float32BackwardDkDv and Float32BackwardDq, in its order. dim_tiles: dK and dV columns (DT,
// DVT), or dQ columns (DT), per lane: ceil(max(d, dv) / 32). varlen (both kernels): the CTA
// walks the tiles of its sequence that its grid position names (slice.cuh).
template <int dim_tiles, bool causal, int warps, int keys_per_warp, bool sparse, bool varlen>
struct BwdDkDv32Traits {
    static constexpr int DT = dim_tiles, DVT = dim_tiles, NWARPS = warps, KPW = keys_per_warp;
    static constexpr bool CAUSAL = causal, SPARSE = sparse, VARLEN = varlen;
};
template <int dim_tiles, bool causal, int warps, int rows_per_warp, bool sparse, bool varlen>
struct BwdDq32Traits {
    static constexpr int DT = dim_tiles, NWARPS = warps, RPW = rows_per_warp;
    static constexpr bool CAUSAL = causal, SPARSE = sparse, VARLEN = varlen;
};

template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32)
flash_bwd_dkdv_f32_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b) {
    constexpr int DT = K::DT, DVT = K::DVT, NWARPS = K::NWARPS, KPW = K::KPW;
    constexpr bool CAUSAL = K::CAUSAL, SPARSE = K::SPARSE, VARLEN = K::VARLEN;
    constexpr int NT = NWARPS * 32, BK = NWARPS * KPW;
    constexpr int QP = DT * 32 + 1, OP = DVT * 32 + 1;  // odd pitches: lane j reads row j
    const int d = (int)p.d, dv = (int)p.dv;
    extern __shared__ __align__(16) float smem_f32[];
    require_dynamic_smem((u32)(4 * (BK * d + BK * dv + 32 * QP + 32 * OP)));
    float* sK = smem_f32;            // [BK][d]
    float* sV = sK + BK * d;         // [BK][dv]
    float* sQ = sV + BK * dv;        // [32][QP]
    float* sdO = sQ + 32 * QP;       // [32][OP]

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const SliceGeometry g = slice_geometry<VARLEN>(p, bidx, b.nq_pad);
    const i64 nq = g.nq, nk = g.nk;
    const BwdSlice<float> in = bwd_slice<float, VARLEN>(p, b, g, bidx);
    const float *gQ = in.q, *gdO = in.dout;
    const Band band = g.band<CAUSAL>(p);
#pragma unroll 1
    for (ItemWalk<VARLEN, false> walk(tiles_of(nk, BK)); walk.more(); walk.next()) {
        const int tid = walk.start(), warp = tid / 32, lane = tid % 32;
        const int key_tile = walk.tile();
        const i64 j0 = (i64)key_tile * BK;
        load_rows_f32(sK, in.k, p.k_row_stride, j0, nk, BK, d, d, d, tid, NT);
        load_rows_f32(sV, in.v, p.v_row_stride, j0, nk, BK, dv, dv, dv, tid, NT);
        const auto tiles = query_tiles<SPARSE>(p, band, bidx, key_tile, j0, BK, 32, nq, nk);
        const float scale = (float)p.scale;
        float acc_dk[KPW][DT], acc_dv[KPW][DVT];
        zero(acc_dk);
        zero(acc_dv);

        for (int it = 0; it < tiles.count; ++it) {
            const i64 q0 = (i64)tiles.tile(it) * 32;
            __syncthreads();  // every warp is done with the previous query tile
            load_rows_f32(sQ, gQ, p.q_row_stride, q0, nq, 32, DT * 32, d, QP, tid, NT);
            load_rows_f32(sdO, gdO, b.do_row_stride, q0, nq, 32, DVT * 32, dv, OP, tid, NT);
            __syncthreads();
            const i64 q = q0 + lane;  // this lane's query; rows past nq read the padding
            const float m_row = in.lse2[2 * q], log2l = in.lse2[2 * q + 1];
            const float delta = in.delta[q];
#pragma unroll
            for (int r = 0; r < KPW; ++r) {
                const int kr = warp * KPW + r;
                const i64 key = j0 + kr;
                float s = 0.f, dp = 0.f;
                for (int c = 0; c < d; ++c) s = fmaf(sK[kr * d + c], sQ[lane * QP + c], s);
                for (int c = 0; c < dv; ++c) dp = fmaf(sV[kr * dv + c], sdO[lane * OP + c], dp);
                const bool allowed = pair_allowed(p, band, tiles, tiles.partial(it), q, key, nq, nk);
                const float pr = allowed ? recompute_p(s, scale, m_row, log2l) : 0.f;
                const float ds = pr * (dp - delta);
                for (int j = 0; j < 32; ++j) {
                    const float pj = __shfl_sync(0xffffffffu, pr, j);
                    const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
                    for (int u = 0; u < DVT; ++u) acc_dv[r][u] = fmaf(pj, sdO[j * OP + lane + 32 * u], acc_dv[r][u]);
#pragma unroll
                    for (int u = 0; u < DT; ++u) acc_dk[r][u] = fmaf(dsj, sQ[j * QP + lane + 32 * u], acc_dk[r][u]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < KPW; ++r) {
            const i64 key = j0 + warp * KPW + r;
            if (key >= nk) continue;
#pragma unroll
            for (int u = 0; u < DT; ++u)
                if (lane + 32 * u < d) b.dk_acc[(g.kv_rows + key) * d + lane + 32 * u] = scale * acc_dk[r][u];
#pragma unroll
            for (int u = 0; u < DVT; ++u)
                if (lane + 32 * u < dv) b.dv_acc[(g.kv_rows + key) * dv + lane + 32 * u] = acc_dv[r][u];
        }
    }  // items
}

template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32)
flash_bwd_dq_f32_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b) {
    constexpr int DT = K::DT, NWARPS = K::NWARPS, RPW = K::RPW;
    constexpr bool CAUSAL = K::CAUSAL, SPARSE = K::SPARSE, VARLEN = K::VARLEN;
    constexpr int NT = NWARPS * 32, BR = NWARPS * RPW, KP = DT * 32 + 1;
    const int d = (int)p.d, dv = (int)p.dv, vp = dv + 1;
    extern __shared__ __align__(16) float smem_f32[];
    require_dynamic_smem((u32)(4 * (BR * d + BR * dv + 32 * KP + 32 * vp)));
    float* sQ = smem_f32;         // [BR][d]
    float* sdO = sQ + BR * d;     // [BR][dv]
    float* sK = sdO + BR * dv;    // [32][KP]
    float* sV = sK + 32 * KP;     // [32][vp]

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const SliceGeometry g = slice_geometry<VARLEN>(p, bidx, b.nq_pad);
    const i64 nq = g.nq, nk = g.nk;
    const BwdSlice<float> in = bwd_slice<float, VARLEN>(p, b, g, bidx);
    const float *gK = in.k, *gV = in.v;
    const Band band = g.band<CAUSAL>(p);
#pragma unroll 1
    for (ItemWalk<VARLEN, CAUSAL> walk(tiles_of(nq, BR)); walk.more(); walk.next()) {
        const int tid = walk.start(), warp = tid / 32, lane = tid % 32;
        const int q_tile = walk.tile();
        const i64 q0 = (i64)q_tile * BR;
        load_rows_f32(sQ, in.q, p.q_row_stride, q0, nq, BR, d, d, d, tid, NT);
        load_rows_f32(sdO, in.dout, b.do_row_stride, q0, nq, BR, dv, dv, dv, tid, NT);
        const i64 q_end = q0 + BR < nq ? q0 + BR : nq;
        const auto tiles = key_tiles<SPARSE>(p, band, bidx, q_tile, q0, q_end, 32, nk);
        const float scale = (float)p.scale;

        float m_row[RPW], log2l[RPW], delta[RPW], acc[RPW][DT];
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const i64 q = q0 + warp * RPW + r;  // rows past nq read the padding (m = +inf)
            m_row[r] = in.lse2[2 * q];
            log2l[r] = in.lse2[2 * q + 1];
            delta[r] = in.delta[q];
#pragma unroll
            for (int u = 0; u < DT; ++u) acc[r][u] = 0.f;
        }
        for (int it = 0; it < tiles.count; ++it) {
            const i64 k0 = (i64)tiles.tile(it) * 32;
            __syncthreads();
            load_rows_f32(sK, gK, p.k_row_stride, k0, nk, 32, DT * 32, d, KP, tid, NT);
            load_rows_f32(sV, gV, p.v_row_stride, k0, nk, 32, dv, dv, vp, tid, NT);
            __syncthreads();
            const i64 key = k0 + lane;
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                const int row = warp * RPW + r;
                float s = 0.f, dp = 0.f;
                for (int c = 0; c < d; ++c) s = fmaf(sQ[row * d + c], sK[lane * KP + c], s);
                for (int c = 0; c < dv; ++c) dp = fmaf(sdO[row * dv + c], sV[lane * vp + c], dp);
                const float pr = pair_allowed(p, band, tiles, tiles.partial(it), q0 + row, key, nq, nk) ? recompute_p(s, scale, m_row[r], log2l[r]) : 0.f;
                const float ds = pr * (dp - delta[r]);
                for (int j = 0; j < 32; ++j) {
                    const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
                    for (int u = 0; u < DT; ++u) acc[r][u] = fmaf(dsj, sK[j * KP + lane + 32 * u], acc[r][u]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const i64 q = q0 + warp * RPW + r;
            if (q >= nq) continue;
#pragma unroll
            for (int u = 0; u < DT; ++u)
                if (lane + 32 * u < d) b.dq_acc[(g.rows + q) * d + lane + 32 * u] = scale * acc[r][u];
        }
    }  // items
}

}  // namespace cuflash
