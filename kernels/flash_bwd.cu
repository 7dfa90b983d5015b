// flash_bwd.cu: the recomputing backward pass (FlashAttention-2's order) on tensor cores,
// float16 / bfloat16, sm_80 and newer.
//
// With S = scale * Q K^T, P = softmax(S), O = P V and the incoming dO:
//     dV = P^T dO        dP = dO V^T        dS = P o (dP - D),  D = rowsum(dO o O)
//     dQ = scale * dS K          dK = scale * dS^T Q
// P is never stored: it is recomputed tile by tile from Q, K and the forward's statistics,
// folded into lse2 = (m + log l) * log2(e), so that P = exp2(scale_log2 * q.k - lse2).
//
// flash_bwd_preprocess   D and lse2 per query row (O(N d) work, one pass over dO and O).
// flash_bwd_kernel       one CTA per key tile of BC = 16 * NWARPS keys; each warp owns 16 keys
//                        and accumulates their dK and dV rows in registers while the CTA walks
//                        the query tiles. dQ of each query tile is reduced across the key
//                        warps through shared memory and added to a float32 dQ with atomics
//                        (ATOMIC_DQ), or left to flash_bwd_dq_kernel.
// flash_bwd_dq_kernel    deterministic dQ: one CTA per query tile walks the key tiles, like the
//                        forward, recomputing S and dP (two more matmuls, no atomics).
// Head dims above 128 run flash_bwd_kernel twice (DO_DV then DO_DK) so that only one of the
// two register-resident accumulators is live at a time.
#include "common.cuh"
#include "mask.cuh"
#include "tile_io.cuh"

namespace cuflash {

constexpr float kLog2e = 1.4426950408889634f;  // 1 / ln(2)

// ---- preprocess: D = rowsum(dO o O), lse2 ------------------------------------------------
// One warp per row; rows in [nq, nq_pad) get D = 0 and lse2 = +inf, so that padded rows of a
// statistics tile contribute P = 0.
template <typename T, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
flash_bwd_preprocess(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b) {
    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 row = (i64)blockIdx.x * NWARPS + warp;
    if (row >= b.nq_pad) return;
    const i64 stat = bidx * b.nq_pad + row;
    if (row >= p.nq) {
        if (lane == 0) { b.delta[stat] = 0.f; b.lse2[stat] = pos_inf(); }
        return;
    }
    const T* dout = static_cast<const T*>(b.dout) + lead_offset(p, bidx, b.do_lead_stride) + row * b.do_row_stride;
    const T* out = static_cast<const T*>(b.out) + lead_offset(p, bidx, b.o_lead_stride) + row * b.o_row_stride;
    float acc = 0.f;
    for (int c = lane; c < p.dv; c += 32) acc = fmaf(to_float(dout[c]), to_float(out[c]), acc);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
        const float l = b.l[bidx * p.nq + row], m = b.m[bidx * p.nq + row];
        b.delta[stat] = acc;
        // A row that saw no key (l = 0) must give P = 0 everywhere: +inf, not log(0) = -inf.
        b.lse2[stat] = l > 0.f ? (m + logf(l)) * kLog2e : pos_inf();
    }
}

// Stores two adjacent gradient values at row_offset + col (col < ncols, even), as fp32 or,
// when in_dtype, packed in the input dtype T.
template <typename T>
__device__ __forceinline__ void store_pair(float* base, i64 row_offset, int col, i64 ncols, i64 in_dtype,
                                           float x0, float x1) {
    if (col >= ncols) return;
    if (in_dtype)
        *reinterpret_cast<u32*>(reinterpret_cast<T*>(base) + row_offset + col) = pack2<T>(x0, x1);
    else
        *reinterpret_cast<float2*>(base + row_offset + col) = make_float2(x0, x1);
}

template <int HD, int HDV, int BR, int BC>
struct BwdSmemLayout {
    static constexpr int k_pitch = HD + kSmemPad, q_pitch = HD + kSmemPad;
    static constexpr int v_pitch = HDV + kSmemPad, do_pitch = HDV + kSmemPad;
    static constexpr int ds_pitch = BR + kSmemPad;  // dS^T, [key][query]
    // float statistics first (16-byte aligned), then the 16-bit tiles
    static constexpr int stats_bytes = 4 * 2 * 2 * BR;  // lse2 and D, two stages
    static constexpr int k_elems = BC * k_pitch, v_elems = BC * v_pitch;
    static constexpr int q_elems = BR * q_pitch, do_elems = BR * do_pitch;  // per stage
    static constexpr int ds_elems = BC * ds_pitch;
    static constexpr int bytes = stats_bytes + 2 * (k_elems + v_elems + 2 * q_elems + 2 * do_elems + ds_elems);
};

template <typename T, int HD, int HDV, int BR, int BC, int NWARPS, int MINB, bool CAUSAL,
          bool DO_DK, bool DO_DV, bool ATOMIC_DQ>
__global__ void __launch_bounds__(NWARPS * 32, MINB)
flash_bwd_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b) {
    static_assert(BC == 16 * NWARPS, "each warp owns 16 keys");
    static_assert(HD % 16 == 0 && HDV % 16 == 0 && BR % 16 == 0, "mma tiles are 16 wide");
    constexpr int NT = NWARPS * 32;
    // The dQ step splits the CTA's warps over (query row tile, head-dim slice).
    constexpr int DQ_ROW_TILES = BR / 16;
    static_assert(NWARPS % DQ_ROW_TILES == 0, "warps must cover the query row tiles");
    constexpr int DQ_GROUPS = NWARPS / DQ_ROW_TILES;
    constexpr int DQ_COLS = (HD / DQ_GROUPS + 15) / 16 * 16;  // the last slice may overhang HD
    using L = BwdSmemLayout<HD, HDV, BR, BC>;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)L::bytes) __trap();
    }
    float* sLse = reinterpret_cast<float*>(smem_raw);  // [2][BR]
    float* sD = sLse + 2 * BR;                          // [2][BR]
    T* sK = reinterpret_cast<T*>(smem_raw + L::stats_bytes);
    T* sV = sK + L::k_elems;
    T* sQ = sV + L::v_elems;        // [2][BR][q_pitch]
    T* sdO = sQ + 2 * L::q_elems;   // [2][BR][do_pitch]
    T* sdS = sdO + 2 * L::do_elems; // [BC][ds_pitch]

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const i64 nq = p.nq, nk = p.nk;
    const i64 j0 = (i64)blockIdx.x * BC;

    const BatchOffsets off = batch_offsets(p, bidx);
    const T* gQ = static_cast<const T*>(p.q) + off.q;
    const T* gK = static_cast<const T*>(p.k) + off.k;
    const T* gV = static_cast<const T*>(p.v) + off.v;
    const T* gdO = static_cast<const T*>(b.dout) + lead_offset(p, bidx, b.do_lead_stride);
    const float* gLse = b.lse2 + bidx * b.nq_pad;
    const float* gD = b.delta + bidx * b.nq_pad;

    // Causal: the first query that sees key j0 is j0 - (nk - nq).
    const int n_qtiles = (int)((nq + BR - 1) / BR);
    i64 first_q = CAUSAL ? j0 - (nk - nq) : 0;
    first_q = first_q < 0 ? 0 : first_q;
    const int i_begin = (int)(first_q / BR);

    const float scale_log2 = (float)p.scale_log2;
    const float scale = (float)p.scale;
    const int my_col = 2 * (lane % 4);
    const i64 my_key[2] = {j0 + warp * 16 + lane / 4, j0 + warp * 16 + lane / 4 + 8};

    float acc_dk[DO_DK ? HD / 8 : 1][4];
    float acc_dv[DO_DV ? HDV / 8 : 1][4];
#pragma unroll
    for (int n = 0; n < (DO_DK ? HD / 8 : 1); ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[n][e] = 0.f;
#pragma unroll
    for (int n = 0; n < (DO_DV ? HDV / 8 : 1); ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dv[n][e] = 0.f;

    auto load_query_tile = [&](int i, int stage) {
        const i64 i0 = (i64)i * BR;
        load_tile_async<BR, HD, L::q_pitch, NT>(sQ + stage * L::q_elems, gQ, p.q_row_stride, i0, nq, p.d, tid);
        load_tile_async<BR, HDV, L::do_pitch, NT>(sdO + stage * L::do_elems, gdO, b.do_row_stride, i0, nq, p.dv, tid);
        load_floats_async<BR, NT>(sLse + stage * BR, gLse + i0, tid);
        load_floats_async<BR, NT>(sD + stage * BR, gD + i0, tid);
    };

    if (i_begin < n_qtiles) {
        load_tile_async<BC, HD, L::k_pitch, NT>(sK, gK, p.k_row_stride, j0, nk, p.d, tid);
        load_tile_async<BC, HDV, L::v_pitch, NT>(sV, gV, p.v_row_stride, j0, nk, p.dv, tid);
        load_query_tile(i_begin, 0);
        cp_async_commit();
    }

    for (int i = i_begin; i < n_qtiles; ++i) {
        const int stage = (i - i_begin) & 1;
        cp_async_wait<0>();
        __syncthreads();  // tile i landed; every warp is done with tile i-1 (and with sdS)
        if (i + 1 < n_qtiles) load_query_tile(i + 1, stage ^ 1);
        cp_async_commit();
        const T* cQ = sQ + stage * L::q_elems;
        const T* cdO = sdO + stage * L::do_elems;
        const float* cLse = sLse + stage * BR;
        const float* cD = sD + stage * BR;
        const i64 i0 = (i64)i * BR;

        // -- S^T = K_w Q^T: this warp's 16 keys against the BR queries --
        float acc_s[BR / 8][4];
#pragma unroll
        for (int n = 0; n < BR / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[n][e] = 0.f;
        // Partly unrolled k-loops: fully unrolled, the compiler keeps every K and V fragment
        // of the warp live at once and the kernel spills.
#pragma unroll 2
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, smem_addr(sK + (warp * 16 + lane % 16) * L::k_pitch + kk * 16 + (lane / 16) * 8));
#pragma unroll
            for (int nn = 0; nn < BR / 16; ++nn) {
                u32 bq[4];
                ldmatrix_x4(bq, smem_addr(cQ + (nn * 16 + lane % 8 + (lane / 16) * 8) * L::q_pitch +
                                          kk * 16 + ((lane / 8) % 2) * 8));
                mma_16816<T>(acc_s[2 * nn], a, bq[0], bq[1]);
                mma_16816<T>(acc_s[2 * nn + 1], a, bq[2], bq[3]);
            }
        }
        // -- mask (keys past nk, causal diagonal); queries past nq need none: lse2 = +inf --
        if (j0 + BC > nk || (CAUSAL && j0 + BC - 1 > i0 + (nk - nq))) {
            const TileMask mask(i0, j0, nq, nk);
#pragma unroll
            for (int n = 0; n < BR / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key_local = warp * 16 + lane / 4 + 8 * (e / 2);
                    if (!mask.allowed<CAUSAL>(n * 8 + my_col + (e & 1), key_local)) acc_s[n][e] = neg_inf();
                }
        }
        // -- P^T = exp2(S^T * scale_log2 - lse2[query]) --
#pragma unroll
        for (int n = 0; n < BR / 8; ++n) {
            const float lse_a = cLse[n * 8 + my_col], lse_b = cLse[n * 8 + my_col + 1];
            acc_s[n][0] = fast_exp2(acc_s[n][0] * scale_log2 - lse_a);
            acc_s[n][1] = fast_exp2(acc_s[n][1] * scale_log2 - lse_b);
            acc_s[n][2] = fast_exp2(acc_s[n][2] * scale_log2 - lse_a);
            acc_s[n][3] = fast_exp2(acc_s[n][3] * scale_log2 - lse_b);
        }

        // -- dV_w += P^T dO (P^T packed as A fragments; dO read transposed) --
        if constexpr (DO_DV) {
#pragma unroll
            for (int kk = 0; kk < BR / 16; ++kk) {
                const u32 pa[4] = {pack2<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]),
                                   pack2<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]),
                                   pack2<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]),
                                   pack2<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3])};
#pragma unroll
                for (int nd = 0; nd < HDV / 16; ++nd) {
                    u32 bo[4];
                    ldmatrix_x4_trans(bo, smem_addr(cdO + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * L::do_pitch +
                                                    nd * 16 + (lane / 16) * 8));
                    mma_16816<T>(acc_dv[2 * nd], pa, bo[0], bo[1]);
                    mma_16816<T>(acc_dv[2 * nd + 1], pa, bo[2], bo[3]);
                }
            }
        }

        if constexpr (DO_DK || ATOMIC_DQ) {
            // -- dP^T = V_w dO^T --
            float acc_dp[BR / 8][4];
#pragma unroll
            for (int n = 0; n < BR / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dp[n][e] = 0.f;
#pragma unroll 2
            for (int kk = 0; kk < HDV / 16; ++kk) {
                u32 a[4];
                ldmatrix_x4(a, smem_addr(sV + (warp * 16 + lane % 16) * L::v_pitch + kk * 16 + (lane / 16) * 8));
#pragma unroll
                for (int nn = 0; nn < BR / 16; ++nn) {
                    u32 bo[4];
                    ldmatrix_x4(bo, smem_addr(cdO + (nn * 16 + lane % 8 + (lane / 16) * 8) * L::do_pitch +
                                              kk * 16 + ((lane / 8) % 2) * 8));
                    mma_16816<T>(acc_dp[2 * nn], a, bo[0], bo[1]);
                    mma_16816<T>(acc_dp[2 * nn + 1], a, bo[2], bo[3]);
                }
            }
            // -- dS^T = P^T o (dP^T - D[query]), packed to 16 bits --
            u32 ds_frag[BR / 16][4];
#pragma unroll
            for (int kk = 0; kk < BR / 16; ++kk) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int n = 2 * kk + half;
                    const float d_a = cD[n * 8 + my_col], d_b = cD[n * 8 + my_col + 1];
                    ds_frag[kk][2 * half] = pack2<T>(acc_s[n][0] * (acc_dp[n][0] - d_a),
                                                     acc_s[n][1] * (acc_dp[n][1] - d_b));
                    ds_frag[kk][2 * half + 1] = pack2<T>(acc_s[n][2] * (acc_dp[n][2] - d_a),
                                                         acc_s[n][3] * (acc_dp[n][3] - d_b));
                }
            }
            // -- dK_w += dS^T Q (scale applied at the end) --
            if constexpr (DO_DK) {
#pragma unroll
                for (int kk = 0; kk < BR / 16; ++kk) {
#pragma unroll
                    for (int nd = 0; nd < HD / 16; ++nd) {
                        u32 bq[4];
                        ldmatrix_x4_trans(bq, smem_addr(cQ + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * L::q_pitch +
                                                        nd * 16 + (lane / 16) * 8));
                        mma_16816<T>(acc_dk[2 * nd], ds_frag[kk], bq[0], bq[1]);
                        mma_16816<T>(acc_dk[2 * nd + 1], ds_frag[kk], bq[2], bq[3]);
                    }
                }
            }
            // -- dQ_i += scale * dS K: reduce over this CTA's keys through shared memory --
            if constexpr (ATOMIC_DQ) {
                T* ds_row = sdS + (warp * 16 + lane / 4) * L::ds_pitch;
#pragma unroll
                for (int kk = 0; kk < BR / 16; ++kk) {
                    *reinterpret_cast<u32*>(ds_row + kk * 16 + my_col) = ds_frag[kk][0];
                    *reinterpret_cast<u32*>(ds_row + 8 * L::ds_pitch + kk * 16 + my_col) = ds_frag[kk][1];
                    *reinterpret_cast<u32*>(ds_row + kk * 16 + 8 + my_col) = ds_frag[kk][2];
                    *reinterpret_cast<u32*>(ds_row + 8 * L::ds_pitch + kk * 16 + 8 + my_col) = ds_frag[kk][3];
                }
                __syncthreads();
                const int mt = warp % DQ_ROW_TILES, col0 = (warp / DQ_ROW_TILES) * DQ_COLS;
                float acc_dq[DQ_COLS / 8][4];
#pragma unroll
                for (int n = 0; n < DQ_COLS / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_dq[n][e] = 0.f;
#pragma unroll 2
                for (int kk = 0; kk < BC / 16; ++kk) {
                    u32 a[4];  // dS rows (queries) from the [key][query] tile, transposed on load
                    ldmatrix_x4_trans(a, smem_addr(sdS + (kk * 16 + (lane / 16) * 8 + lane % 8) * L::ds_pitch +
                                                   mt * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
                    for (int nd = 0; nd < DQ_COLS / 16; ++nd) {
                        if (DQ_COLS * DQ_GROUPS > HD && col0 + nd * 16 >= HD) break;
                        u32 bk[4];
                        ldmatrix_x4_trans(bk, smem_addr(sK + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * L::k_pitch +
                                                        col0 + nd * 16 + (lane / 16) * 8));
                        mma_16816<T>(acc_dq[2 * nd], a, bk[0], bk[1]);
                        mma_16816<T>(acc_dq[2 * nd + 1], a, bk[2], bk[3]);
                    }
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const i64 q = i0 + mt * 16 + lane / 4 + 8 * h;
                    if (q >= nq) continue;
                    float* dq_row = b.dq_acc + (bidx * nq + q) * p.d;
#pragma unroll
                    for (int n = 0; n < DQ_COLS / 8; ++n) {
                        const int col = col0 + n * 8 + my_col;
                        if (col < p.d) {
                            atomicAdd(dq_row + col, scale * acc_dq[n][2 * h]);
                            atomicAdd(dq_row + col + 1, scale * acc_dq[n][2 * h + 1]);
                        }
                    }
                }
            }
        }
    }

    // -- write this warp's dK (scaled) and dV rows: fp32 for a later reduction, or final in T --
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 key = my_key[h];
        if (key >= nk) continue;
        if constexpr (DO_DK) {
#pragma unroll
            for (int n = 0; n < HD / 8; ++n)
                store_pair<T>(b.dk_acc, (bidx * nk + key) * p.d, n * 8 + my_col, p.d, b.dkv_in_dtype,
                              scale * acc_dk[n][2 * h], scale * acc_dk[n][2 * h + 1]);
        }
        if constexpr (DO_DV) {
#pragma unroll
            for (int n = 0; n < HDV / 8; ++n)
                store_pair<T>(b.dv_acc, (bidx * nk + key) * p.dv, n * 8 + my_col, p.dv, b.dkv_in_dtype,
                              acc_dv[n][2 * h], acc_dv[n][2 * h + 1]);
        }
    }
}

// ---- deterministic dQ ------------------------------------------------------------------
template <int HD, int HDV, int BR, int BC>
struct BwdDqSmemLayout {
    static constexpr int q_pitch = HD + kSmemPad, k_pitch = HD + kSmemPad;
    static constexpr int do_pitch = HDV + kSmemPad, v_pitch = HDV + kSmemPad;
    static constexpr int q_elems = BR * q_pitch, do_elems = BR * do_pitch;
    static constexpr int k_elems = BC * k_pitch, v_elems = BC * v_pitch;  // per stage
    static constexpr int bytes = 2 * (q_elems + do_elems + 2 * k_elems + 2 * v_elems);
};

template <typename T, int HD, int HDV, int BR, int BC, int NWARPS, int MINB, bool CAUSAL>
__global__ void __launch_bounds__(NWARPS * 32, MINB)
flash_bwd_dq_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b) {
    static_assert(BR == 16 * NWARPS, "each warp owns 16 query rows");
    constexpr int NT = NWARPS * 32;
    using L = BwdDqSmemLayout<HD, HDV, BR, BC>;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)L::bytes) __trap();
    }
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sdO = sQ + L::q_elems;
    T* sK = sdO + L::do_elems;       // [2][BC][k_pitch]
    T* sV = sK + 2 * L::k_elems;     // [2][BC][v_pitch]

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int q_tile = CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const i64 q0 = (i64)q_tile * BR, nq = p.nq, nk = p.nk;
    const BatchOffsets off = batch_offsets(p, bidx);
    const T* gQ = static_cast<const T*>(p.q) + off.q;
    const T* gK = static_cast<const T*>(p.k) + off.k;
    const T* gV = static_cast<const T*>(p.v) + off.v;
    const T* gdO = static_cast<const T*>(b.dout) + lead_offset(p, bidx, b.do_lead_stride);
    const i64 q_end = q0 + BR < nq ? q0 + BR : nq;
    const int n_tiles = (int)((key_limit<CAUSAL>(q_end, nq, nk) + BC - 1) / BC);

    const int my_col = 2 * (lane % 4);
    const i64 my_q[2] = {q0 + warp * 16 + lane / 4, q0 + warp * 16 + lane / 4 + 8};
    float lse[2], delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows past nq read the padding: lse2 = +inf, D = 0
        lse[h] = b.lse2[bidx * b.nq_pad + my_q[h]];
        delta[h] = b.delta[bidx * b.nq_pad + my_q[h]];
    }
    const float scale_log2 = (float)p.scale_log2;

    float acc_dq[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[n][e] = 0.f;

    if (n_tiles > 0) {
        load_tile_async<BR, HD, L::q_pitch, NT>(sQ, gQ, p.q_row_stride, q0, nq, p.d, tid);
        load_tile_async<BR, HDV, L::do_pitch, NT>(sdO, gdO, b.do_row_stride, q0, nq, p.dv, tid);
        load_tile_async<BC, HD, L::k_pitch, NT>(sK, gK, p.k_row_stride, 0, nk, p.d, tid);
        load_tile_async<BC, HDV, L::v_pitch, NT>(sV, gV, p.v_row_stride, 0, nk, p.dv, tid);
        cp_async_commit();
    }
    for (int t = 0; t < n_tiles; ++t) {
        cp_async_wait<0>();
        __syncthreads();
        if (t + 1 < n_tiles) {
            const int stage = (t + 1) & 1;
            load_tile_async<BC, HD, L::k_pitch, NT>(sK + stage * L::k_elems, gK, p.k_row_stride, (i64)(t + 1) * BC, nk, p.d, tid);
            load_tile_async<BC, HDV, L::v_pitch, NT>(sV + stage * L::v_elems, gV, p.v_row_stride, (i64)(t + 1) * BC, nk, p.dv, tid);
        }
        cp_async_commit();
        const T* cK = sK + (t & 1) * L::k_elems;
        const T* cV = sV + (t & 1) * L::v_elems;
        const i64 k0 = (i64)t * BC;

        // -- S = Q K^T and dP = dO V^T, this warp's 16 queries against BC keys --
        float acc_s[BC / 8][4], acc_dp[BC / 8][4];
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[n][e] = acc_dp[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, smem_addr(sQ + (warp * 16 + lane % 16) * L::q_pitch + kk * 16 + (lane / 16) * 8));
#pragma unroll
            for (int nn = 0; nn < BC / 16; ++nn) {
                u32 bk[4];
                ldmatrix_x4(bk, smem_addr(cK + (nn * 16 + lane % 8 + (lane / 16) * 8) * L::k_pitch + kk * 16 + ((lane / 8) % 2) * 8));
                mma_16816<T>(acc_s[2 * nn], a, bk[0], bk[1]);
                mma_16816<T>(acc_s[2 * nn + 1], a, bk[2], bk[3]);
            }
        }
#pragma unroll
        for (int kk = 0; kk < HDV / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, smem_addr(sdO + (warp * 16 + lane % 16) * L::do_pitch + kk * 16 + (lane / 16) * 8));
#pragma unroll
            for (int nn = 0; nn < BC / 16; ++nn) {
                u32 bv[4];
                ldmatrix_x4(bv, smem_addr(cV + (nn * 16 + lane % 8 + (lane / 16) * 8) * L::v_pitch + kk * 16 + ((lane / 8) % 2) * 8));
                mma_16816<T>(acc_dp[2 * nn], a, bv[0], bv[1]);
                mma_16816<T>(acc_dp[2 * nn + 1], a, bv[2], bv[3]);
            }
        }
        if (tile_needs_mask<CAUSAL>(q0, k0, BC, nq, nk)) {
            const TileMask mask(q0, k0, nq, nk);
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int q_local = warp * 16 + lane / 4 + 8 * (e / 2);
                    if (!mask.allowed<CAUSAL>(q_local, n * 8 + my_col + (e & 1))) acc_s[n][e] = neg_inf();
                }
        }
        // -- dS = P o (dP - D), P = exp2(S * scale_log2 - lse2), as A fragments --
        u32 ds_frag[BC / 16][4];
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float* s = acc_s[2 * kk + half];
                const float* dp = acc_dp[2 * kk + half];
                ds_frag[kk][2 * half] = pack2<T>(fast_exp2(s[0] * scale_log2 - lse[0]) * (dp[0] - delta[0]),
                                                 fast_exp2(s[1] * scale_log2 - lse[0]) * (dp[1] - delta[0]));
                ds_frag[kk][2 * half + 1] = pack2<T>(fast_exp2(s[2] * scale_log2 - lse[1]) * (dp[2] - delta[1]),
                                                     fast_exp2(s[3] * scale_log2 - lse[1]) * (dp[3] - delta[1]));
            }
        // -- dQ += dS K (K read transposed) --
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
            for (int nd = 0; nd < HD / 16; ++nd) {
                u32 bk[4];
                ldmatrix_x4_trans(bk, smem_addr(cK + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * L::k_pitch + nd * 16 + (lane / 16) * 8));
                mma_16816<T>(acc_dq[2 * nd], ds_frag[kk], bk[0], bk[1]);
                mma_16816<T>(acc_dq[2 * nd + 1], ds_frag[kk], bk[2], bk[3]);
            }
    }
    const float scale = (float)p.scale;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (my_q[h] >= nq) continue;
        float* row = b.dq_acc + (bidx * nq + my_q[h]) * p.d;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            const int col = n * 8 + my_col;
            if (col < p.d)
                *reinterpret_cast<float2*>(row + col) = make_float2(scale * acc_dq[n][2 * h], scale * acc_dq[n][2 * h + 1]);
        }
    }
}

}  // namespace cuflash
