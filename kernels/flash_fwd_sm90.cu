// flash_fwd_sm90.cu: the forward pass on Hopper's warpgroup matrix multiply (wgmma, sm_90a)
// for float16 / bfloat16 with head dim 64, 128 or 256.
//
// A CTA owns 128 query rows and is three warpgroups with different jobs:
//   producer     warpgroup 0 copies Q once and then each key tile's K and V into shared
//                memory (a ring of STAGES buffers), signalling "full" mbarriers: with TMA,
//                one thread issues bulk tensor copies (maps from cuflash/_tma.py); without,
//                all 128 issue 16-byte cp.async. It gives all but 40 of its registers to the
//                consumers (setmaxnreg), so its copy loops stay rolled.
//   consumers    warpgroups 1 and 2 own 64 query rows each. Per key tile:
//                  S = Q K^T     wgmma, both operands from shared memory
//                  softmax       online, in registers, as in flash_fwd.cu
//                  O += P V      wgmma with P from registers (the accumulator layout of S is
//                                the A-operand layout) and V from shared memory, transposed
//                and release the buffers through "empty" mbarriers. With PINGPONG they take
//                turns issuing matmuls (named barriers), one's softmax under the other's.
// S and P never leave the registers; O, l and m are written once, in flash_fwd.cu's format.
// Masking (causal, window, block-sparse lists and partial blocks) uses mask.cuh like every
// other kernel.
#include "common.cuh"
#include "softmax.cuh"
#include "mask.cuh"
#include "sm90.cuh"
#include "slice.cuh"

namespace cuflash {

constexpr int kSm90Rows = CUFLASH_SM90_FWD_ROWS;        // query rows per CTA (HopperForward.block_rows)
constexpr int kSm90Threads = 32 * CUFLASH_SM90_FWD_WARPS;  // HopperForward.threads
static_assert(kSm90Rows == 2 * 64 && kSm90Threads == 3 * 128,
              "a producer warpgroup and two consumer warpgroups of 64 query rows (wgmma's M)");
// Consumers release buffers once a warp (lane 0): they read K, V and Q only through wgmma,
// whose reads are complete for the whole warpgroup once wait_group has returned, so 8
// arrivals stand for 256 (each an atomic on shared memory, twice a tile).
constexpr int kSm90ConsumerWarps = 8;
// setmaxnreg moves registers within what the CTA was launched with: 168 a thread (the cap of
// 384 threads on one CTA per SM). Asking for more than that in total never returns.
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(128 * kProducerRegisters + 256 * kConsumerRegisters <= 168 * kSm90Threads, "register budget");

template <int HD, int BC, int STAGES>
struct Sm90SmemLayout {
    static constexpr int q_bytes = kSm90Rows * HD * 2;
    static constexpr int k_bytes = BC * HD * 2;  // per stage
    static constexpr int v_bytes = BC * HD * 2;
    static constexpr int q_offset = 0;
    static constexpr int k_offset = q_bytes;
    static constexpr int v_offset = k_offset + STAGES * k_bytes;
    static constexpr int barrier_offset = v_offset + STAGES * v_bytes;
    static constexpr int barriers = 2 + 4 * STAGES;  // Q full/empty; K full/empty, V full/empty per stage
    // The swizzled tiles need 1024-byte alignment, which the dynamic shared memory base does
    // not promise: the kernel rounds its base up, hence the slack.
    static constexpr int bytes = barrier_offset + 8 * barriers + 1024;
};

// The mbarriers, 8 bytes each: Q loaded and read; per stage, K and V loaded ("full": 128
// cp.async arrivals, or one with the bytes of a bulk copy) and K and V read ("empty", 256
// consumer arrivals).
template <int STAGES>
struct Sm90Barriers {
    u32 base;
    __device__ __forceinline__ u32 q_full() const { return base; }
    __device__ __forceinline__ u32 q_empty() const { return base + 8; }
    __device__ __forceinline__ u32 k_full(int s) const { return base + 8 * (2 + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return base + 8 * (2 + STAGES + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return base + 8 * (2 + 2 * STAGES + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return base + 8 * (2 + 3 * STAGES + s); }
};

// The ring position of a work item's first key tile and how many Q loads came before it:
// with PERSISTENT a CTA runs many (query tile, slice) items through one ring, so stages and
// mbarrier phases count on across them.
struct Sm90Ring {
    u32 first_tile, q_round;
    __device__ __forceinline__ int stage(int t, int stages) const { return (int)((first_tile + t) % stages); }
    __device__ __forceinline__ u32 phase(int t, int stages) const { return ((first_tile + t) / stages) & 1; }
};

// One (query tile, slice) work item, and (persistent varlen) where the walk stands.
struct Sm90Work {
    i64 bidx;
    int q_tile;
    u32 round;  // PERSISTENT && VARLEN: rounds of items drawn so far
    int x, lap, n;  // ... the item's grid column, its lap over the sequence, the sequence's query tiles
};

// The work items of this CTA, in order: sm90_work(..., i, w) sets item i, or says there is
// none. Without PERSISTENT, the one its grid cell names (causal: last query tiles first, they
// see the most keys; the cell may be tile-major, slice.cuh), or with VARLEN the query tiles of
// its sequence that slice.cuh's item loop gives it from the cell's tile (n_q_tiles: the
// sequence's). With PERSISTENT, items
// blockIdx.x, blockIdx.x + gridDim.x, ... of all n_q_tiles * num_batch: slices outermost so
// that neighbouring CTAs share K and V in L2, or (causal) longest query tiles first, each
// round of gridDim.x items walked in the opposite direction to the last (CTA 0 takes the first
// item of even rounds, the last of odd ones), so the CTAs that drew the longest tiles in one
// round draw the shortest in the next. PERSISTENT with VARLEN: the same rounds over
// p.varlen_tiles (the one-item-a-CTA grid's x) * num_batch items, item (x, slice) standing
// for the slice's query tiles x, x + varlen_tiles, ... (laps) below its sequence's count,
// counted from the last when causal; items past a short sequence's tiles are skipped. The
// walk's state is in w, so call with i = 0, 1, ... on one w, set up by sm90_work_start.
__device__ __forceinline__ void sm90_work_start(Sm90Work& w) {
    w.round = 0;
    w.lap = -1;
    w.x = w.n = 0;
}

template <bool CAUSAL, bool PERSISTENT, bool VARLEN>
__device__ __forceinline__ bool sm90_work(const FwdParams& p, const GridCell& cell, int n_q_tiles, u32 i, Sm90Work& w) {
    if (VARLEN && !PERSISTENT) {
        const int item = first_item<true>(cell.tile) + (int)i * item_step<true>();
        w.bidx = cell.slice;
        w.q_tile = item_tile<true, CAUSAL>(item, n_q_tiles);
        return item < n_q_tiles && w.bidx < p.num_batch;
    }
    if (!PERSISTENT) {
        w.bidx = cell.slice;
        w.q_tile = CAUSAL ? (int)gridDim.x - 1 - cell.tile : cell.tile;
        return i == 0 && w.bidx < p.num_batch;
    }
    // The host runs this form only while tiles * num_batch < 2^31: 32-bit divisions.
    const u32 batches = (u32)p.num_batch;
    const u32 tiles = VARLEN ? (u32)p.varlen_tiles : (u32)n_q_tiles;
    if (VARLEN && w.lap >= 0 && w.x + (w.lap + 1) * (int)tiles < w.n) {  // the item's next lap
        ++w.lap;
        const int t = w.x + w.lap * (int)tiles;
        w.q_tile = CAUSAL ? w.n - 1 - t : t;
        return true;
    }
    for (;;) {
        const u32 round = VARLEN ? w.round++ : i;
        const u32 column = CAUSAL && (round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
        const u32 item = column + round * gridDim.x;
        if (item >= tiles * batches) return false;
        u32 x;
        if (CAUSAL) {
            x = item / batches;
            w.bidx = item % batches;
        } else {
            x = item % tiles;
            w.bidx = item / tiles;
        }
        if (!VARLEN) {
            w.q_tile = CAUSAL ? n_q_tiles - 1 - (int)x : (int)x;
            return true;
        }
        const u32 heads = (u32)p.lead_shape[kMaxLead - 1];
        i64 start, rows;
        packed_rows(p.cu_seqlens_q, (u32)w.bidx / heads, p.nq, start, rows);
        const int n = tiles_of(rows, kSm90Rows);
        if ((int)x < n) {
            w.x = (int)x;
            w.lap = 0;
            w.n = n;
            w.q_tile = CAUSAL ? n - 1 - (int)x : (int)x;
            return true;
        }
    }
}

// One variant: a parameter for each field of cuflash/_variants.py's HopperForward, in its
// order, then smem_bytes, which Sm90SmemLayout must come to. (The CTA's rows and threads are
// every variant's: kSm90Rows, kSm90Threads.)
template <typename dtype, int head_dim, int block_cols, int stages, bool overlap, bool pingpong, bool tma,
          bool persistent, bool causal, bool sparse, bool varlen, int smem_bytes>
struct Fwd90Traits {
    using T = dtype;
    static constexpr int HD = head_dim, BC = block_cols, STAGES = stages, SMEM_BYTES = smem_bytes;
    static constexpr bool OVERLAP = overlap, PINGPONG = pingpong, TMA = tma, PERSISTENT = persistent;
    static constexpr bool CAUSAL = causal, SPARSE = sparse, VARLEN = varlen;
};

// One consumer warpgroup's view of a key tile: where its operands are and how its scores are
// masked and turned into P.
template <class K>
struct Sm90Consumer {
    using T = typename K::T;
    static constexpr int HD = K::HD, BC = K::BC, STAGES = K::STAGES;
    static constexpr bool PINGPONG = K::PINGPONG, TMA = K::TMA, SPARSE = K::SPARSE;
    using L = Sm90SmemLayout<HD, BC, STAGES>;
    const FwdParams& p;
    const TileList<SPARSE>& tiles;
    const Band& band;
    u32 sQ, sK, sV;
    Sm90Barriers<STAGES> bar;
    Sm90Ring ring;
    int warpgroup;  // 1 or 2
    int row0;       // the warpgroup's first row in the CTA's tile
    int lane, my_col;
    i64 warp_q0;
    int clean_first, clean_last;  // this warp's key tiles that need no element mask
    float scale_log2;
    i64 nk;  // the slice's keys

    // Ping-pong (PINGPONG): the two consumer warpgroups take turns issuing their matmuls, so
    // that one's softmax runs while the other's wgmmas occupy the tensor cores. Warpgroup w
    // waits on named barrier w before issuing and then lets the other one go; warpgroup 1
    // starts (warpgroup 2 arrives on barrier 1 once up front and skips its last pass, which
    // keeps both barriers balanced: every turn of one is matched by a pass of the other).
    __device__ __forceinline__ void begin_turn() const {
        if (!PINGPONG) return;
        if (warpgroup == 1) sm90::named_barrier_sync<1, 256>();
        else sm90::named_barrier_sync<2, 256>();
    }
    __device__ __forceinline__ void end_turn(bool last) const {
        if (!PINGPONG) return;
        if (warpgroup == 1) sm90::named_barrier_arrive<2, 256>();
        else if (!last) sm90::named_barrier_arrive<1, 256>();
    }

    // Issues S = Q K^T of tile t (once its K has landed) and commits it as one wgmma group.
    __device__ __forceinline__ void issue_s(float (&acc_s)[BC / 8][4], int t) const {
        const int s = ring.stage(t, STAGES);
        sm90::mbarrier_wait(bar.k_full(s), ring.phase(t, STAGES));
        if (!TMA) sm90::fence_async_shared();  // the tile came through cp.async, the generic proxy
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
            sm90::wgmma_ss<T, BC>(acc_s, sm90::kmajor_desc<kSm90Rows>(sQ, row0, kk),
                                  sm90::kmajor_desc<BC>(sK + s * L::k_bytes, 0, kk), kk > 0);
        sm90::wgmma_commit();
    }
    // Issues O += P V of tile t and commits it.
    __device__ __forceinline__ void issue_pv(float (&acc_o)[HD / 8][4], const u32 (&p_frag)[BC / 16][4], int t) const {
        const int s = ring.stage(t, STAGES);
        sm90::mbarrier_wait(bar.v_full(s), ring.phase(t, STAGES));
        if (!TMA) sm90::fence_async_shared();
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            sm90::wgmma_rs<T, HD>(acc_o, p_frag[kk], sm90::mnmajor_desc<BC>(sV + s * L::v_bytes, kk), 1);
        sm90::wgmma_commit();
    }

    // S of tile t has been waited for: frees its K buffer and turns the scores into P.
    __device__ __forceinline__ void take_s(float (&acc_s)[BC / 8][4], int t, OnlineSoftmax<2>& softmax,
                                           float (&correction)[2]) const {
        sm90::fence_operand(acc_s);
        if (lane == 0) sm90::mbarrier_arrive(bar.k_empty(ring.stage(t, STAGES)));
        softmax_tile(acc_s, t, softmax, correction);
    }
    // Waits for every wgmma in flight (P V of t last) and frees tile t's V buffer.
    __device__ __forceinline__ void finish_pv(float (&acc_o)[HD / 8][4], int t) const {
        sm90::wgmma_wait<0>();
        sm90::fence_operand(acc_o);
        if (lane == 0) sm90::mbarrier_arrive(bar.v_empty(ring.stage(t, STAGES)));
    }

    // Masks tile t's scores (tiles crossing the key end or the band's edges, partial blocks),
    // folds them into the running statistics and replaces each score by its unnormalised
    // probability, in place. Returns through `correction` the factor O must be rescaled by.
    __device__ __forceinline__ void softmax_tile(float (&acc_s)[BC / 8][4], int t, OnlineSoftmax<2>& softmax,
                                                 float (&correction)[2]) const {
        const int k_tile = tiles.tile(t);
        const i64 k0 = (i64)k_tile * BC;
        if (k_tile < clean_first || k_tile > clean_last) {
            const TileMask mask(band, warp_q0, k0, nk);
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!mask.allowed(lane / 4 + 8 * (e / 2), n * 8 + my_col + (e & 1))) acc_s[n][e] = neg_inf();
        }
        if (SPARSE && tiles.partial(t)) {
            const auto keep = partial_tile_keep<1, BC / 8, false>(p, tiles, warp_q0, k0, lane);
#pragma unroll
            for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!kept<BC / 8>(keep, 0, n, e)) acc_s[n][e] = neg_inf();
        }
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
            tile_max[0] = fmaxf(tile_max[0], fmaxf(acc_s[n][0], acc_s[n][1]));
            tile_max[1] = fmaxf(tile_max[1], fmaxf(acc_s[n][2], acc_s[n][3]));
        }
        float base_s[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) correction[h] = softmax.advance(h, quad_max(tile_max[h]), scale_log2, base_s[h]);
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc_s[n][e] = fast_exp2((acc_s[n][e] - base_s[e / 2]) * scale_log2);
                softmax.l[e / 2] += acc_s[n][e];
            }
    }
};

// P packed to 16 bits as wgmma A fragments: key columns 16kk..16kk+15 come from accumulator
// tiles 2kk (registers 0, 1: row r, row r + 8) and 2kk + 1 (registers 2, 3).
template <typename T, int BC>
__device__ __forceinline__ void pack_p(const float (&acc_s)[BC / 8][4], u32 (&p_frag)[BC / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            p_frag[kk][2 * half] = pack2<T>(acc_s[2 * kk + half][0], acc_s[2 * kk + half][1]);
            p_frag[kk][2 * half + 1] = pack2<T>(acc_s[2 * kk + half][2], acc_s[2 * kk + half][3]);
        }
}

template <int NT>
__device__ __forceinline__ void rescale_rows(float (&acc)[NT][4], const float (&correction)[2]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        acc[n][0] *= correction[0];
        acc[n][1] *= correction[0];
        acc[n][2] *= correction[1];
        acc[n][3] *= correction[1];
    }
}

// The consumer warpgroups' side of flash_fwd_sm90_kernel: 64 query rows from row0 of the
// CTA's tile, every key tile the producer delivers. With OVERLAP, software-pipelined by one
// tile: S of tile t + 1 is issued before P V of tile t, so that the tensor cores run P V while
// this warpgroup exponentiates tile t + 1.
// Without, each tile's S, softmax and P V run in turn (the other consumer warpgroup fills the
// gaps).
template <class K>
__device__ __forceinline__ void consume(const FwdParams& p, const SliceGeometry& g, const TileList<K::SPARSE>& tiles,
                                        const Band& band, i64 q0, int tid, u32 sQ, u32 sK, u32 sV,
                                        Sm90Barriers<K::STAGES> bar, Sm90Ring ring) {
    using T = typename K::T;
    constexpr int HD = K::HD, BC = K::BC;
    constexpr bool OVERLAP = K::OVERLAP, PINGPONG = K::PINGPONG, TMA = K::TMA, PERSISTENT = K::PERSISTENT;
    const int n_tiles = tiles.count;
    // Warp-uniform to the compiler at head dims 128 and 256 (2-3% and 4-6% faster at seq >= 4k)
    // and in the persistent form at 64 (1-2%); the one-item form at 64 keeps tid / 128, with
    // which it is 1-2% faster (bench/NOTES.md, Forward on Hopper (wgmma, TMA, persistence)).
    const int warpgroup = HD != 64 || PERSISTENT ? sm90::uniform_warpgroup(tid) : tid / 128, ct = tid % 128, warp = ct / 32;
    Sm90Consumer<K> c{p, tiles, band, sQ, sK, sV, bar, ring};
    c.warpgroup = warpgroup;
    c.row0 = 64 * (warpgroup - 1);
    c.lane = ct % 32;
    c.my_col = 2 * (c.lane % 4);
    c.warp_q0 = q0 + c.row0 + 16 * warp;
    c.scale_log2 = (float)p.scale_log2;
    c.nk = g.nk;
    band.clean_key_tiles(c.warp_q0, 16, BC, g.nk, c.clean_first, c.clean_last);

    float acc_o[HD / 8][4];
    zero(acc_o);
    OnlineSoftmax<2> softmax;
    softmax.init();

    if (n_tiles > 0) {
        sm90::mbarrier_wait(bar.q_full(), ring.q_round & 1);
        if (!TMA) sm90::fence_async_shared();
        if (PINGPONG && warpgroup == 2) sm90::named_barrier_arrive<1, 256>();
        float acc_s[BC / 8][4];
        u32 p_frag[BC / 16][4];
        float correction[2];
        c.begin_turn();
        c.issue_s(acc_s, 0);
        c.end_turn(false);
        sm90::wgmma_wait<0>();
        c.take_s(acc_s, 0, softmax, correction);  // O is 0: nothing to rescale
        pack_p<T, BC>(acc_s, p_frag);
        // Per tile t, one turn issues both matmuls back to back: P V of t and S of t + 1.
        if (OVERLAP) {
            // S first, and the softmax of t + 1 runs while P V of t is still in flight; O is
            // rescaled (by the softmax of t) while S of t + 1 runs, just before P V of t adds
            // to it. The last tile is peeled off: with "is there a next tile" tests around the
            // S issue and its wait, ptxas cannot tell which group a wait retires and
            // serializes every wgmma (its note C7514).
            for (int t = 0; t + 1 < n_tiles; ++t) {
                sm90::fence_operand(acc_o);
                c.begin_turn();
                c.issue_s(acc_s, t + 1);
                rescale_rows(acc_o, correction);
                c.issue_pv(acc_o, p_frag, t);
                c.end_turn(false);
                sm90::wgmma_wait<1>();  // S of t + 1 is done; P V of t may still run
                c.take_s(acc_s, t + 1, softmax, correction);
                c.finish_pv(acc_o, t);
                pack_p<T, BC>(acc_s, p_frag);
            }
            sm90::fence_operand(acc_o);
            c.begin_turn();
            rescale_rows(acc_o, correction);
            c.issue_pv(acc_o, p_frag, n_tiles - 1);
            c.end_turn(true);
            c.finish_pv(acc_o, n_tiles - 1);
        } else {
            for (int t = 0; t < n_tiles; ++t) {
                const bool more = t + 1 < n_tiles;
                sm90::fence_operand(acc_o);
                c.begin_turn();
                c.issue_pv(acc_o, p_frag, t);
                if (more) c.issue_s(acc_s, t + 1);
                c.end_turn(!more);
                c.finish_pv(acc_o, t);  // and S of t + 1, committed after it
                if (more) {  // P V of t has read p_frag and written O: both are free now
                    c.take_s(acc_s, t + 1, softmax, correction);
                    rescale_rows(acc_o, correction);
                    pack_p<T, BC>(acc_s, p_frag);
                }
            }
        }
        if (c.lane == 0) sm90::mbarrier_arrive(bar.q_empty());  // every S of this item is done: Q may be replaced
    }

    // -- epilogue: O /= l, l and m in flash_fwd.cu's format --
    const i64 nq = g.nq;
    float inv_l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) inv_l[h] = softmax.finalize<4>(h);
    T* gO = static_cast<T*>(p.o) + g.rows * p.dv;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 q = c.warp_q0 + c.lane / 4 + 8 * h;
        if (q >= nq) continue;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            const int col = n * 8 + c.my_col;
            if (col < p.dv)
                *reinterpret_cast<u32*>(gO + q * p.dv + col) =
                    pack2<T>(acc_o[n][2 * h] * inv_l[h], acc_o[n][2 * h + 1] * inv_l[h]);
        }
        if (c.lane % 4 == 0) softmax.store(h, (float)p.scale, p.l + g.rows + q, p.m + g.rows + q);
    }
}

// VARLEN: a packed variable-length batch (slice.cuh), one sequence and head a CTA, walking
// the query tiles of its sequence that its grid position names, or (PERSISTENT) items of any
// sequence and head, as sm90_work says. The tensor maps span every packed row of a head: rows
// past the sequence's end are loaded but masked as keys (the sequence's nk) and never stored
// as queries (its nq).
template <class K>
__global__ void __launch_bounds__(kSm90Threads, 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ sm90::Sm90Maps maps) {
    using T = typename K::T;
    constexpr int HD = K::HD, BC = K::BC, STAGES = K::STAGES, SMEM_BYTES = K::SMEM_BYTES;
    constexpr bool TMA = K::TMA, PERSISTENT = K::PERSISTENT, CAUSAL = K::CAUSAL, SPARSE = K::SPARSE, VARLEN = K::VARLEN;
    using L = Sm90SmemLayout<HD, BC, STAGES>;
    static_assert(HD == 64 || HD == 128 || HD == 256, "wgmma paths for head dims 64, 128 and 256");
    static_assert(BC == 64 || BC == 128, "key tiles of 64 or 128");
    // At 256, O alone is 128 of a consumer's 232 registers, and Q plus one stage of K and V
    // 128 KB of shared memory.
    static_assert(HD != 256 || (BC == 64 && STAGES == 2), "head dim 256: 64-key tiles, 2 stages");
    static_assert(L::bytes == SMEM_BYTES, "shared-memory layout against HopperForward.fixed_smem");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    require_dynamic_smem((u32)SMEM_BYTES);
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = base + L::q_offset, sK = base + L::k_offset, sV = base + L::v_offset;
    const Sm90Barriers<STAGES> bar{base + L::barrier_offset};

    const int tid = threadIdx.x, warpgroup = HD != 64 || PERSISTENT ? sm90::uniform_warpgroup(tid) : tid / 128;  // as in consume
    // Without PERSISTENT the CTA's slice and tile; tile-major (slice.cuh) when causal without
    // grouped heads (with them it measured 2-4% slower at 8 x 32 / 8 x 2048 x 128), at head dims
    // up to 128 (at 256 level), not for varlen grids (level or slower at 16 x 12 x 4096 x 64
    // packed: bench/NOTES.md, Packed batches (varlen)).
    const GridCell cell = grid_cell(CAUSAL && !PERSISTENT && !VARLEN && HD <= 128 && p.kv_group == 1, kTileMajorForward);
    if (!PERSISTENT && cell.slice >= p.num_batch) return;
    if (tid == 0) {
        const u32 loaders = TMA ? 1 : 128;  // who arrives on a "full" barrier
        sm90::mbarrier_init(bar.q_full(), loaders);
        sm90::mbarrier_init(bar.q_empty(), kSm90ConsumerWarps);
        for (int s = 0; s < STAGES; ++s) {
            sm90::mbarrier_init(bar.k_full(s), loaders);
            sm90::mbarrier_init(bar.v_full(s), loaders);
            sm90::mbarrier_init(bar.k_empty(s), kSm90ConsumerWarps);
            sm90::mbarrier_init(bar.v_empty(s), kSm90ConsumerWarps);
        }
        sm90::fence_barrier_init();
    }
    __syncthreads();

    // Without PERSISTENT the CTA's slice is fixed: its geometry is read once (a persistent
    // launch reads each item's; n_q_tiles is then slice 0's, which dense slices share).
    const SliceGeometry g_cta = slice_geometry<VARLEN>(p, PERSISTENT ? 0 : cell.slice);
    const int n_q_tiles = tiles_of(g_cta.nq, kSm90Rows);
    Sm90Ring ring{0, 0};  // both sides walk the same items and count the same tiles
    Sm90Work w;
    sm90_work_start(w);
    if (warpgroup == 0) {
        // ---- producer: per item, Q once, then K and V of every tile into the ring ----
        sm90::release_registers<kProducerRegisters>();
        for (u32 i = 0; sm90_work<CAUSAL, PERSISTENT, VARLEN>(p, cell, n_q_tiles, i, w); ++i) {
            const SliceGeometry g = VARLEN && !PERSISTENT ? g_cta : slice_geometry<VARLEN>(p, w.bidx);
            const i64 nq = g.nq, nk = g.nk;
            const Band band = g.band<CAUSAL>(p);
            const i64 q0 = (i64)w.q_tile * kSm90Rows;
            const i64 q_end = q0 + kSm90Rows < nq ? q0 + kSm90Rows : nq;
            const auto tiles = key_tiles<SPARSE>(p, band, w.bidx, w.q_tile, q0, q_end, BC, nk);
            const int n_tiles = tiles.count;
            if (n_tiles == 0) continue;  // the consumers write this item without any load
            // Q's buffer is free once both consumers have finished the previous item's tiles.
            if (ring.q_round > 0) sm90::mbarrier_wait(bar.q_empty(), (ring.q_round - 1) & 1);
            if (TMA) {
                // One thread issues every copy: a box per 64 columns, each completing on the
                // tile's barrier with its byte count.
                if (tid == 0) {
                    const int zq = (int)(g.q_head / maps.q_slice), zk = (int)(g.k_head / maps.k_slice);
                    const int zv = (int)(g.v_head / maps.v_slice);
                    sm90::mbarrier_expect_tx(bar.q_full(), (u32)L::q_bytes);
                    sm90::tma_load_tile<kSm90Rows, HD>(sQ, &maps.q, (int)(g.q_start + q0), zq, bar.q_full());
                    for (int t = 0; t < n_tiles; ++t) {
                        const int s = ring.stage(t, STAGES);
                        const u32 reuse_parity = ring.phase(t, STAGES) ^ 1;  // the previous lap's release
                        const bool reused = ring.first_tile + t >= STAGES;
                        const int k0 = (int)g.k_start + tiles.tile(t) * BC;  // a row of the map
                        if (reused) sm90::mbarrier_wait(bar.k_empty(s), reuse_parity);
                        sm90::mbarrier_expect_tx(bar.k_full(s), (u32)L::k_bytes);
                        sm90::tma_load_tile<BC, HD>(sK + s * L::k_bytes, &maps.k, k0, zk, bar.k_full(s));
                        if (reused) sm90::mbarrier_wait(bar.v_empty(s), reuse_parity);
                        sm90::mbarrier_expect_tx(bar.v_full(s), (u32)L::v_bytes);
                        sm90::tma_load_tile<BC, HD>(sV + s * L::v_bytes, &maps.v, k0, zv, bar.v_full(s));
                    }
                }
            } else {
                const T* gQ = static_cast<const T*>(p.q) + g.q;
                const T* gK = static_cast<const T*>(p.k) + g.k;
                const T* gV = static_cast<const T*>(p.v) + g.v;
                // Every copy completes on an mbarrier by itself (arrive.noinc), so the producer
                // never waits for its own loads, only for buffers to free up: it runs up to
                // STAGES tiles ahead of the consumers.
                sm90::load_tile_swizzled<kSm90Rows, HD, 128>(sQ, gQ, p.q_row_stride, q0, nq, p.d, tid);
                sm90::cp_async_arrive(bar.q_full());
                for (int t = 0; t < n_tiles; ++t) {
                    const int s = ring.stage(t, STAGES);
                    const u32 reuse_parity = ring.phase(t, STAGES) ^ 1;
                    const bool reused = ring.first_tile + t >= STAGES;
                    const i64 k0 = (i64)tiles.tile(t) * BC;
                    if (reused) sm90::mbarrier_wait(bar.k_empty(s), reuse_parity);
                    sm90::load_tile_swizzled<BC, HD, 128>(sK + s * L::k_bytes, gK, p.k_row_stride, k0, nk, p.d, tid);
                    sm90::cp_async_arrive(bar.k_full(s));
                    if (reused) sm90::mbarrier_wait(bar.v_empty(s), reuse_parity);
                    sm90::load_tile_swizzled<BC, HD, 128>(sV + s * L::v_bytes, gV, p.v_row_stride, k0, nk, p.dv, tid);
                    sm90::cp_async_arrive(bar.v_full(s));
                }
            }
            ring.first_tile += n_tiles;
            ++ring.q_round;
        }
        if (!TMA) cp_async_wait<0>();  // nothing may be in flight when the thread exits
    } else {
        sm90::claim_registers<kConsumerRegisters>();
        auto run_item = [&](int ctid) {
            const SliceGeometry g = VARLEN && !PERSISTENT ? g_cta : slice_geometry<VARLEN>(p, w.bidx);
            const Band band = g.band<CAUSAL>(p);
            const i64 q0 = (i64)w.q_tile * kSm90Rows;
            const i64 q_end = q0 + kSm90Rows < g.nq ? q0 + kSm90Rows : g.nq;
            const auto tiles = key_tiles<SPARSE>(p, band, w.bidx, w.q_tile, q0, q_end, BC, g.nk);
            consume<K>(p, g, tiles, band, q0, ctid, sQ, sK, sV, bar, ring);
            if (tiles.count > 0) {
                ring.first_tile += tiles.count;
                ++ring.q_round;
            }
        };
        // At head dims 64 and 128 a varlen CTA whose grid row covers its sequence has one item:
        // it runs it outside the item loop, on the plain thread index (at 64, 16 x 12 x 4096
        // causal: 1217-1244 -> 1190-1223 us; bench/NOTES.md, Packed batches (varlen)). Inside the
        // loop, above head dim 64, the index must be opaque (slice.cuh): without it those forms
        // spill 732-1228 bytes (at 256 the one-item copy alongside spills 24-96 in the cp.async
        // forms); at 64 the opaque index cost the loop 54 of its 840 instructions and nothing
        // spills without it.
        if (VARLEN && !PERSISTENT && HD <= 128 && first_item<VARLEN>(cell.tile) + item_step<VARLEN>() >= n_q_tiles) {
            if (sm90_work<CAUSAL, PERSISTENT, VARLEN>(p, cell, n_q_tiles, 0, w)) run_item(tid);
        } else {
            for (u32 i = 0; sm90_work<CAUSAL, PERSISTENT, VARLEN>(p, cell, n_q_tiles, i, w); ++i)
                run_item(HD == 64 ? tid : item_thread_index<VARLEN>());
        }
    }
}

}  // namespace cuflash
