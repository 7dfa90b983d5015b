// flash_fwd_sm90.cu: the forward pass on Hopper's warpgroup matrix multiply (wgmma, sm_90a)
// for float16 / bfloat16 with head dim 64 or 128.
//
// A CTA owns 128 query rows and is three warpgroups with different jobs:
//   producer     warpgroup 0 copies Q once and then each key tile's K and V into shared
//                memory (a ring of STAGES buffers), signalling "full" mbarriers. (It keeps
//                its share of registers: with setmaxnreg moving them to the consumers, ptxas
//                still allocated the consumers under the 168 of the launch bound and the
//                producer's copy loop spilled.)
//   consumers    warpgroups 1 and 2 own 64 query rows each. Per key tile:
//                  S = Q K^T     wgmma, both operands from shared memory
//                  softmax       online, in registers, as in flash_fwd.cu
//                  O += P V      wgmma with P from registers (the accumulator layout of S is
//                                the A-operand layout) and V from shared memory, transposed
//                and release the buffers through "empty" mbarriers.
// S and P never leave the registers; O, l and m are written once, in flash_fwd.cu's format.
// Masking (causal, window, block-sparse lists and partial blocks) uses mask.cuh like every
// other kernel.
#include "common.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "sm90.cuh"

namespace cuflash {

constexpr int kSm90Rows = 128;        // query rows per CTA: two consumer warpgroups of 64
constexpr int kSm90Threads = 3 * 128;  // producer + two consumers

template <int HD, int BC, int STAGES>
struct Sm90SmemLayout {
    static constexpr int q_bytes = kSm90Rows * HD * 2;
    static constexpr int k_bytes = BC * HD * 2;  // per stage
    static constexpr int v_bytes = BC * HD * 2;
    static constexpr int q_offset = 0;
    static constexpr int k_offset = q_bytes;
    static constexpr int v_offset = k_offset + STAGES * k_bytes;
    static constexpr int barrier_offset = v_offset + STAGES * v_bytes;
    static constexpr int barriers = 1 + 4 * STAGES;  // Q full; K full/empty, V full/empty per stage
    // The swizzled tiles need 1024-byte alignment, which the dynamic shared memory base does
    // not promise: the kernel rounds its base up, hence the slack.
    static constexpr int bytes = barrier_offset + 8 * barriers + 1024;
};

// The mbarriers, 8 bytes each: Q loaded; per stage, K and V loaded ("full", 128 producer
// arrivals) and K and V read ("empty", 256 consumer arrivals).
template <int STAGES>
struct Sm90Barriers {
    u32 base;
    __device__ __forceinline__ u32 q_full() const { return base; }
    __device__ __forceinline__ u32 k_full(int s) const { return base + 8 * (1 + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return base + 8 * (1 + STAGES + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return base + 8 * (1 + 2 * STAGES + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return base + 8 * (1 + 3 * STAGES + s); }
};

// The consumer warpgroups' side of flash_fwd_sm90_kernel: 64 query rows from row0 of the
// CTA's tile, every key tile the producer delivers.
template <typename T, int HD, int BC, int STAGES, bool CAUSAL, bool SPARSE>
__device__ __forceinline__ void consume(const FwdParams& p, const TileList<SPARSE>& tiles, const Band& band,
                                        i64 bidx, i64 q0, int tid, u32 sQ, u32 sK, u32 sV, Sm90Barriers<STAGES> bar) {
    using L = Sm90SmemLayout<HD, BC, STAGES>;
    const int n_tiles = tiles.count;
    const i64 nq = p.nq, nk = p.nk;
    const int warpgroup = tid / 128;
    const int ct = tid - 128 * warpgroup;  // thread in the warpgroup
    const int row0 = 64 * (warpgroup - 1);  // the warpgroup's first row in the CTA's tile
    const int warp = ct / 32, lane = ct % 32;
    const i64 warp_q0 = q0 + row0 + 16 * warp;
    const int my_col = 2 * (lane % 4);
    const float scale_log2 = (float)p.scale_log2;
    int clean_first, clean_last;  // this warp's key tiles that need no element mask
    band.clean_key_tiles(warp_q0, 16, BC, nk, clean_first, clean_last);

    float acc_o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[n][e] = 0.f;
    OnlineSoftmax<2> softmax;
    softmax.init();

    if (n_tiles > 0) sm90::mbarrier_wait(bar.q_full(), 0);
    for (int t = 0; t < n_tiles; ++t) {
        const int s = t % STAGES;
        const u32 parity = (t / STAGES) & 1;
        const int k_tile = tiles.tile(t);
        const i64 k0 = (i64)k_tile * BC;

        // -- S = Q K^T --
        float acc_s[BC / 8][4];
        sm90::mbarrier_wait(bar.k_full(s), parity);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
            sm90::wgmma_ss<T, BC>(acc_s, sm90::kmajor_desc<kSm90Rows>(sQ, row0, kk),
                                  sm90::kmajor_desc<BC>(sK + s * L::k_bytes, 0, kk), kk > 0);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_operand(acc_s);
        sm90::mbarrier_arrive(bar.k_empty(s));

        // -- mask: tiles crossing the key end or the band's edges, and partial blocks --
        if (k_tile < clean_first || k_tile > clean_last) {
            const TileMask mask(band, warp_q0, k0, nk);
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!mask.allowed(lane / 4 + 8 * (e / 2), n * 8 + my_col + (e & 1))) acc_s[n][e] = neg_inf();
        }
        if (tiles.partial(t)) {
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const i64 q = warp_q0 + lane / 4 + 8 * (e / 2), key = k0 + n * 8 + my_col + (e & 1);
                    if (q >= nq || key >= nk || !tiles.block_present(p, q, key)) acc_s[n][e] = neg_inf();
                }
        }

        // -- online softmax; P packed as A fragments (flash_fwd.cu explains the layout) --
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
            tile_max[0] = fmaxf(tile_max[0], fmaxf(acc_s[n][0], acc_s[n][1]));
            tile_max[1] = fmaxf(tile_max[1], fmaxf(acc_s[n][2], acc_s[n][3]));
        }
        float base_s[2], correction[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) correction[h] = softmax.advance(h, quad_max(tile_max[h]), scale_log2, base_s[h]);
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            acc_o[n][0] *= correction[0];
            acc_o[n][1] *= correction[0];
            acc_o[n][2] *= correction[1];
            acc_o[n][3] *= correction[1];
        }
        u32 p_frag[BC / 16][4];
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float* sc = acc_s[2 * kk + half];
                const float p0 = fast_exp2((sc[0] - base_s[0]) * scale_log2);
                const float p1 = fast_exp2((sc[1] - base_s[0]) * scale_log2);
                const float p2 = fast_exp2((sc[2] - base_s[1]) * scale_log2);
                const float p3 = fast_exp2((sc[3] - base_s[1]) * scale_log2);
                softmax.l[0] += p0 + p1;
                softmax.l[1] += p2 + p3;
                p_frag[kk][2 * half] = pack2<T>(p0, p1);
                p_frag[kk][2 * half + 1] = pack2<T>(p2, p3);
            }
        }

        // -- O += P V --
        sm90::mbarrier_wait(bar.v_full(s), parity);
        sm90::fence_operand(acc_o);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            sm90::wgmma_rs<T, HD>(acc_o, p_frag[kk], sm90::mnmajor_desc<BC>(sV + s * L::v_bytes, kk), 1);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_operand(acc_o);
        sm90::mbarrier_arrive(bar.v_empty(s));
    }

    // -- epilogue: O /= l, l and m in flash_fwd.cu's format --
    float inv_l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(softmax.l[h]);
        softmax.l[h] = l;
        inv_l[h] = l > 0.f ? 1.f / l : 0.f;  // a row with no allowed key gets o = 0
    }
    T* gO = static_cast<T*>(p.o) + bidx * nq * p.dv;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 q = warp_q0 + lane / 4 + 8 * h;
        if (q >= nq) continue;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            const int col = n * 8 + my_col;
            if (col < p.dv)
                *reinterpret_cast<u32*>(gO + q * p.dv + col) =
                    pack2<T>(acc_o[n][2 * h] * inv_l[h], acc_o[n][2 * h + 1] * inv_l[h]);
        }
        if (lane % 4 == 0) {
            p.l[bidx * nq + q] = softmax.l[h];
            const float m = softmax.m[h];
            p.m[bidx * nq + q] = (m == neg_inf()) ? m : m * (float)p.scale;
        }
    }
}

template <typename T, int HD, int BC, int STAGES, bool CAUSAL, bool SPARSE>
__global__ void __launch_bounds__(kSm90Threads, 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdParams p) {
    using L = Sm90SmemLayout<HD, BC, STAGES>;
    static_assert(HD == 64 || HD == 128, "wgmma paths for head dims 64 and 128");
    static_assert(BC == 64 || BC == 128, "key tiles of 64 or 128");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    require_dynamic_smem((u32)L::bytes);
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = base + L::q_offset, sK = base + L::k_offset, sV = base + L::v_offset;
    const Sm90Barriers<STAGES> bar{base + L::barrier_offset};

    const i64 bidx = flat_batch_index();
    if (bidx >= p.num_batch) return;
    const int tid = threadIdx.x, warpgroup = tid / 128;
    if (tid == 0) {
        sm90::mbarrier_init(bar.q_full(), 128);
        for (int s = 0; s < STAGES; ++s) {
            sm90::mbarrier_init(bar.k_full(s), 128);
            sm90::mbarrier_init(bar.v_full(s), 128);
            sm90::mbarrier_init(bar.k_empty(s), 256);
            sm90::mbarrier_init(bar.v_empty(s), 256);
        }
    }
    __syncthreads();

    const int q_tile = CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const i64 q0 = (i64)q_tile * kSm90Rows;
    const i64 nq = p.nq, nk = p.nk;
    const i64 q_end = q0 + kSm90Rows < nq ? q0 + kSm90Rows : nq;
    const Band band = Band::of<CAUSAL>(p);
    const auto tiles = key_tiles<SPARSE>(p, band, bidx, q_tile, q0, q_end, BC);
    const int n_tiles = tiles.count;

    if (warpgroup == 0) {
        // ---- producer: Q once, then K and V of every tile into the ring ----
        const BatchOffsets off = batch_offsets(p, bidx);
        const T* gQ = static_cast<const T*>(p.q) + off.q;
        const T* gK = static_cast<const T*>(p.k) + off.k;
        const T* gV = static_cast<const T*>(p.v) + off.v;
        if (n_tiles > 0) {
            sm90::load_tile_swizzled<kSm90Rows, HD, 128>(sQ, gQ, p.q_row_stride, q0, nq, p.d, tid);
            cp_async_commit();
            cp_async_wait<0>();
            sm90::fence_async_shared();
            sm90::mbarrier_arrive(bar.q_full());
            for (int t = 0; t < n_tiles; ++t) {
                const int s = t % STAGES;
                const u32 reuse_parity = ((t / STAGES) & 1) ^ 1;  // the previous round's release
                const i64 k0 = (i64)tiles.tile(t) * BC;
                if (t >= STAGES) sm90::mbarrier_wait(bar.k_empty(s), reuse_parity);
                sm90::load_tile_swizzled<BC, HD, 128>(sK + s * L::k_bytes, gK, p.k_row_stride, k0, nk, p.d, tid);
                cp_async_commit();
                if (t >= STAGES) sm90::mbarrier_wait(bar.v_empty(s), reuse_parity);
                sm90::load_tile_swizzled<BC, HD, 128>(sV + s * L::v_bytes, gV, p.v_row_stride, k0, nk, p.dv, tid);
                cp_async_commit();
                cp_async_wait<1>();
                sm90::fence_async_shared();
                sm90::mbarrier_arrive(bar.k_full(s));
                cp_async_wait<0>();
                sm90::fence_async_shared();
                sm90::mbarrier_arrive(bar.v_full(s));
            }
        }
    } else {
        consume<T, HD, BC, STAGES, CAUSAL, SPARSE>(p, tiles, band, bidx, q0, tid, sQ, sK, sV, bar);
    }
}

}  // namespace cuflash
