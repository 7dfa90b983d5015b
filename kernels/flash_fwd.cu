// flash_fwd.cu: the tiled forward pass (FlashAttention, Algorithm 1, in FlashAttention-2's
// loop order) for float16 / bfloat16 on tensor cores (sm_80 and newer).
//
// One CTA owns BR query rows of one (batch..., head) slice and walks the key/value tiles of
// BC rows. Each warp owns BR / NWARPS query rows (one or more 16-row mma tiles), so the
// softmax statistics of a row never leave the warp. Per key tile:
//     S = Q K^T          mma.sync m16n8k16, Q and K read from shared memory with ldmatrix
//     online softmax     running max m and sum l, O rescaled when m grows (softmax.cuh)
//     O += P V           P stays in registers: the accumulator layout of S is the A-operand
//                        layout of the next mma, so P is only packed to 16 bits
// Tiles reach shared memory through 16-byte cp.async, two stages deep: tile t+1 is in flight
// while tile t is computed. S and P never touch device memory; O, l, m are written once.
//
// Every tile size is a template argument chosen by cuflash/_config.py; nothing here picks one.
#include "common.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "tile_io.cuh"
#include "slice.cuh"

namespace cuflash {

template <int HD, int HDV, int BR, int BC>
struct FwdSmemLayout {
    static constexpr int q_pitch = (HD > HDV ? HD : HDV) + kSmemPad;  // O is staged here too
    static constexpr int k_pitch = HD + kSmemPad;
    static constexpr int v_pitch = HDV + kSmemPad;
    static constexpr int q_elems = BR * q_pitch;
    static constexpr int k_elems = BC * k_pitch;  // per stage
    static constexpr int v_elems = BC * v_pitch;  // per stage
    static constexpr int bytes = 2 * (q_elems + 2 * k_elems + 2 * v_elems);
};

// One forward variant: a parameter for each field of cuflash/_variants.py's TensorCoreForward,
// in its order, then smem_bytes, the dynamic shared memory Python sizes the launch with (the
// layout above must come to it). varlen: a packed variable-length batch; the CTA walks the
// query tiles of its sequence that its grid position names (slice.cuh's work items).
template <typename dtype, int head_dim, int head_dim_v, int block_rows, int block_cols, int warps, int min_blocks,
          bool causal, int qk_unroll, bool sparse, bool varlen, int smem_bytes>
struct FwdTraits {
    using T = dtype;
    static constexpr int HD = head_dim, HDV = head_dim_v, BR = block_rows, BC = block_cols;
    static constexpr int NWARPS = warps, MINB = min_blocks, QK_UNROLL = qk_unroll, SMEM_BYTES = smem_bytes;
    static constexpr bool CAUSAL = causal, SPARSE = sparse, VARLEN = varlen;
};

template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32, K::MINB)
flash_fwd_kernel(const __grid_constant__ FwdParams p) {
    using T = typename K::T;
    constexpr int HD = K::HD, HDV = K::HDV, BR = K::BR, BC = K::BC, NWARPS = K::NWARPS, QK_UNROLL = K::QK_UNROLL;
    constexpr int SMEM_BYTES = K::SMEM_BYTES;
    constexpr bool CAUSAL = K::CAUSAL, SPARSE = K::SPARSE, VARLEN = K::VARLEN;
    // Each warp owns MT consecutive 16-row tiles: every K/V fragment it loads from shared
    // memory feeds MT mmas, which is what keeps ldmatrix bandwidth below the mma rate.
    constexpr int MT = BR / (16 * NWARPS);
    static_assert(MT * 16 * NWARPS == BR && MT >= 1, "BR must be a multiple of 16 * NWARPS");
    static_assert(HD % 16 == 0 && HDV % 16 == 0 && BC % 16 == 0, "mma tiles are 16 wide");
    constexpr int NT = NWARPS * 32;
    constexpr int WR = 16 * MT;  // query rows per warp
    using L = FwdSmemLayout<HD, HDV, BR, BC>;
    static_assert(L::bytes == SMEM_BYTES, "shared-memory layout against TensorCoreForward.fixed_smem");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    require_dynamic_smem((u32)SMEM_BYTES);
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + L::q_elems;
    T* sV = sK + 2 * L::k_elems;

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const SliceGeometry g = slice_geometry<VARLEN>(p, bidx);
    const i64 nq = g.nq, nk = g.nk;
    const T* gQ = static_cast<const T*>(p.q) + g.q;
    const T* gK = static_cast<const T*>(p.k) + g.k;
    const T* gV = static_cast<const T*>(p.v) + g.v;

    // Causal: the last query tiles see the most keys (item_tile).
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
        band.clean_key_tiles(q0 + warp * WR, WR, BC, nk, clean_first, clean_last);

        // In the m16n8 accumulator layout a thread holds rows lane/4 and lane/4 + 8 of each
        // 16-row tile, and columns 2*(lane%4) and 2*(lane%4)+1 of every 8-wide column tile.
        // Its rows are numbered r = 2*mt + half: query warp_q0 + 16*mt + lane/4 + 8*half.
        const i64 warp_q0 = q0 + warp * WR;
        const int my_col = 2 * (lane % 4);
        const float scale_log2 = (float)p.scale_log2;

        float acc_o[MT][HDV / 8][4];
        zero(acc_o);
        OnlineSoftmax<2 * MT> softmax;
        softmax.init();

        if (n_tiles > 0) {
            load_tile_async<BR, HD, L::q_pitch, NT>(sQ, gQ, p.q_row_stride, q0, nq, p.d, tid);
            const i64 k_first = (i64)tiles.tile(0) * BC;
            load_kv_async<BC, HD, HDV, L::k_pitch, L::v_pitch, NT>(sK, sV, gK, gV, p, k_first, nk, tid);
            cp_async_commit();
        }

        for (int t = 0; t < n_tiles; ++t) {
            // Tile t has landed, and every warp is done with tile t-1, whose buffers we refill.
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

            // -- S = Q K^T (raw scores, fp32) --
            float acc_s[MT][BC / 8][4];
            zero(acc_s);
            // With one row tile a warp, unrolled fully. With more, unrolled by QK_UNROLL only: a
            // full unroll lets the compiler hoist every Q fragment of the tile into registers at
            // once (HD/16 * MT * 4 of them), which spills.
#pragma unroll(MT == 1 ? HD / 16 : QK_UNROLL)
            for (int kk = 0; kk < HD / 16; ++kk) {
                u32 a[MT][4];  // rows lane%16 of each 16-row tile, columns kk*16 + (lane/16)*8
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldmatrix_x4(a[mt], smem_addr(sQ + (warp * WR + mt * 16 + lane % 16) * L::q_pitch +
                                                 kk * 16 + (lane / 16) * 8));
#pragma unroll
                for (int nn = 0; nn < BC / 16; ++nn) {
                    u32 b[4];  // keys nn*16 + lane%8 (+8 for lanes 16..31), dims +8 for odd octets
                    ldmatrix_x4(b, smem_addr(cK + (nn * 16 + lane % 8 + (lane / 16) * 8) * L::k_pitch +
                                             kk * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816<T>(acc_s[mt][2 * nn], a[mt], b[0], b[1]);
                        mma_16816<T>(acc_s[mt][2 * nn + 1], a[mt], b[2], b[3]);
                    }
                }
            }

            // -- mask: only tiles crossing the key end or the band's edges, and partial blocks --
            if (k_tile < clean_first || k_tile > clean_last) {
                const TileMask mask(g.band<CAUSAL>(p), warp_q0, k0, nk);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (!mask.allowed(mt * 16 + lane / 4 + 8 * (e / 2), n * 8 + my_col + (e & 1)))
                                acc_s[mt][n][e] = neg_inf();
            }
            if (tiles.partial(t)) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const i64 q = warp_q0 + mt * 16 + lane / 4 + 8 * (e / 2), key = k0 + n * 8 + my_col + (e & 1);
                            if (q >= nq || key >= nk || !tiles.block_present(p, q, key)) acc_s[mt][n][e] = neg_inf();
                        }
            }

            // -- online softmax: new row max, rescale O and l, P = exp(scale * (S - m)) --
            // P is packed to 16 bits as m16k16 A fragments: key columns 16kk..16kk+15 come from
            // accumulator tiles 2kk (a0: row r, a1: row r+8) and 2kk+1 (a2, a3).
            u32 p_frag[MT][BC / 16][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
                for (int n = 0; n < BC / 8; ++n) {
                    tile_max[0] = fmaxf(tile_max[0], fmaxf(acc_s[mt][n][0], acc_s[mt][n][1]));
                    tile_max[1] = fmaxf(tile_max[1], fmaxf(acc_s[mt][n][2], acc_s[mt][n][3]));
                }
                float base[2], correction[2];
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    correction[h] = softmax.advance(2 * mt + h, quad_max(tile_max[h]), scale_log2, base[h]);
#pragma unroll
                for (int n = 0; n < HDV / 8; ++n) {
                    acc_o[mt][n][0] *= correction[0];
                    acc_o[mt][n][1] *= correction[0];
                    acc_o[mt][n][2] *= correction[1];
                    acc_o[mt][n][3] *= correction[1];
                }
#pragma unroll
                for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const float* s = acc_s[mt][2 * kk + half];
                        const float p0 = fast_exp2((s[0] - base[0]) * scale_log2);
                        const float p1 = fast_exp2((s[1] - base[0]) * scale_log2);
                        const float p2 = fast_exp2((s[2] - base[1]) * scale_log2);
                        const float p3 = fast_exp2((s[3] - base[1]) * scale_log2);
                        softmax.l[2 * mt] += p0 + p1;
                        softmax.l[2 * mt + 1] += p2 + p3;
                        p_frag[mt][kk][2 * half] = pack2<T>(p0, p1);
                        p_frag[mt][kk][2 * half + 1] = pack2<T>(p2, p3);
                    }
                }
            }

            // -- O += P V (V read transposed by ldmatrix.trans) --
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
                for (int nd = 0; nd < HDV / 16; ++nd) {
                    u32 b[4];  // keys kk*16 + lane%8 (+8 for odd octets), dims nd*16 (+8, lanes 16..31)
                    ldmatrix_x4_trans(b, smem_addr(cV + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) *
                                                       L::v_pitch + nd * 16 + (lane / 16) * 8));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816<T>(acc_o[mt][2 * nd], p_frag[mt][kk], b[0], b[1]);
                        mma_16816<T>(acc_o[mt][2 * nd + 1], p_frag[mt][kk], b[2], b[3]);
                    }
                }
            }
        }

        // -- epilogue: O /= l, staged through this warp's own Q rows for 16-byte stores --
        float inv_l[2 * MT];
#pragma unroll
        for (int r = 0; r < 2 * MT; ++r) inv_l[r] = softmax.finalize<4>(r);
        T* sO = sQ + warp * WR * L::q_pitch;  // only this warp ever read these rows
        __syncwarp();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < HDV / 8; ++n) {
                const int col = n * 8 + my_col;
                *reinterpret_cast<u32*>(sO + (mt * 16 + lane / 4) * L::q_pitch + col) =
                    pack2<T>(acc_o[mt][n][0] * inv_l[2 * mt], acc_o[mt][n][1] * inv_l[2 * mt]);
                *reinterpret_cast<u32*>(sO + (mt * 16 + lane / 4 + 8) * L::q_pitch + col) =
                    pack2<T>(acc_o[mt][n][2] * inv_l[2 * mt + 1], acc_o[mt][n][3] * inv_l[2 * mt + 1]);
            }
        __syncwarp();
        T* gO = static_cast<T*>(p.o) + g.rows * p.dv;
        constexpr int O_CHUNKS = HDV / 8;
#pragma unroll
        for (int i = lane; i < WR * O_CHUNKS; i += 32) {
            const int r = i / O_CHUNKS, c = i % O_CHUNKS;
            const i64 q = warp_q0 + r;
            if (q < nq && c * 8 < p.dv)
                *reinterpret_cast<uint4*>(gO + q * p.dv + c * 8) =
                    *reinterpret_cast<const uint4*>(sO + r * L::q_pitch + c * 8);
        }
        if (lane % 4 == 0) {
#pragma unroll
            for (int r = 0; r < 2 * MT; ++r) {
                const i64 q = warp_q0 + (r / 2) * 16 + lane / 4 + 8 * (r % 2);
                if (q < nq) softmax.store(r, (float)p.scale, p.l + g.rows + q, p.m + g.rows + q);
            }
        }
    }  // items
}

}  // namespace cuflash
