// flash_bwd.cu: the recomputing backward pass (FlashAttention-2's order) on tensor cores,
// float16 / bfloat16, sm_80 and newer.
//
// With S = scale * Q K^T, P = softmax(S), O = P V and the incoming dO:
//     dV = P^T dO        dP = dO V^T        dS = P o (dP - D),  D = rowsum(dO o O)
//     dQ = scale * dS K          dK = scale * dS^T Q
// P is never stored: it is recomputed tile by tile from Q, K and the forward's statistics,
// kept per row as the pair (m, log2 l): P = exp2((scale * q.k - m) * log2(e) - log2 l)
// (recompute_p in common.cuh).
//
// flash_bwd_preprocess   D and (m, log2 l) per query row (O(N d) work, one pass over dO and O).
// flash_bwd_kernel       one CTA per key tile of BC keys walks the query tiles of BR rows,
//                        keeping dK and dV of its keys in registers (spread over all warps).
//                        P and dS pass through shared memory; dQ of each query tile is added
//                        to a float32 dQ with vector atomics (ATOMIC_DQ), or left to
//                        flash_bwd_dq_kernel.
// flash_bwd_dq_kernel    deterministic dQ: one CTA per query tile walks the key tiles, like the
//                        forward, recomputing S and dP (two more matmuls, no atomics).
// Head dims above 128 run flash_bwd_kernel twice (DO_DV then DO_DK) so that only one of the
// two register-resident accumulators is live at a time.
#include "common.cuh"
#include "mask.cuh"
#include "tile_io.cuh"
#include "bwd_common.cuh"

namespace cuflash {

// ---- preprocess: D = rowsum(dO o O), (m, log2 l) ---------------------------------------------
// Rows in [nq, nq_pad) get D = 0 and (m, log2 l) = (+inf, 0), so that padded rows of a
// statistics tile contribute P = 0. 16-bit rows are read in 16-byte vectors by `width` lanes
// (preprocess_width: the power of two that covers dv, at most 32), so a warp takes 32 / width
// rows at a time; float32 rows one warp a row, element by element (their rows need not be
// 16-byte aligned). Every CTA and warp walks its rows in steps of the whole grid, so the grid
// (sized by BackwardPreprocess.rows_a_cta in cuflash/_variants.py) sets only how the work is
// spread. The slice's pointers
// are computed once a CTA. VARLEN: the rows of one sequence, padded to a multiple of
// kStatsRowMultiple. With zero_dq_acc it also zeroes dQ's float32 accumulator rows (16-byte
// stores: d is a multiple of 8 and the accumulator 256-byte aligned).
template <typename T>
__device__ __forceinline__ int preprocess_width(int dv) {
    if constexpr (sizeof(T) != 2) return 32;
    int width = 1;
    while (width < 32 && width * 8 < dv) width *= 2;
    return width;
}

template <typename T>
__device__ __forceinline__ float dot8(const T* a, const T* b) {  // 8 elements, 16-byte aligned
    const uint4 x = *reinterpret_cast<const uint4*>(a), y = *reinterpret_cast<const uint4*>(b);
    const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 u = unpack2<T>(xs[i]), w = unpack2<T>(ys[i]);
        acc = fmaf(u.x, w.x, fmaf(u.y, w.y, acc));
    }
    return acc;
}

// One variant: a parameter for each field of cuflash/_variants.py's BackwardPreprocess.
template <typename dtype, int warps, bool varlen>
struct BwdPreTraits {
    using T = dtype;
    static constexpr int NWARPS = warps;
    static constexpr bool VARLEN = varlen;
};

template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32)
flash_bwd_preprocess(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b) {
    using T = typename K::T;
    constexpr int NWARPS = K::NWARPS;
    constexpr bool VARLEN = K::VARLEN;
    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const SliceGeometry g = slice_geometry<VARLEN>(p, bidx, b.nq_pad);
    const i64 nq = g.nq, n_rows = VARLEN ? (i64)tiles_of(nq, kStatsRowMultiple) * kStatsRowMultiple : b.nq_pad;
    const BwdSlice<T> in = bwd_slice<T, VARLEN>(p, b, g, bidx);
    const int dv = (int)p.dv, width = preprocess_width<T>(dv);
    const int per_warp = 32 / width, sub = lane / width, col = lane % width;
    const i64 step = (i64)gridDim.x * NWARPS * per_warp;
#pragma unroll 1
    for (i64 first = ((i64)blockIdx.x * NWARPS + warp) * per_warp; first < n_rows; first += step) {  // warp-uniform
        const i64 row = first + sub;
        // The row's l and m are read before the dot product, not after its shuffles: their
        // latency then overlaps dO's and O's instead of following it.
        float l = 0.f, m = 0.f;
        if (col == 0 && row < nq) {
            l = b.l[g.rows + row];
            m = b.m[g.rows + row];
        }
        if (b.zero_dq_acc && row < nq) {  // instead of a memset: the key passes add into these rows
            float4* dq = reinterpret_cast<float4*>(b.dq_acc + (g.rows + row) * p.d);
            for (int c = col; c < (int)p.d / 4; c += width) dq[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        float acc = 0.f;
        if (row < nq) {
            const T* dout = in.dout + row * b.do_row_stride;
            const T* out = in.out + row * b.o_row_stride;
            if constexpr (sizeof(T) == 2) {
                for (int c = 8 * col; c < dv; c += 8 * width) acc += dot8(dout + c, out + c);
            } else {
                for (int c = col; c < dv; c += width) acc = fmaf(to_float(dout[c]), to_float(out[c]), acc);
            }
        }
        for (int o = width / 2; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (col == 0 && row < n_rows) {
            const i64 stat = g.stats + row;
            b.delta[stat] = acc;
            // A row that saw no key (l = 0), or a padded one, must give P = 0 everywhere: m = +inf.
            b.lse2[2 * stat] = l > 0.f ? m : pos_inf();
            b.lse2[2 * stat + 1] = l > 0.f ? log2f(l) : 0.f;
        }
    }
}

// acc[MT][NT] += A B over KSTEPS 16-wide k-steps for one warp's (16 MT) x (8 NT) tile, both
// operands in shared memory. A is stored [m][k] (A_KMAJOR false) or [k][m] (true, read with
// ldmatrix.trans); B is stored [n][k] (B_KMAJOR false) or [k][n] (true). The pointers are
// already offset to the warp's first row / column; pitches are in elements. The k-loop stays
// rolled: unrolled by 2-8 it ran 1-4% faster but spilled 12-52 bytes (bench/NOTES.md, Backward).
template <typename T, int MT, int NT, int KSTEPS, bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void warp_gemm(float (&acc)[MT][NT][4], const T* a, int a_pitch,
                                          const T* b, int b_pitch, int lane) {
    static_assert(NT % 2 == 0, "B fragments are loaded two n-tiles at a time");
#pragma unroll 1
    for (int kk = 0; kk < KSTEPS; ++kk) {
        u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if constexpr (A_KMAJOR)
                ldmatrix_x4_trans(af[mt], smem_addr(a + (kk * 16 + (lane / 16) * 8 + lane % 8) * a_pitch +
                                                    mt * 16 + ((lane / 8) % 2) * 8));
            else
                ldmatrix_x4(af[mt], smem_addr(a + (mt * 16 + lane % 16) * a_pitch + kk * 16 + (lane / 16) * 8));
        }
#pragma unroll
        for (int nn = 0; nn < NT / 2; ++nn) {
            u32 bf[4];
            if constexpr (B_KMAJOR)
                ldmatrix_x4_trans(bf, smem_addr(b + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * b_pitch +
                                                nn * 16 + (lane / 16) * 8));
            else
                ldmatrix_x4(bf, smem_addr(b + (nn * 16 + lane % 8 + (lane / 16) * 8) * b_pitch +
                                          kk * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<T>(acc[mt][2 * nn], af[mt], bf[0], bf[1]);
                mma_16816<T>(acc[mt][2 * nn + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
}

template <int HD, int HDV, int BR, int BC>
struct BwdSmemLayout {
    static constexpr int k_pitch = HD + kSmemPad, q_pitch = HD + kSmemPad;
    static constexpr int v_pitch = HDV + kSmemPad, do_pitch = HDV + kSmemPad;
    static constexpr int p_pitch = BC + kSmemPad;  // P and dS, [query][key]
    // float statistics first (16-byte aligned), then the 16-bit tiles
    static constexpr int stats_bytes = 4 * 3 * 2 * BR;  // (m, log2 l) and D per row, two stages
    static constexpr int k_elems = BC * k_pitch, v_elems = BC * v_pitch;
    static constexpr int q_elems = BR * q_pitch, do_elems = BR * do_pitch;  // per stage
    static constexpr int p_elems = BR * p_pitch;
    static constexpr int bytes = stats_bytes + 2 * (k_elems + v_elems + 2 * q_elems + 2 * do_elems + 2 * p_elems);
};

// One CTA per key tile of BC keys walks the query tiles of BR rows. Each matmul spreads the
// warps over its own output tile in two dimensions (FlashAttention-2's layout), so that a
// warp's operand fragments feed several mmas and no warp reads a whole tile it does not need:
//   S, dP (BR x BC):        WM_S warps along queries x NWARPS / WM_S along keys
//   dK, dV (BC x HD / HDV): WK_KV warps along keys x NWARPS / WK_KV along the head dim
//   dQ (BR x HD):           WM_Q warps along queries x NWARPS / WM_Q along the head dim
// P and dS go through shared memory ([query][key], 16-bit) between the first matmuls and
// the rest; dK and dV stay in registers for the whole walk. varlen: the CTA walks the key
// tiles of its sequence that its grid position names (slice.cuh's work items).
//
// One variant: a parameter for each field of cuflash/_variants.py's TensorCoreBackward, in its
// order (warps_s_rows, warps_kv_rows, warps_dq_rows: WM_S, WK_KV, WM_Q above), then smem_bytes,
// which BwdSmemLayout must come to.
template <typename dtype, int head_dim, int head_dim_v, int block_rows, int block_cols, int warps, int min_blocks,
          bool causal, bool do_dk, bool do_dv, bool atomic_dq, int warps_s_rows, int warps_kv_rows, int warps_dq_rows,
          bool sparse, bool varlen, int smem_bytes>
struct BwdTraits {
    using T = dtype;
    static constexpr int HD = head_dim, HDV = head_dim_v, BR = block_rows, BC = block_cols;
    static constexpr int NWARPS = warps, MINB = min_blocks, SMEM_BYTES = smem_bytes;
    static constexpr int WM_S = warps_s_rows, WK_KV = warps_kv_rows, WM_Q = warps_dq_rows;
    static constexpr bool CAUSAL = causal, DO_DK = do_dk, DO_DV = do_dv, ATOMIC_DQ = atomic_dq;
    static constexpr bool SPARSE = sparse, VARLEN = varlen;
};

template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32, K::MINB)
flash_bwd_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b) {
    using T = typename K::T;
    constexpr int HD = K::HD, HDV = K::HDV, BR = K::BR, BC = K::BC, NWARPS = K::NWARPS, SMEM_BYTES = K::SMEM_BYTES;
    constexpr int WM_S = K::WM_S, WK_KV = K::WK_KV, WM_Q = K::WM_Q;
    constexpr bool CAUSAL = K::CAUSAL, DO_DK = K::DO_DK, DO_DV = K::DO_DV, ATOMIC_DQ = K::ATOMIC_DQ;
    constexpr bool SPARSE = K::SPARSE, VARLEN = K::VARLEN;
    static_assert(HD % 16 == 0 && HDV % 16 == 0 && BR % 16 == 0 && BC % 16 == 0, "mma tiles are 16 wide");
    constexpr int NT = NWARPS * 32;
    constexpr int S_ROWS = BR / WM_S, S_COLS = BC / (NWARPS / WM_S);
    constexpr int KV_ROWS = BC / WK_KV, DK_COLS = HD / (NWARPS / WK_KV), DV_COLS = HDV / (NWARPS / WK_KV);
    constexpr int Q_ROWS = BR / WM_Q, DQ_COLS = HD / (NWARPS / WM_Q);
    static_assert(S_ROWS % 16 == 0 && S_COLS % 16 == 0 && KV_ROWS % 16 == 0 && Q_ROWS % 16 == 0,
                  "every warp tile is whole 16 x 16 blocks");
    static_assert(DK_COLS % 16 == 0 && DV_COLS % 16 == 0 && DQ_COLS % 16 == 0, "head-dim slices are 16 wide");
    using L = BwdSmemLayout<HD, HDV, BR, BC>;
    static_assert(L::bytes == SMEM_BYTES, "shared-memory layout against TensorCoreBackward.fixed_smem");
    static_assert(kStatsRowMultiple % BR == 0, "statistics tiles of BR rows stay inside the padded rows");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    require_dynamic_smem((u32)SMEM_BYTES);
    float* sLse = reinterpret_cast<float*>(smem_raw);  // [2][BR][2]: (m, log2 l)
    float* sD = sLse + 4 * BR;                          // [2][BR]
    T* sK = reinterpret_cast<T*>(smem_raw + L::stats_bytes);
    T* sV = sK + L::k_elems;
    T* sQ = sV + L::v_elems;        // [2][BR][q_pitch]
    T* sdO = sQ + 2 * L::q_elems;   // [2][BR][do_pitch]
    T* sP = sdO + 2 * L::do_elems;  // [BR][p_pitch]
    T* sdS = sP + L::p_elems;       // [BR][p_pitch]

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const SliceGeometry g = slice_geometry<VARLEN>(p, bidx, b.nq_pad);
    const i64 nq = g.nq, nk = g.nk;
    const BwdSlice<T> in = bwd_slice<T, VARLEN>(p, b, g, bidx);
    const T *gQ = in.q, *gK = in.k, *gV = in.v, *gdO = in.dout;
    const float *gLse = in.lse2, *gD = in.delta;

#pragma unroll 1
    for (ItemWalk<VARLEN, false> walk(tiles_of(nk, BC)); walk.more(); walk.next()) {
        const int tid = walk.start(), warp = tid / 32, lane = tid % 32;
        const int key_tile = walk.tile();
        const i64 j0 = (i64)key_tile * BC;

        // The query tiles that see any of this CTA's keys: the band's, or the block mask's list.
        const Band band = g.band<CAUSAL>(p);
        const auto tiles = query_tiles<SPARSE>(p, band, bidx, key_tile, j0, BC, BR, nq, nk);
        int clean_first, clean_last;  // query tiles that need no element mask
        band.clean_query_tiles(j0, BC, BR, nk, clean_first, clean_last);

        const float scale = (float)p.scale;
        const int my_row = lane / 4, my_col = 2 * (lane % 4);  // in every m16n8 accumulator
        // This warp's place in each of the three layouts.
        const int s_row0 = (warp % WM_S) * S_ROWS, s_col0 = (warp / WM_S) * S_COLS;
        const int kv_row0 = (warp % WK_KV) * KV_ROWS;
        const int dk_col0 = (warp / WK_KV) * DK_COLS, dv_col0 = (warp / WK_KV) * DV_COLS;
        const int q_row0 = (warp % WM_Q) * Q_ROWS, dq_col0 = (warp / WM_Q) * DQ_COLS;

        float acc_dk[DO_DK ? KV_ROWS / 16 : 1][DO_DK ? DK_COLS / 8 : 2][4];
        float acc_dv[DO_DV ? KV_ROWS / 16 : 1][DO_DV ? DV_COLS / 8 : 2][4];
        zero(acc_dk);
        zero(acc_dv);

        auto load_query_tile = [&](int i, int stage) {
            const i64 i0 = (i64)i * BR;
            load_tile_async<BR, HD, L::q_pitch, NT>(sQ + stage * L::q_elems, gQ, p.q_row_stride, i0, nq, p.d, tid);
            load_tile_async<BR, HDV, L::do_pitch, NT>(sdO + stage * L::do_elems, gdO, b.do_row_stride, i0, nq, p.dv, tid);
            load_floats_async<2 * BR, NT>(sLse + stage * 2 * BR, gLse + 2 * i0, tid);
            load_floats_async<BR, NT>(sD + stage * BR, gD + i0, tid);
        };

        if (tiles.count > 0) {
            load_kv_async<BC, HD, HDV, L::k_pitch, L::v_pitch, NT>(sK, sV, gK, gV, p, j0, nk, tid);
            load_query_tile(tiles.tile(0), 0);
            cp_async_commit();
        }

        for (int it = 0; it < tiles.count; ++it) {
            const int stage = it & 1, i = tiles.tile(it);
            cp_async_wait<0>();
            __syncthreads();  // tile i landed; every warp is done with the previous one, sP and sdS
            if (it + 1 < tiles.count) load_query_tile(tiles.tile(it + 1), stage ^ 1);
            cp_async_commit();
            const T* cQ = sQ + stage * L::q_elems;
            const T* cdO = sdO + stage * L::do_elems;
            const float* cLse = sLse + stage * 2 * BR;
            const float* cD = sD + stage * BR;
            const i64 i0 = (i64)i * BR;

            // -- S = Q K^T and dP = dO V^T on this warp's (queries x keys) tile --
            constexpr int MT_S = S_ROWS / 16, NT_S = S_COLS / 8;
            float acc_s[MT_S][NT_S][4], acc_dp[MT_S][NT_S][4];
            zero(acc_s);
            warp_gemm<T, MT_S, NT_S, HD / 16, false, false>(acc_s, cQ + s_row0 * L::q_pitch, L::q_pitch,
                                                      sK + s_col0 * L::k_pitch, L::k_pitch, lane);
            // -- mask (keys past nk, the band); queries past nq need none: their m is +inf --
            if (i < clean_first || i > clean_last) {
                // Thresholds relative to this thread's first element, so that each test below
                // compares a register with a compile-time offset (no per-element index registers).
                const TileMask mask(g.band<CAUSAL>(p), i0, j0, nk);
                const int rel = s_row0 + my_row - s_col0 - my_col;
                const int key_room = mask.key_room - s_col0 - my_col;
                const int diag_lo = mask.diag_lo + rel, diag_hi = mask.diag_hi + rel;
#pragma unroll
                for (int mt = 0; mt < MT_S; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int dk = nt * 8 + (e & 1), dq = mt * 16 + 8 * (e / 2);
                            if (dk >= key_room || dk - dq < diag_lo || dk - dq > diag_hi) acc_s[mt][nt][e] = neg_inf();
                        }
            }
            if (tiles.partial(it)) {
#pragma unroll
                for (int mt = 0; mt < MT_S; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const i64 q = i0 + s_row0 + mt * 16 + my_row + 8 * (e / 2);
                            const i64 key = j0 + s_col0 + nt * 8 + my_col + (e & 1);
                            if (q >= nq || key >= nk || !tiles.block_present(p, q, key)) acc_s[mt][nt][e] = neg_inf();
                        }
            }
            // -- P = exp(scale * S - m) / l (recompute_p), packed to 16 bits at once: the fp32
            //    scores die here. When P goes to shared memory for dV, dS reads it back from
            //    there (each thread its own values) instead of holding it through dP's matmul --
            constexpr bool P_IN_SMEM = DO_DV;
            u32 p16[P_IN_SMEM ? 1 : MT_S][P_IN_SMEM ? 1 : NT_S][2];
#pragma unroll
            for (int mt = 0; mt < MT_S; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = s_row0 + mt * 16 + my_row + 8 * h;
                    const float m_row = cLse[2 * row], log2l = cLse[2 * row + 1];
#pragma unroll
                    for (int nt = 0; nt < NT_S; ++nt) {
                        const u32 packed = pack2<T>(recompute_p(acc_s[mt][nt][2 * h], scale, m_row, log2l),
                                                    recompute_p(acc_s[mt][nt][2 * h + 1], scale, m_row, log2l));
                        if constexpr (P_IN_SMEM)
                            *reinterpret_cast<u32*>(sP + row * L::p_pitch + s_col0 + nt * 8 + my_col) = packed;
                        else
                            p16[mt][nt][h] = packed;
                    }
                }
            if constexpr (DO_DK || ATOMIC_DQ) {
                zero(acc_dp);
                warp_gemm<T, MT_S, NT_S, HDV / 16, false, false>(acc_dp, cdO + s_row0 * L::do_pitch, L::do_pitch,
                                                           sV + s_col0 * L::v_pitch, L::v_pitch, lane);
                // -- dS = P o (dP - D[query]), to shared memory in 16 bits --
#pragma unroll
                for (int mt = 0; mt < MT_S; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = s_row0 + mt * 16 + my_row + 8 * h;
                        const float delta = cD[row];
#pragma unroll
                        for (int nt = 0; nt < NT_S; ++nt) {
                            const int at = row * L::p_pitch + s_col0 + nt * 8 + my_col;
                            u32 packed;
                            if constexpr (P_IN_SMEM)
                                packed = *reinterpret_cast<const u32*>(sP + at);
                            else
                                packed = p16[mt][nt][h];
                            const float2 pv = unpack2<T>(packed);
                            *reinterpret_cast<u32*>(sdS + at) =
                                pack2<T>(pv.x * (acc_dp[mt][nt][2 * h] - delta), pv.y * (acc_dp[mt][nt][2 * h + 1] - delta));
                        }
                    }
            }
            __syncthreads();  // P and dS complete

            // -- dV += P^T dO,  dK += dS^T Q (scale applied at the end) --
            if constexpr (DO_DV)
                warp_gemm<T, KV_ROWS / 16, DV_COLS / 8, BR / 16, true, true>(acc_dv, sP + kv_row0, L::p_pitch,
                                                                      cdO + dv_col0, L::do_pitch, lane);
            if constexpr (DO_DK)
                warp_gemm<T, KV_ROWS / 16, DK_COLS / 8, BR / 16, true, true>(acc_dk, sdS + kv_row0, L::p_pitch,
                                                                      cQ + dk_col0, L::q_pitch, lane);
            // -- dQ_i += scale * dS K, added to the float32 dQ with atomics --
            if constexpr (ATOMIC_DQ) {
                float acc_dq[Q_ROWS / 16][DQ_COLS / 8][4];
                zero(acc_dq);
                warp_gemm<T, Q_ROWS / 16, DQ_COLS / 8, BC / 16, false, true>(acc_dq, sdS + q_row0 * L::p_pitch, L::p_pitch,
                                                                      sK + dq_col0, L::k_pitch, lane);
#pragma unroll
                for (int mt = 0; mt < Q_ROWS / 16; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const i64 q = i0 + q_row0 + mt * 16 + my_row + 8 * h;
                        if (q >= nq) continue;
                        float* dq_row = b.dq_acc + (g.rows + q) * p.d;
#pragma unroll
                        for (int nt = 0; nt < DQ_COLS / 8; ++nt) {
                            const int col = dq_col0 + nt * 8 + my_col;
                            if (col < p.d)
                                atomic_add_pair(dq_row + col, scale * acc_dq[mt][nt][2 * h], scale * acc_dq[mt][nt][2 * h + 1]);
                        }
                    }
            }
        }

        // -- write this warp's dK (scaled) and dV: fp32 for a later reduction, or final in T --
#pragma unroll
        for (int mt = 0; mt < KV_ROWS / 16; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 key = j0 + kv_row0 + mt * 16 + my_row + 8 * h;
                if (key >= nk) continue;
                if constexpr (DO_DK) {
#pragma unroll
                    for (int nt = 0; nt < DK_COLS / 8; ++nt)
                        store_pair<T>(b.dk_acc, (g.kv_rows + key) * p.d, dk_col0 + nt * 8 + my_col, p.d, b.dkv_in_dtype,
                                      scale * acc_dk[mt][nt][2 * h], scale * acc_dk[mt][nt][2 * h + 1]);
                }
                if constexpr (DO_DV) {
#pragma unroll
                    for (int nt = 0; nt < DV_COLS / 8; ++nt)
                        store_pair<T>(b.dv_acc, (g.kv_rows + key) * p.dv, dv_col0 + nt * 8 + my_col, p.dv, b.dkv_in_dtype,
                                      acc_dv[mt][nt][2 * h], acc_dv[mt][nt][2 * h + 1]);
                }
            }
    }  // items
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

// One variant: a parameter for each field of cuflash/_variants.py's TensorCoreBackwardDq, in
// its order, then smem_bytes, which BwdDqSmemLayout must come to. varlen: the CTA walks the
// query tiles of its sequence that its grid position names.
template <typename dtype, int head_dim, int head_dim_v, int block_rows, int block_cols, int warps, int min_blocks,
          bool causal, bool sparse, bool varlen, int smem_bytes>
struct BwdDqTraits {
    using T = dtype;
    static constexpr int HD = head_dim, HDV = head_dim_v, BR = block_rows, BC = block_cols;
    static constexpr int NWARPS = warps, MINB = min_blocks, SMEM_BYTES = smem_bytes;
    static constexpr bool CAUSAL = causal, SPARSE = sparse, VARLEN = varlen;
};

template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32, K::MINB)
flash_bwd_dq_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b) {
    using T = typename K::T;
    constexpr int HD = K::HD, HDV = K::HDV, BR = K::BR, BC = K::BC, NWARPS = K::NWARPS, SMEM_BYTES = K::SMEM_BYTES;
    constexpr bool CAUSAL = K::CAUSAL, SPARSE = K::SPARSE, VARLEN = K::VARLEN;
    static_assert(BR == 16 * NWARPS, "each warp owns 16 query rows");
    constexpr int NT = NWARPS * 32;
    using L = BwdDqSmemLayout<HD, HDV, BR, BC>;
    static_assert(L::bytes == SMEM_BYTES, "shared-memory layout against TensorCoreBackwardDq.fixed_smem");
    static_assert(kStatsRowMultiple % BR == 0, "query tiles stay inside the statistics' padded rows");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    require_dynamic_smem((u32)SMEM_BYTES);
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sdO = sQ + L::q_elems;
    T* sK = sdO + L::do_elems;       // [2][BC][k_pitch]
    T* sV = sK + 2 * L::k_elems;     // [2][BC][v_pitch]

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const SliceGeometry g = slice_geometry<VARLEN>(p, bidx, b.nq_pad);
    const i64 nq = g.nq, nk = g.nk;
    const BwdSlice<T> in = bwd_slice<T, VARLEN>(p, b, g, bidx);
    const T *gQ = in.q, *gK = in.k, *gV = in.v, *gdO = in.dout;

#pragma unroll 1
    for (ItemWalk<VARLEN, CAUSAL> walk(tiles_of(nq, BR)); walk.more(); walk.next()) {
        const int tid = walk.start(), warp = tid / 32, lane = tid % 32;
        const int q_tile = walk.tile();
        const i64 q0 = (i64)q_tile * BR;
        const i64 q_end = q0 + BR < nq ? q0 + BR : nq;
        const Band band = g.band<CAUSAL>(p);
        const auto tiles = key_tiles<SPARSE>(p, band, bidx, q_tile, q0, q_end, BC, nk);
        const int n_tiles = tiles.count;
        int clean_first, clean_last;  // this warp's key tiles that need no element mask
        band.clean_key_tiles(q0 + warp * 16, 16, BC, nk, clean_first, clean_last);

        const int my_col = 2 * (lane % 4);
        const i64 my_q[2] = {q0 + warp * 16 + lane / 4, q0 + warp * 16 + lane / 4 + 8};
        float m_row[2], log2l[2], delta[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows past nq read the padding: m = +inf, D = 0
            m_row[h] = in.lse2[2 * my_q[h]];
            log2l[h] = in.lse2[2 * my_q[h] + 1];
            delta[h] = in.delta[my_q[h]];
        }
        const float scale = (float)p.scale;

        float acc_dq[HD / 8][4];
        zero(acc_dq);

        if (n_tiles > 0) {
            load_tile_async<BR, HD, L::q_pitch, NT>(sQ, gQ, p.q_row_stride, q0, nq, p.d, tid);
            load_tile_async<BR, HDV, L::do_pitch, NT>(sdO, gdO, b.do_row_stride, q0, nq, p.dv, tid);
            const i64 k_first = (i64)tiles.tile(0) * BC;
            load_kv_async<BC, HD, HDV, L::k_pitch, L::v_pitch, NT>(sK, sV, gK, gV, p, k_first, nk, tid);
            cp_async_commit();
        }
        for (int t = 0; t < n_tiles; ++t) {
            cp_async_wait<0>();
            __syncthreads();
            if (t + 1 < n_tiles) {
                const int stage = (t + 1) & 1;
                const i64 k_next = (i64)tiles.tile(t + 1) * BC;
                load_kv_async<BC, HD, HDV, L::k_pitch, L::v_pitch, NT>(sK + stage * L::k_elems, sV + stage * L::v_elems,
                                                                       gK, gV, p, k_next, nk, tid);
            }
            cp_async_commit();
            const T* cK = sK + (t & 1) * L::k_elems;
            const T* cV = sV + (t & 1) * L::v_elems;
            const int k_tile = tiles.tile(t);
            const i64 k0 = (i64)k_tile * BC;

            // -- S = Q K^T and dP = dO V^T, this warp's 16 queries against BC keys --
            float acc_s[BC / 8][4], acc_dp[BC / 8][4];
            zero(acc_s);
            zero(acc_dp);
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
            if (k_tile < clean_first || k_tile > clean_last) {
                const TileMask mask(g.band<CAUSAL>(p), q0, k0, nk);
#pragma unroll
                for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!mask.allowed(warp * 16 + lane / 4 + 8 * (e / 2), n * 8 + my_col + (e & 1))) acc_s[n][e] = neg_inf();
            }
            if (tiles.partial(t)) {
#pragma unroll
                for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const i64 q = my_q[e / 2], key = k0 + n * 8 + my_col + (e & 1);
                        if (q >= nq || key >= nk || !tiles.block_present(p, q, key)) acc_s[n][e] = neg_inf();
                    }
            }
            // -- dS = P o (dP - D), P recomputed (recompute_p), as A fragments --
            u32 ds_frag[BC / 16][4];
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float* s = acc_s[2 * kk + half];
                    const float* dp = acc_dp[2 * kk + half];
                    ds_frag[kk][2 * half] = pack2<T>(recompute_p(s[0], scale, m_row[0], log2l[0]) * (dp[0] - delta[0]),
                                                     recompute_p(s[1], scale, m_row[0], log2l[0]) * (dp[1] - delta[0]));
                    ds_frag[kk][2 * half + 1] = pack2<T>(recompute_p(s[2], scale, m_row[1], log2l[1]) * (dp[2] - delta[1]),
                                                         recompute_p(s[3], scale, m_row[1], log2l[1]) * (dp[3] - delta[1]));
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
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (my_q[h] >= nq) continue;
            float* row = b.dq_acc + (g.rows + my_q[h]) * p.d;
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const int col = n * 8 + my_col;
                if (col < p.d)
                    *reinterpret_cast<float2*>(row + col) = make_float2(scale * acc_dq[n][2 * h], scale * acc_dq[n][2 * h + 1]);
            }
        }
    }  // items
}

}  // namespace cuflash
