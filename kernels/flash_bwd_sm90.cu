// flash_bwd_sm90.cu: the backward pass's key-tile kernel on Hopper's warpgroup matrix multiply
// (wgmma, sm_90a) for float16 / bfloat16 with head dim 64 or 128; it replaces flash_bwd_kernel
// where cuflash/_config.py says so (the default on Hopper).
//
// One CTA owns 128 keys and walks the query tiles of 64 rows that see them; three warpgroups:
//   producer     warpgroup 0 copies K and V once, then per query tile Q, dO and the row
//                statistics ((m, log2 l) and D, from flash_bwd_preprocess) into a ring of
//                STAGES buffers, completing on mbarriers as in flash_fwd_sm90.cu: with TMA one
//                thread issues bulk copies (maps from cuflash/_tma.py), without all 128 issue
//                16-byte cp.async (inputs the copy engine cannot map). The maps of a packed
//                batch span a head's rows: a ragged tile reads the next sequence's rows where
//                cp.async fills zeros, and those queries' P (m = +inf) and keys' P (masked)
//                are 0 either way, as in the forward.
//   consumers    warpgroups 1 and 2 own 64 keys each and keep their dK, dV in registers.
//                Per query tile, everything transposed so that keys are the rows:
//                  S^T  = K Q^T           wgmma, both from shared memory
//                  dP^T = V dO^T          likewise
//                  P^T  = exp2(...)       recompute_p from the statistics, masked
//                  dS^T = P^T o (dP^T - D)
//                  dV  += P^T dO          wgmma, P^T from registers, dO read transposed
//                  dK  += dS^T Q          wgmma, dS^T from registers, Q read transposed
//                  dQ  += dS K            (ATOMIC_DQ) dS^T goes through shared memory; each
//                                         warpgroup computes 64 columns of dQ (head dim 128;
//                                         at 64 warpgroup 1 does all) into a shared float32
//                                         tile that one thread adds to dQ with one bulk
//                                         reduction on the copy engine (at head dim 64 with
//                                         TMA, a lane of the producer's warp 1: kDqWarp)
// dK (times scale) and dV are written once at the end, like flash_bwd_kernel's.
// PERSISTENT (head dim 64, dense, not causal: cuflash/_tiles.py): one CTA an SM walks the
// (key tile, slice) items; K and V alternate between two buffers, so the producer loads the next
// item's while the consumers finish this one and store its dK and dV.
#include "common.cuh"
#include "mask.cuh"
#include "sm90.cuh"
#include "bwd_common.cuh"

namespace cuflash {

constexpr int kBwd90Keys = CUFLASH_SM90_BWD_KEYS;        // keys per CTA (HopperBackward.block_cols)
constexpr int kBwd90Rows = CUFLASH_SM90_BWD_ROWS;        // queries per tile walked (block_rows)
constexpr int kBwd90Threads = 32 * CUFLASH_SM90_BWD_WARPS;  // HopperBackward.threads
static_assert(kBwd90Keys == 2 * 64 && kBwd90Rows == 64 && kBwd90Threads == 3 * 128,
              "a producer warpgroup and two consumer warpgroups of 64 keys (wgmma's M), query tiles of 64");
static_assert(kStatsRowMultiple % kBwd90Rows == 0, "query tiles stay inside the statistics' padded rows");
constexpr int kBwd90ProducerRegisters = 40, kBwd90ConsumerRegisters = 232;
static_assert(128 * kBwd90ProducerRegisters + 256 * kBwd90ConsumerRegisters <= 168 * kBwd90Threads,
              "register budget");

template <int HD, int STAGES, bool PERSISTENT>
struct Bwd90SmemLayout {
    static constexpr int kv_bytes = kBwd90Keys * HD * 2;   // K, and V
    // PERSISTENT: two K / V buffers, so the next item's load overlaps this one. The n-th K / V
    // load goes to buffer kv_buffer(n), where kv_use(n) loads came before it.
    static constexpr int kv_buffers = PERSISTENT ? 2 : 1;
    static __device__ __forceinline__ int kv_buffer(u32 n) { return (int)(n % kv_buffers); }
    static __device__ __forceinline__ u32 kv_use(u32 n) { return n / kv_buffers; }
    static constexpr int q_bytes = kBwd90Rows * HD * 2;    // Q, and dO, per stage
    static constexpr int ds_bytes = kBwd90Keys * kBwd90Rows * 2;
    static constexpr int stat_floats = 3 * kBwd90Rows;     // (m, log2 l) pairs, then D
    static constexpr int k_offset = 0;
    static constexpr int v_offset = kv_bytes;
    static __device__ __forceinline__ int k_offset_of(int kv_buffer) { return k_offset + kv_buffer * 2 * kv_bytes; }
    static constexpr int q_offset = 2 * kv_buffers * kv_bytes;
    static constexpr int do_offset = q_offset + STAGES * q_bytes;
    static constexpr int ds_offset = do_offset + STAGES * q_bytes;
    static constexpr int stat_offset = ds_offset + 2 * ds_bytes;  // dS^T double-buffered (by tile parity)
    static constexpr int dq_offset = stat_offset + STAGES * stat_floats * 4;  // fp32 dQ tile (ATOMIC_DQ)
    static constexpr int dq_bytes = kBwd90Rows * HD * 4;
    static constexpr int barrier_offset = dq_offset + dq_bytes;
    // K/V loaded; per stage, loaded and read; PERSISTENT: the second K/V buffer loaded, both read
    static constexpr int barriers = 1 + 2 * STAGES + (PERSISTENT ? 3 : 0);
    static constexpr int bytes = barrier_offset + 8 * barriers + 1024;
};

template <int STAGES>
struct Bwd90Barriers {
    u32 base;
    __device__ __forceinline__ u32 kv_full(int kb = 0) const { return kb == 0 ? base : base + 8 * (1 + 2 * STAGES); }
    __device__ __forceinline__ u32 full(int s) const { return base + 8 * (1 + s); }
    __device__ __forceinline__ u32 empty(int s) const { return base + 8 * (1 + STAGES + s); }
    __device__ __forceinline__ u32 kv_empty(int kb) const { return base + 8 * (2 + 2 * STAGES + kb); }
};

// dS^T of one warpgroup (its 64 keys from key row0) into the shared tile the dQ matmul reads:
// [128 keys][64 queries], 16-bit, swizzled like V (queries contiguous: MN-major for A).
template <typename T>
__device__ __forceinline__ void store_ds(u32 sDS, const float (&ds)[kBwd90Rows / 8][4], int row0, int warp, int lane) {
#pragma unroll
    for (int n = 0; n < kBwd90Rows / 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = row0 + 16 * warp + lane / 4 + 8 * h, q = 8 * n + 2 * (lane % 4);
            const u32 addr = sDS + sm90::swizzled_offset<kBwd90Keys>(key, q / 8) + (q % 8) * 2;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pack2<T>(ds[n][2 * h], ds[n][2 * h + 1])));
        }
}

// The accumulator of a 64 x 64 tile packed as wgmma A fragments (the forward's pack_p).
template <typename T>
__device__ __forceinline__ void pack_frags(const float (&acc)[8][4], u32 (&frag)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            frag[kk][2 * half] = pack2<T>(acc[2 * kk + half][0], acc[2 * kk + half][1]);
            frag[kk][2 * half + 1] = pack2<T>(acc[2 * kk + half][2], acc[2 * kk + half][3]);
        }
}

// PERSISTENT (dense, not causal, one CTA an SM): item i of this CTA is pair blockIdx.x + i *
// gridDim.x of the n_k_tiles x num_batch (key tile, slice) pairs, slices outermost, so that the
// CTAs at work share a head's Q and dO in L2. False past the last.
__device__ __forceinline__ bool persistent_item(const FwdParams& p, int n_k_tiles, u32 i, i64& bidx, int& key_tile) {
    const u32 slices = (u32)p.num_batch, tiles = (u32)n_k_tiles;  // tiles x slices < 2^31 (_config.py)
    const u32 item = blockIdx.x + i * gridDim.x;
    bidx = item / tiles;
    key_tile = (int)(item % tiles);
    return item < tiles * slices;
}

// Runs body(geometry, band, slice, key tile) on the CTA's items, in order: with PERSISTENT
// persistent_item's walk, each item's geometry read anew (the slices are dense, alike); without,
// slice.cuh's item loop of the CTA's slice (one item unless VARLEN), its geometry read once and
// the warpgroups meeting between items, before K and V are replaced.
template <bool CAUSAL, bool VARLEN, bool PERSISTENT, typename Geometry, typename Body>
__device__ __forceinline__ void walk_bwd_items(const FwdParams& p, const GridCell& cell, i64 bidx, Geometry geometry,
                                               Body&& body) {
    if constexpr (PERSISTENT) {
        const int n_k_tiles = tiles_of(geometry(0).nk, kBwd90Keys);
        i64 item_bidx;
        int key_tile;
#pragma unroll 1
        for (u32 i = 0; persistent_item(p, n_k_tiles, i, item_bidx, key_tile); ++i) {
            const SliceGeometry g = geometry(item_bidx);
            body(g, g.band<CAUSAL>(p), item_bidx, key_tile);
        }
    } else {
        const SliceGeometry g = geometry(bidx);
        const Band band = g.band<CAUSAL>(p);
        const int n_k_tiles = tiles_of(g.nk, kBwd90Keys);
#pragma unroll 1
        for (int item = first_item<VARLEN>(cell.tile); item < item_count<VARLEN>(n_k_tiles); item += item_step<VARLEN>()) {
            if (item != first_item<VARLEN>(cell.tile)) __syncthreads();
            body(g, band, bidx, VARLEN ? item_tile<VARLEN, false>(item, n_k_tiles) : cell.tile);
        }
    }
}

// One variant: a parameter for each field of cuflash/_variants.py's HopperBackward, in its
// order, then smem_bytes, which Bwd90SmemLayout must come to. (The CTA's keys, query rows and
// threads are every variant's: kBwd90Keys, kBwd90Rows, kBwd90Threads.)
template <typename dtype, int head_dim, bool atomic_dq, bool causal, int stages, bool sparse, bool varlen, bool grouped,
          bool tma, bool persistent, int smem_bytes>
struct Bwd90Traits {
    using T = dtype;
    static constexpr int HD = head_dim, STAGES = stages, SMEM_BYTES = smem_bytes;
    static constexpr bool ATOMIC_DQ = atomic_dq, CAUSAL = causal, SPARSE = sparse, VARLEN = varlen;
    static constexpr bool GROUPED = grouped, TMA = tma, PERSISTENT = persistent;
};

// VARLEN: a packed variable-length batch (slice.cuh): the CTA walks the key tiles of its
// sequence that its grid position names. Its ring of Q / dO stages counts on across them (a
// tile's stage and phase come from the tiles of the earlier items plus its own index), and
// all three warpgroups meet between items, before K and V are replaced.
template <class K>
__global__ void __launch_bounds__(kBwd90Threads, 1)
flash_bwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ BwdParams b,
                      const __grid_constant__ sm90::Bwd90Maps maps) {
    using T = typename K::T;
    constexpr int HD = K::HD, STAGES = K::STAGES, SMEM_BYTES = K::SMEM_BYTES;
    constexpr bool ATOMIC_DQ = K::ATOMIC_DQ, CAUSAL = K::CAUSAL, SPARSE = K::SPARSE, VARLEN = K::VARLEN;
    constexpr bool GROUPED = K::GROUPED, TMA = K::TMA, PERSISTENT = K::PERSISTENT;
    using L = Bwd90SmemLayout<HD, STAGES, PERSISTENT>;
    // Causal items differ in length, which a fixed round-robin shares out worse than the hardware
    // starting one CTA an item (bench/NOTES.md, Backward on Hopper (key pass))
    static_assert(!PERSISTENT || (TMA && !CAUSAL && !VARLEN && !GROUPED && !SPARSE),
                  "the persistent form: dense, not causal, through TMA");
    static_assert(HD == 64 || HD == 128, "wgmma paths for head dims 64 and 128");
    constexpr bool kDvUnderDs = HD == 64;  // dV's matmul runs while dS^T is formed (below)
    // dP^T's matmul runs while P^T is formed (+2-3% at head dim 64); at 128 its accumulators in
    // flight spill the atomic forms' 232 registers by 224-240 bytes.
    constexpr bool kDpUnderP = HD == 64;
    static_assert(!kDpUnderP || kDvUnderDs, "dP^T issued early is waited for apart from dV");
    // dS^T in two buffers, by stage, so the warpgroups need not meet after dQ. At head dim 128 the
    // variable buffer address alone makes the atomic variants spill 72-88 bytes (0 without).
    constexpr bool kDoubleDs = HD == 64;
    constexpr int kDqIssuer = 128;  // the thread that adds each dQ tile to dQ (ATOMIC_DQ): warpgroup 1's first
    // kDqWarp: at head dim 64 with TMA the producer's idle warp 1 adds each dQ tile instead
    // (FA3's dQ warp): warpgroup 1 arrives on barrier 3 once the tile is in shared memory, the
    // warp issues the bulk reduction, waits for its read and arrives on barrier 4, which
    // warpgroup 1 waits on before the next tile's dS^T (so before it writes the dQ tile again).
    // 1.3-3.6% faster at 64; at 128, where both warpgroups add dQ and wait on barrier 4 there,
    // 2-5% slower (bench/NOTES.md, Backward on Hopper (key pass)).
    constexpr bool kDqWarp = TMA && ATOMIC_DQ && HD == 64;
    constexpr int kDqBarrierThreads = 128 + 32;  // warpgroup 1 and the dQ warp
    static_assert(!kDoubleDs || STAGES == 2, "dS^T buffers are indexed by stage");
    static_assert(L::bytes == SMEM_BYTES, "shared-memory layout against HopperBackward.fixed_smem");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    require_dynamic_smem((u32)SMEM_BYTES);
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sK = base + L::k_offset, sV = base + L::v_offset, sQ = base + L::q_offset;
    const u32 sDO = base + L::do_offset, sDS = base + L::ds_offset, sDQ_addr = base + L::dq_offset;
    float* sStat = reinterpret_cast<float*>(smem_raw + (base - smem_addr(smem_raw)) + L::stat_offset);
    float* sDQ = reinterpret_cast<float*>(smem_raw + (base - smem_addr(smem_raw)) + L::dq_offset);
    const Bwd90Barriers<STAGES> bar{base + L::barrier_offset};

    // GROUPED: the CTA walks `group` consecutive query heads of one k/v head
    // (BwdParams::head_group), summing their dK and dV in registers; bidx is its first head's
    // slice. A form of its own: the head loop and its counters in the 232 registers spill the
    // ungrouped forms at head dim 128 by up to 56 more bytes.
    static_assert(!(GROUPED && SPARSE), "a block mask's tile lists are per head");
    const int group = GROUPED ? (int)b.head_group : 1;
    // Causal: the first key tiles see the most queries; the cell is tile-major (slice.cuh), with
    // its own bound for packed batches.
    const GridCell cell = grid_cell(CAUSAL, VARLEN ? kTileMajorVarlenBackward : kTileMajorBackward);
    const i64 bidx = cell.slice * group;  // without PERSISTENT, the CTA's (first) slice
    if (!PERSISTENT && bidx >= p.num_batch) return;
    const int tid = threadIdx.x, warpgroup = sm90::uniform_warpgroup(tid);
    if (tid == 0) {
        const u32 loaders = TMA ? 1 : 128;  // who arrives on a "full" barrier
        sm90::mbarrier_init(bar.kv_full(), loaders);
        if (PERSISTENT) {
            sm90::mbarrier_init(bar.kv_full(1), loaders);
            sm90::mbarrier_init(bar.kv_empty(0), 8);  // one arrival a consumer warp
            sm90::mbarrier_init(bar.kv_empty(1), 8);
        }
        for (int s = 0; s < STAGES; ++s) {
            sm90::mbarrier_init(bar.full(s), loaders);
            sm90::mbarrier_init(bar.empty(s), 8);  // one arrival a consumer warp
        }
        if (TMA) sm90::fence_barrier_init();
    }
    __syncthreads();

    // Each side takes the geometry itself: a dense producer's offsets (64-bit divisions) stay
    // out of the consumers' code. Without PERSISTENT the CTA's slice is fixed and its geometry
    // read once; a persistent launch is dense, every slice alike, and reads each item's.
    auto geometry = [&](i64 slice) { return slice_geometry<VARLEN>(p, slice, b.nq_pad); };
    if (warpgroup == 0) {
        // ---- producer ----
        sm90::release_registers<kBwd90ProducerRegisters>();
        if (kDqWarp && tid / 32 == 1) sm90::named_barrier_arrive<4, kDqBarrierThreads>();  // the tiles start free
        u32 ring = 0, kv_loads = 0;  // query tiles and K / V loads of the earlier items
        walk_bwd_items<CAUSAL, VARLEN, PERSISTENT>(p, cell, bidx, geometry, [&](const SliceGeometry& g, const Band& band, const i64 bidx, const int key_tile) {
            const i64 nq = g.nq, nk = g.nk;
            const i64 k0 = (i64)key_tile * kBwd90Keys;
            const auto tiles = query_tiles<SPARSE>(p, band, bidx, key_tile, k0, kBwd90Keys, kBwd90Rows, nq, nk);
            const int n_tiles = tiles.count;
            if (TMA && n_tiles > 0) {
                // One thread issues every copy: K and V in 64-column boxes of 128 rows, then per
                // query tile Q and dO in boxes of 64 rows and the statistics as two plain bulk
                // copies, each completing on its barrier with its byte count. Rows are the map's:
                // a packed sequence's start on.
                if (tid == 0) {
                    const int kv_row = (int)(g.k_start + k0), kb = L::kv_buffer(kv_loads);
                    const u32 cK = base + L::k_offset_of(kb);
                    // PERSISTENT: the buffer's last item (kv_buffers loads back) is done with it
                    if (PERSISTENT && kv_loads >= L::kv_buffers)
                        sm90::mbarrier_wait(bar.kv_empty(kb), (L::kv_use(kv_loads) - 1) & 1);
                    sm90::mbarrier_expect_tx(bar.kv_full(kb), 2u * L::kv_bytes);
                    sm90::tma_load_tile<kBwd90Keys, HD>(cK, &maps.k, kv_row, (int)(g.k_head / maps.k_slice), bar.kv_full(kb));
                    sm90::tma_load_tile<kBwd90Keys, HD>(cK + L::kv_bytes, &maps.v, kv_row, (int)(g.v_head / maps.v_slice),
                                                        bar.kv_full(kb));
#pragma unroll 1
                    for (int j = 0; j < group; ++j) {
                        const SliceGeometry gj = j == 0 ? g : slice_geometry<VARLEN>(p, bidx + j, b.nq_pad);
                        const BwdSlice<T> head = bwd_slice<T, VARLEN>(p, b, gj, bidx + j);
                        const int zq = (int)(gj.q_head / maps.q_slice);
                        const int zdo = (int)(head_offset<VARLEN>(p, gj, bidx + j, b.do_lead_stride) / maps.do_slice);
                        for (int t = 0; t < n_tiles; ++t) {
                            const u32 r = ring + t;
                            const int s = r % STAGES;
                            if (r >= STAGES) sm90::mbarrier_wait(bar.empty(s), ((r / STAGES) & 1) ^ 1);
                            const int q0 = tiles.tile(t) * kBwd90Rows, q_row = (int)(gj.q_start + q0);
                            const u32 st = smem_addr(sStat + s * L::stat_floats);
                            sm90::mbarrier_expect_tx(bar.full(s), 2u * L::q_bytes + 4u * L::stat_floats);
                            sm90::tma_load_tile<kBwd90Rows, HD>(sQ + s * L::q_bytes, &maps.q, q_row, zq, bar.full(s));
                            sm90::tma_load_tile<kBwd90Rows, HD>(sDO + s * L::q_bytes, &maps.dout, q_row, zdo, bar.full(s));
                            sm90::bulk_load(st, head.lse2 + 2 * q0, 2 * kBwd90Rows * 4, bar.full(s));
                            sm90::bulk_load(st + 2 * kBwd90Rows * 4, head.delta + q0, kBwd90Rows * 4, bar.full(s));
                        }
                        ring += n_tiles;
                    }
                } else if (kDqWarp && tid / 32 == 1) {
                    // ---- the dQ warp: the same tiles in the same order as the consumers ----
                    i64 dq_rows = g.rows;
#pragma unroll 1
                    for (int j = 0; j < group; ++j, dq_rows += p.nq)
#pragma unroll 1
                        for (int t = 0; t < n_tiles; ++t) {
                            sm90::named_barrier_sync<3, kDqBarrierThreads>();
                            if (tid == 32) {
                                const i64 q0 = (i64)tiles.tile(t) * kBwd90Rows;
                                const i64 rows = nq - q0 < kBwd90Rows ? nq - q0 : kBwd90Rows;
                                sm90::bulk_reduce_add_f32(b.dq_acc + (dq_rows + q0) * p.d, sDQ_addr, (u32)(rows * HD * 4));
                                sm90::bulk_commit();
                                sm90::bulk_wait_read<0>();
                            }
                            __syncwarp();
                            sm90::named_barrier_arrive<4, kDqBarrierThreads>();
                        }
                }
            } else if (n_tiles > 0) {
                const int tid = item_thread_index<VARLEN>();
                const BwdSlice<T> in = bwd_slice<T, VARLEN>(p, b, g, bidx);
                sm90::load_tile_swizzled<kBwd90Keys, HD, 128>(sK, in.k, p.k_row_stride, k0, nk, p.d, tid);
                sm90::load_tile_swizzled<kBwd90Keys, HD, 128>(sV, in.v, p.v_row_stride, k0, nk, p.dv, tid);
                sm90::cp_async_arrive(bar.kv_full());
#pragma unroll 1
                for (int j = 0; j < group; ++j) {  // the heads' query tiles, one head after another
                    const BwdSlice<T> head =
                        j == 0 ? in : bwd_slice<T, VARLEN>(p, b, slice_geometry<VARLEN>(p, bidx + j, b.nq_pad), bidx + j);
                    const T *gQ = head.q, *gDO = head.dout;
                    const float *gLse = head.lse2, *gD = head.delta;
                    for (int t = 0; t < n_tiles; ++t) {
                        const u32 r = ring + t;  // the tile's place in the ring
                        const int s = r % STAGES;
                        if (r >= STAGES) sm90::mbarrier_wait(bar.empty(s), ((r / STAGES) & 1) ^ 1);
                        const i64 q0 = (i64)tiles.tile(t) * kBwd90Rows;
                        sm90::load_tile_swizzled<kBwd90Rows, HD, 128>(sQ + s * L::q_bytes, gQ, p.q_row_stride, q0, nq, p.d, tid);
                        sm90::load_tile_swizzled<kBwd90Rows, HD, 128>(sDO + s * L::q_bytes, gDO, b.do_row_stride, q0, nq, p.dv, tid);
                        // statistics rows [q0, q0 + 64) exist up to nq_pad: 32 + 16 chunks of 16 bytes
                        float* st = sStat + s * L::stat_floats;
                        if (tid < 32) cp_async_16(smem_addr(st + 4 * tid), gLse + 2 * q0 + 4 * tid, true);
                        else if (tid < 48) cp_async_16(smem_addr(st + 2 * kBwd90Rows + 4 * (tid - 32)), gD + q0 + 4 * (tid - 32), true);
                        sm90::cp_async_arrive(bar.full(s));
                    }
                    ring += n_tiles;
                }  // heads
                cp_async_wait<0>();
            }
            if (n_tiles > 0) ++kv_loads;
        });
        if (kDqWarp && tid == 32) sm90::bulk_wait<0>();  // every reduction done before the CTA's memory goes
    } else {
        // ---- consumers: 64 keys each ----
        sm90::claim_registers<kBwd90ConsumerRegisters>();
        u32 ring = 0, kv_round = 0;  // query tiles and K / V loads of the earlier items
        walk_bwd_items<CAUSAL, VARLEN, PERSISTENT>(p, cell, bidx, geometry, [&](const SliceGeometry& g, const Band& band, const i64 bidx, const int key_tile) {
            const i64 nq = g.nq, nk = g.nk;
            const i64 k0 = (i64)key_tile * kBwd90Keys;
            const auto tiles = query_tiles<SPARSE>(p, band, bidx, key_tile, k0, kBwd90Keys, kBwd90Rows, nq, nk);
            const int n_tiles = tiles.count;
            const int tid = item_thread_index<VARLEN>();
            const int ct = tid % 128, warp = ct / 32, lane = ct % 32;
            const int row0 = 64 * (warpgroup - 1);   // the warpgroup's first key in the CTA's tile
            const i64 wk0 = k0 + row0;               // ... as an absolute key
            const int my_col = 2 * (lane % 4);
            const float scale = (float)p.scale;
            int clean_first, clean_last;  // query tiles whose every pair with this warpgroup's keys is allowed
            band.clean_query_tiles(wk0, 64, kBwd90Rows, nk, clean_first, clean_last);

            float acc_dv[HD / 8][4], acc_dk[HD / 8][4];
            zero(acc_dv);
            zero(acc_dk);

            // PERSISTENT: this item's K / V buffer (the producer alternates them)
            const int kb = L::kv_buffer(kv_round);
            const u32 sK = base + L::k_offset_of(kb), sV = sK + L::kv_bytes;
            if (n_tiles > 0) {
                sm90::mbarrier_wait(bar.kv_full(kb), L::kv_use(kv_round) & 1);
                sm90::fence_async_shared();
            }
            i64 dq_rows = g.rows;  // the head's first row of dQ's accumulator
#pragma unroll 1
            for (int j = 0; j < group; ++j, dq_rows += p.nq) {  // as the producer: a head's tiles, then the next's
                for (int t = 0; t < n_tiles; ++t) {
                    const u32 r = ring + t;  // the tile's place in the ring
                    const int s = r % STAGES;
                    const int q_tile = tiles.tile(t);
                    const i64 q0 = (i64)q_tile * kBwd90Rows;
                    const u32 cQ = sQ + s * L::q_bytes, cDO = sDO + s * L::q_bytes;
                    const float* st = sStat + s * L::stat_floats;
                    sm90::mbarrier_wait(bar.full(s), (r / STAGES) & 1);
                    sm90::fence_async_shared();

                    // -- S^T = K Q^T; with kDpUnderP, dP^T = V dO^T issued right behind it, so that
                    // the tensor cores compute dP^T while P^T is formed --
                    float acc_s[8][4], acc_dp[8][4];
                    auto issue_dp = [&] {
#pragma unroll
                        for (int kk = 0; kk < HD / 16; ++kk)
                            sm90::wgmma_ss<T, 64>(acc_dp, sm90::kmajor_desc<kBwd90Keys>(sV, row0, kk),
                                                  sm90::kmajor_desc<kBwd90Rows>(cDO, 0, kk), kk > 0);
                    };
                    sm90::wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < HD / 16; ++kk)
                        sm90::wgmma_ss<T, 64>(acc_s, sm90::kmajor_desc<kBwd90Keys>(sK, row0, kk),
                                              sm90::kmajor_desc<kBwd90Rows>(cQ, 0, kk), kk > 0);
                    sm90::wgmma_commit();
                    if constexpr (kDpUnderP) {
                        issue_dp();
                        sm90::wgmma_commit();
                        sm90::wgmma_wait<1>();  // S^T is done; dP^T may still run
                    } else {
                        sm90::wgmma_wait<0>();
                    }
                    sm90::fence_operand(acc_s);

                    // -- P^T (rows are keys, columns queries; masked where the pair is not allowed),
                    // packed to 16 bits at once: S^T's registers are free before dP^T needs its own --
                    // A partial tile's element mask: its block look-ups stay out of the loop below,
                    // whose registers S^T, dK and dV fill (rows of S^T are keys).
                    const unsigned long long keep = SPARSE && tiles.partial(t)
                        ? partial_tile_keep<1, 8, true>(p, tiles, wk0 + 16 * warp, q0, lane) : ~0ull;
#pragma unroll
                    for (int n = 0; n < 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int ql = 8 * n + my_col + (e & 1);
                            const float2 ml = *reinterpret_cast<const float2*>(st + 2 * ql);  // (m, log2 l)
                            float pv = recompute_p(acc_s[n][e], scale, ml.x, ml.y);
                            if (!kept<8>(keep, 0, n, e)) pv = 0.f;
                            acc_s[n][e] = pv;
                        }
                    // The band's element mask, only on the tiles that cross it. Its tile origin
                    // passes an empty asm after S^T's wait, so the compiler cannot hoist the 32
                    // tests above it, where it had them run (predicated off) on every tile.
                    if (q_tile < clean_first || q_tile > clean_last) {
                        i64 mask_q0 = q0;
                        asm volatile("" : "+l"(mask_q0));
                        const TileMask mask(band, mask_q0, wk0, nk);
#pragma unroll
                        for (int n = 0; n < 8; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int ql = 8 * n + my_col + (e & 1), kl = 16 * warp + lane / 4 + 8 * (e / 2);
                                if (!mask.allowed(ql, kl)) acc_s[n][e] = 0.f;
                            }
                    }
                    u32 p_frag[4][4];
                    pack_frags<T>(acc_s, p_frag);

                    // -- (without kDpUnderP dP^T = V dO^T now, and) dV += P^T dO. At head dim 64 dS^T
                    // is formed while dV runs (p_frag, its A operand, is only read meanwhile); at 128
                    // that spills (dV in flight pins 64 more registers), so both are waited for at once --
                    sm90::fence_operand(acc_dv);
                    sm90::wgmma_fence();
                    if constexpr (!kDpUnderP) issue_dp();
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
                        sm90::wgmma_rs<T, HD>(acc_dv, p_frag[kk], sm90::mnmajor_desc<kBwd90Rows>(cDO, kk), 1);
                    sm90::wgmma_commit();
                    if constexpr (kDvUnderDs) {
                        sm90::wgmma_wait<1>();  // dP^T is done; dV may still run
                    } else {
                        sm90::wgmma_wait<0>();
                        sm90::fence_operand(acc_dv);
                    }
                    sm90::fence_operand(acc_dp);

                    // -- dS^T = P^T o (dP^T - D), P^T as rounded to 16 bits (as flash_bwd_kernel does) --
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                        for (int half = 0; half < 2; ++half)
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const int n = 2 * kk + half;
                                const float2 pv = unpack2<T>(p_frag[kk][2 * half + h]);
                                const float2 d = *reinterpret_cast<const float2*>(st + 2 * kBwd90Rows + 8 * n + my_col);
                                acc_dp[n][2 * h] = pv.x * (acc_dp[n][2 * h] - d.x);
                                acc_dp[n][2 * h + 1] = pv.y * (acc_dp[n][2 * h + 1] - d.y);
                            }

                    // -- dK += dS^T Q --
                    u32 ds_frag[4][4];
                    pack_frags<T>(acc_dp, ds_frag);
                    const u32 cDS = kDoubleDs ? sDS + s * L::ds_bytes : sDS;
                    if (kDqWarp && warpgroup == 1) sm90::named_barrier_sync<4, kDqBarrierThreads>();
                    if (ATOMIC_DQ) store_ds<T>(cDS, acc_dp, row0, warp, lane);
                    sm90::fence_operand(acc_dk);
                    sm90::wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
                        sm90::wgmma_rs<T, HD>(acc_dk, ds_frag[kk], sm90::mnmajor_desc<kBwd90Rows>(cQ, kk), 1);
                    sm90::wgmma_commit();

                    if (ATOMIC_DQ) {
                        // -- dQ += scale * dS K over all 128 keys, so dS^T of both warpgroups must be
                        // in. dK's matmul (at head dim 64 dV's too) is not waited for before the
                        // barrier but with dQ: it runs through the barrier and dQ's issue (1-2.6%
                        // faster backwards at head dim 128; at 64 too since the warp-uniform
                        // warpgroup index: bench/NOTES.md, Backward on Hopper (key pass)) --
                        sm90::fence_async_shared();
                        if (!kDqWarp && tid == kDqIssuer) sm90::bulk_wait_read<0>();  // the last tile's dQ has left its tile
                        sm90::named_barrier_sync<1, 256>();
                        if (HD == 128 || warpgroup == 1) {
                            float acc_dq[8][4];
                            const int col0 = HD == 128 ? 64 * (warpgroup - 1) : 0;  // this warpgroup's dQ columns
                            // A = dS [query][key] read from dS^T (queries contiguous), B = K [key][d] read
                            // transposed: both MN-major. 64-column block col0 / 64 of K.
#pragma unroll
                            for (int i = 0; i < kBwd90Keys / 16; ++i)
                                sm90::wgmma_ss_mn<T>(acc_dq, sm90::mnmajor_desc<kBwd90Keys>(cDS, i),
                                                     sm90::mnmajor_desc<kBwd90Keys>(sK + (col0 / 64) * kBwd90Keys * sm90::kSwizzleRowBytes, i),
                                                     i > 0);
                            sm90::wgmma_commit();
                            sm90::wgmma_wait<0>();
                            sm90::fence_operand(acc_dq);
#pragma unroll
                            for (int h = 0; h < 2; ++h) {  // the tile, row-major like dq_acc's rows
                                const int r = 16 * warp + lane / 4 + 8 * h;
#pragma unroll
                                for (int n = 0; n < 8; ++n)
                                    *reinterpret_cast<float2*>(sDQ + r * HD + col0 + 8 * n + my_col) =
                                        make_float2(scale * acc_dq[n][2 * h], scale * acc_dq[n][2 * h + 1]);
                            }
                        }
                        // The tile's rows of dq_acc are contiguous (rows of d floats): one reduction
                        // adds them all once every warpgroup adding dQ has written its columns. At
                        // head dim 128 that barrier also keeps the next tile's dS^T out of this
                        // one's buffer until both warpgroups' dQ matmuls have read it. At 64
                        // (kDoubleDs) the next tile writes the other buffer, and this one is written
                        // again two tiles on, after the next tile's barrier 1, which warpgroup 1
                        // reaches only after its dQ matmul on this buffer has been waited for.
                        if (kDqWarp && warpgroup == 1) {
                            sm90::fence_async_shared();
                            sm90::named_barrier_arrive<3, kDqBarrierThreads>();
                        } else if (HD == 128 || warpgroup == 1) {
                            sm90::fence_async_shared();
                            sm90::named_barrier_sync<3, HD == 128 ? 256 : 128>();
                            if (tid == kDqIssuer) {
                                const i64 rows = nq - q0 < kBwd90Rows ? nq - q0 : kBwd90Rows;
                                sm90::bulk_reduce_add_f32(b.dq_acc + (dq_rows + q0) * p.d, sDQ_addr, (u32)(rows * HD * 4));
                                sm90::bulk_commit();
                            }
                        }
                        if constexpr (HD == 64) sm90::wgmma_wait<0>();  // warpgroup 2 adds no dQ: its dK and dV
                    } else {
                        sm90::wgmma_wait<0>();
                    }
                    sm90::fence_operand(acc_dv);
                    sm90::fence_operand(acc_dk);
                    // The stage is free once this warp is done with it: its wgmma reads are complete
                    // (waited for above) and its lanes' loads of the statistics have been used.
                    __syncwarp();
                    if (lane == 0) sm90::mbarrier_arrive(bar.empty(s));
                }
                ring += n_tiles;
            }  // heads
            if (n_tiles > 0) {
                // PERSISTENT: every wgmma that read this K / V has been waited for: the producer
                // may load the item after next into the buffer
                if (PERSISTENT && lane == 0) sm90::mbarrier_arrive(bar.kv_empty(kb));
                ++kv_round;
            }

            // -- dK (times scale) and dV, once: rows of the slice over q's heads / group --
            const i64 kv_rows = !GROUPED ? g.kv_rows
                                : VARLEN ? (i64)((u32)g.head / (u32)group) * p.nk + g.k_start : cell.slice * p.nk;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 key = wk0 + 16 * warp + lane / 4 + 8 * h;
                if (key >= nk) continue;
#pragma unroll
                for (int n = 0; n < HD / 8; ++n) {
                    store_pair<T>(b.dk_acc, (kv_rows + key) * p.d, 8 * n + my_col, p.d, b.dkv_in_dtype,
                                  scale * acc_dk[n][2 * h], scale * acc_dk[n][2 * h + 1]);
                    store_pair<T>(b.dv_acc, (kv_rows + key) * p.dv, 8 * n + my_col, p.dv, b.dkv_in_dtype,
                                  acc_dv[n][2 * h], acc_dv[n][2 * h + 1]);
                }
            }
        });
        if constexpr (kDqWarp) {
            // the dQ warp's last arrival on barrier 4 (its first was before any tile)
            if (warpgroup == 1) sm90::named_barrier_sync<4, kDqBarrierThreads>();
        } else if constexpr (ATOMIC_DQ) {
            // every reduction done before the CTA's memory goes
            if (tid == kDqIssuer) sm90::bulk_wait<0>();
        }
    }
}

}  // namespace cuflash
