// flash_decode.cu: attention of a few queries against a long KV cache (decoding, speculative
// verification, chunked-prefill tails), split across the keys (Flash-Decoding), for float16 /
// bfloat16 on tensor cores (sm_80 and newer). Dense caches and paged ones.
//
// With 1-16 queries a head, one CTA per (batch, head) leaves most SMs idle while a few stream
// the whole cache. So:
//   - The Hq / Hk query heads that share a k/v head are packed into one tile of rows,
//     rows = group x Nq (row R = g * Nq + i: query i of head hk * group + g), 16 x ROW_WARPS
//     rows a CTA, so each K/V byte is read once per group; a group of more rows takes several
//     row-tile CTAs, adjacent in the grid so that their K/V reads meet in L2.
//   - The key range of each (batch, k/v head) is cut into num_splits chunks of whole key tiles,
//     each a CTA. A split writes its partial (o / l, l, m) to a float32 workspace and
//     flash_decode_combine_kernel merges the splits by their log-sum-exp. With one split the
//     kernel writes o, l, m itself.
//   - Inside a CTA the NWARPS warps form ROW_WARPS x KEY_WARPS: warp (wr, wk) owns rows
//     [16 wr, 16 wr + 16) of the CTA's and keys [wk KW, (wk + 1) KW) of each tile of BC =
//     KEY_WARPS x KW keys, with its own online-softmax state and O. The key warps of a row
//     tile merge their states once, at the end, so a warp never waits for another inside the
//     loop (one barrier a tile, for the buffers). Few rows (GQA, Nq = 1: 4 rows) take one row
//     warp and four key warps: every warp has work, and no mma row is wasted twice.
//   - Tiles stream through STAGES cp.async buffers: STAGES - 1 tiles in flight while one is
//     computed. Every thread issues BC * HD / (8 * NT) 16-byte copies each of K and V a tile.
//   - Q, K and V rows lie in shared memory unpadded, HD elements a row, the 16-byte chunk c of
//     row r at chunk c ^ (r % 8), so the eight rows an ldmatrix phase reads hit eight different
//     16-byte bank groups. Padded rows (HD + 8) did that too, but copies into rows that start
//     off a 128-byte boundary make the L2 look up 1.5x the sectors: streaming the same 1 GB
//     (H200, ncu; bench/NOTES.md, Decoding) padded rows took 50.3 M lookups and 4.08 TB/s,
//     swizzled ones 33.6 M (one a sector, as cuDNN's decode) and 4.40 TB/s.
//
// Sequence lengths are read from device memory (seqlens, clamped to [0, capacity]): the grid
// is sized from the capacity, and a CTA whose keys all lie past its sequence's end writes the
// empty state (o = 0, l = 0, m = -inf) without loading anything. Rows past a length are never
// read (the copies zero-fill them), whatever the cache holds there.
//
// Paged caches: key j of sequence b lives in page page_table[b][j / page_size], row
// j % page_size. A page index outside [0, num_pages) is never dereferenced: the keys of that
// page are masked (they take no part, as if past the sequence's end), so a bad table entry
// cannot read out of bounds. Each 16-key group's page is looked up once, a few iterations before
// its copies are issued (so the page-table read latency is off the copy path), and turned into
// the address of the group's first row of K and of V in shared memory; a copy adds its row's
// offset within the group (32-bit: the host keeps 16 rows of a page under 2 GB) to that.
//
// Every tile size is a template argument chosen by cuflash/_config.py (SplitKvDecode).
#include "common.cuh"
#include "softmax.cuh"
#include "mask.cuh"

namespace cuflash {

// From cuflash/_constants.py (DECODE_ROW_TILE, DECODE_PAGE_GROUP) through kernel_defines().
constexpr int kDecodeRows = CUFLASH_DECODE_ROWS;  // query rows a warp
constexpr int kPageGroup = CUFLASH_DECODE_PAGE_GROUP;  // keys that share one page-table look-up
// Paged: the page-table entries of kPageBatch key tiles are read together, and stored to shared
// memory kPageBatch - 1 iterations later (see the loop), into a ring of kPageSlots tiles. Both
// from _constants (DECODE_PAGE_BATCH, DECODE_PAGE_SLOTS).
constexpr int kPageBatch = CUFLASH_DECODE_PAGE_BATCH;
constexpr int kPageSlots = CUFLASH_DECODE_PAGE_SLOTS;
static_assert(kDecodeRows == 16, "a warp's rows are one m16 mma tile (the accumulator rows lane / 4 + 8 h)");

// Every member is 8 bytes, laid out by cuflash/_params.py by name (DECODE_PARAM_FIELDS).
struct DecodeParams {
    const void* q;        // (batch..., Hq, nq, d): strided, last dim contiguous
    const void* k;        // dense (batch, Hk, capacity, d) or paged (num_pages, Hk, page_size, d)
    const void* v;        // like k, with dv
    void* o;              // (batch, Hq, nq, dv) contiguous, q's dtype
    float* l;             // (batch, Hq, nq) contiguous
    float* m;
    float* ws_o;          // num_splits > 1: (num_splits, batch * Hq * nq, dv) float32, o / l per split
    float* ws_l;          // (num_splits, batch * Hq * nq): l per split
    float* ws_m;          //   and the raw (unscaled) max of q.k per split; -inf if empty
    const int* page_table;  // paged: (batch, max_pages) contiguous
    const int* seqlens;     // (batch,) or null: every sequence is `capacity` long
    i64 kv_heads;         // Hk
    i64 group;            // Hq / Hk
    i64 nq;
    i64 rows;             // group * nq: packed rows of one (batch, k/v head)
    i64 row_tiles;        // ceil(rows / (kDecodeRows * ROW_WARPS))
    i64 num_bh;           // batch * Hk
    i64 capacity;         // keys a sequence can hold: Nk (dense) or max_pages * page_size
    i64 d, dv;
    i64 q_batch_stride, q_head_stride, q_row_stride;  // element strides
    i64 k_batch_stride, k_head_stride, k_row_stride;  // paged: k_batch_stride is the page stride
    i64 v_batch_stride, v_head_stride, v_row_stride;
    i64 page_shift;       // log2(page_size); paged only
    i64 max_pages, num_pages;
    i64 num_splits, tiles_per_split;
    double scale, scale_log2;
    // Aligned at each sequence's end like causal (which Python folds in as right = 0):
    // query i sees key j iff len - nq + i - window_left <= j <= len - nq + i + window_right.
    i64 window_left, window_right;
};

struct DecodeCombineParams {
    const float* ws_o;
    const float* ws_l;
    const float* ws_m;
    void* o;
    float* l;
    float* m;
    i64 total_rows;       // batch * Hq * nq
    i64 dv;
    i64 num_splits;
    double scale, scale_log2;
};

// Both blocks as cuflash/_params.py lays them out, member by member (DECODE_PARAM_FIELDS,
// COMBINE_PARAM_FIELDS; CUFLASH_PARAM_WORD in common.cuh), so a member renamed, moved, added
// or dropped on one side only fails the build here.
#define CUFLASH_PARAM_BLOCK DecodeParams
CUFLASH_DECODE_PARAM_WORDS
#undef CUFLASH_PARAM_BLOCK
static_assert(sizeof(DecodeParams) == CUFLASH_DECODE_PARAM_BYTES, "DecodeParams against _params.DECODE_PARAM_FIELDS");
#define CUFLASH_PARAM_BLOCK DecodeCombineParams
CUFLASH_COMBINE_PARAM_WORDS
#undef CUFLASH_PARAM_BLOCK
static_assert(sizeof(DecodeCombineParams) == CUFLASH_COMBINE_PARAM_BYTES,
              "DecodeCombineParams against _params.COMBINE_PARAM_FIELDS");

// Element offset of the 16-byte chunk holding columns [8c, 8c + 8) of row r in a tile of
// HD-element rows, the chunk swizzled by r % 8 (within its 128 bytes).
template <int HD>
__device__ __forceinline__ int swizzled(int r, int c) {
    static_assert(HD % 64 == 0, "rows of whole 128-byte blocks");
    return r * HD + ((c ^ (r & 7)) << 3);
}

template <int HD, int BC, int STAGES, int NWARPS, int ROW_WARPS, bool PAGED>
struct DecodeSmemLayout {
    static constexpr int q_elems = ROW_WARPS * kDecodeRows * HD;
    static constexpr int kv_elems = BC * HD;  // one stage of K (or V)
    // dense: one more than the stages (unused); paged: see the loop
    static constexpr int page_slots = PAGED ? kPageSlots : STAGES + 1;
    static_assert(!PAGED || (kPageBatch + STAGES <= kPageSlots && kPageBatch >= STAGES - 1),
                  "a batch's slots are free when it is stored, and batch 1 is read before the loop");
    static constexpr int pages_per_tile = BC / kPageGroup;
    static constexpr int tile_bytes = 2 * (q_elems + 2 * STAGES * kv_elems);
    // Paged: a slot holds each group's first row of K and of V (two pointers); dense caches
    // keep the 4 bytes a group they have always reserved.
    static constexpr int page_bytes = (PAGED ? 16 : 4) * page_slots * pages_per_tile;
    // The tiles start on a row boundary (HD * 2 bytes) for the ldmatrix addressing in the loop;
    // the dynamic shared memory's start is rounded up to one, hence this slack.
    static constexpr int row_bytes = HD * 2;
    static constexpr int bytes = tile_bytes + page_bytes + row_bytes;
    // Once the loop is done, the K/V buffers hold each warp's O (float32) and then its m and l
    // per row, for the merge.
    static constexpr int o_pitch = HD + 4;
    static constexpr int o_bytes = 4 * NWARPS * kDecodeRows * o_pitch;
    static constexpr int stat_bytes = 4 * 2 * NWARPS * kDecodeRows;
    static_assert(o_bytes + stat_bytes <= 2 * 2 * STAGES * kv_elems, "the merge fits in K/V");
};

// The page-table entry of the 16-key group starting at key j, or -1 past the sequence's end.
// Not checked here: a check would wait for the read, whose latency the caller hides.
__device__ __forceinline__ int page_entry(const int* table_row, int j, int len, int page_shift) {
    return j < len ? table_row[j >> page_shift] : -1;
}

// Copies keys [k0, k0 + BC) of a dense cache, key j at cache + j * row_stride, into a swizzled
// tile. Keys at or past len and columns at or past ncols are zero-filled, not read.
template <int BC, int HD, int NT, typename T>
__device__ __forceinline__ void load_kv_tile_async(T* smem, const T* cache, i64 row_stride, int k0, int len,
                                                   i64 ncols, int tid) {
    constexpr int CHUNKS = HD / 8;
    constexpr int TOTAL = BC * CHUNKS;
    static_assert(TOTAL % NT == 0, "whole copies a thread");
#pragma unroll
    for (int it = 0; it < TOTAL / NT; ++it) {
        const int i = tid + it * NT;
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int j = k0 + r;
        const bool valid = j < len && c * 8 < ncols;
        const i64 row = (i64)j * row_stride;
        const T* src = valid ? cache + row + c * 8 : cache;
        cp_async_16(smem_addr(smem + swizzled<HD>(r, c)), src, valid);
    }
}

// The same from a paged cache: group_rows[g] is the first row of keys [k0 + 16 g, k0 + 16 g +
// 16) (one page holds them), or null where the group is masked; rows lie row_bytes apart. A
// thread copies chunk c of rows r_lo + it * RSTEP, so its group, its row within the group and
// its swizzled place in the tile follow from it at compile time: a copy costs its group's
// address plus a 32-bit offset.
template <int BC, int HD, int NT, typename T>
__device__ __forceinline__ void load_paged_tile_async(T* smem, const T* const* group_rows, const T* fallback,
                                                      int row_bytes, int k0, int len, i64 ncols, int tid) {
    constexpr int CHUNKS = HD / 8;
    constexpr int RSTEP = NT / CHUNKS;  // rows between a thread's copies
    static_assert(NT % CHUNKS == 0 && BC % RSTEP == 0, "whole rows a pass, whole passes a tile");
    static_assert(RSTEP % kPageGroup == 0 || kPageGroup % RSTEP == 0, "a thread's rows keep their place in a group");
    static_assert(RSTEP % 8 == 0, "a thread's rows keep their swizzle");
    // Each pass a group of its own (RSTEP a multiple of 16), or several passes in one group.
    constexpr bool GROUP_A_PASS = RSTEP % kPageGroup == 0;
    const int r_lo = tid / CHUNKS, c = tid % CHUNKS;
    const bool cols_ok = c * 8 < ncols;
    const u32 dst = smem_addr(smem + swizzled<HD>(r_lo, c));
    const int offset = (GROUP_A_PASS ? r_lo % kPageGroup : r_lo) * row_bytes + c * 16;
    // The thread's groups' addresses first: shared-memory reads between the copies cost each
    // copy three issue slots of padding.
    constexpr int GROUPS = GROUP_A_PASS ? BC / RSTEP : BC / kPageGroup;
    const char* bases[GROUPS];
#pragma unroll
    for (int i = 0; i < GROUPS; ++i)
        bases[i] = reinterpret_cast<const char*>(group_rows[GROUP_A_PASS ? r_lo / kPageGroup + i * (RSTEP / kPageGroup) : i]);
#pragma unroll
    for (int it = 0; it < BC / RSTEP; ++it) {
        // the row's group (of the thread's), and how far past the thread's first row in a group it lies
        const int g = GROUP_A_PASS ? it : it * RSTEP / kPageGroup;
        const int w = GROUP_A_PASS ? 0 : it * RSTEP % kPageGroup;
        const char* base = bases[g];
        const bool valid = base != nullptr && k0 + r_lo + it * RSTEP < len && cols_ok;
        const void* src = valid ? static_cast<const void*>(base + (offset + w * row_bytes)) : fallback;
        cp_async_16(dst + it * RSTEP * HD * (int)sizeof(T), src, valid);
    }
}

// One variant: a parameter for each field of cuflash/_variants.py's SplitKvDecode, in its
// order, then smem_bytes, which DecodeSmemLayout must come to.
template <typename dtype, int head_dim, int block_cols, int warps, int stages, bool paged, int row_warps,
          int smem_bytes>
struct DecodeTraits {
    using T = dtype;
    static constexpr int HD = head_dim, BC = block_cols, NWARPS = warps, STAGES = stages, ROW_WARPS = row_warps;
    static constexpr int SMEM_BYTES = smem_bytes;
    static constexpr bool PAGED = paged;
};

// Paged forms ask for the two CTAs an SM their shared memory is sized for: left to itself
// NVRTC gave the eight-warp, one-row-warp form 80 registers and a spill, and with one asked
// the eight-warp forms took more than two CTAs' registers. (0 leaves the dense forms' machine
// code as it was; they fit two CTAs on their own.)
template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32, K::PAGED ? 2 : 0)
flash_decode_kernel(const __grid_constant__ DecodeParams p) {
    using T = typename K::T;
    constexpr int HD = K::HD, BC = K::BC, NWARPS = K::NWARPS, STAGES = K::STAGES, ROW_WARPS = K::ROW_WARPS;
    constexpr int SMEM_BYTES = K::SMEM_BYTES;
    constexpr bool PAGED = K::PAGED;
    constexpr int NT = NWARPS * 32;
    constexpr int KEY_WARPS = NWARPS / ROW_WARPS;
    constexpr int KW = BC / KEY_WARPS;  // keys a warp owns in each tile
    constexpr int CTA_ROWS = ROW_WARPS * kDecodeRows;
    static_assert(KEY_WARPS * ROW_WARPS == NWARPS, "the warps form ROW_WARPS x KEY_WARPS");
    static_assert(KW % 16 == 0 && KW * KEY_WARPS == BC, "each warp takes whole 16-key mma steps");
    static_assert(KW % kPageGroup == 0, "each warp takes whole page groups (one page look-up each)");
    static_assert(HD % 16 == 0 && STAGES >= 2, "mma tiles are 16 wide; at least double buffering");
    using L = DecodeSmemLayout<HD, BC, STAGES, NWARPS, ROW_WARPS, PAGED>;
    static_assert(L::bytes == SMEM_BYTES, "shared-memory layout against SplitKvDecode.fixed_smem");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    require_dynamic_smem((u32)SMEM_BYTES);
    constexpr u32 ROW_BYTES = L::row_bytes;
    unsigned char* smem = smem_raw + (ROW_BYTES - smem_addr(smem_raw) % ROW_BYTES) % ROW_BYTES;
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + L::q_elems;
    T* sV = sK + STAGES * L::kv_elems;
    // Paged: [page_slots][pages_per_tile] first rows of each group of K, then of V.
    const T** sKRows = reinterpret_cast<const T**>(smem + L::tile_bytes);
    const T** sVRows = sKRows + L::page_slots * L::pages_per_tile;
    float* sO = reinterpret_cast<float*>(sK);  // after the loop: [NWARPS][16][o_pitch]
    float* sStatM = sO + L::o_bytes / 4;      // after the loop: [NWARPS][16]
    float* sStatL = sStatM + NWARPS * kDecodeRows;

    const i64 bidx = flat_batch_index();  // batch * Hk + k/v head
    if (bidx >= p.num_bh) return;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int warp_row = warp / KEY_WARPS, warp_key = warp % KEY_WARPS;
    const int row_tile = (int)blockIdx.x % (int)p.row_tiles, split = (int)blockIdx.x / (int)p.row_tiles;
    // 32-bit: a 64-bit division is a called subroutine (num_bh and the tiles are < 2^31)
    const int batch = (int)bidx / (int)p.kv_heads, head_kv = (int)bidx % (int)p.kv_heads;
    const int row0 = row_tile * CTA_ROWS;  // the CTA's first packed row
    const int warp_row0 = warp_row * kDecodeRows;  // the warp's first, within the CTA
    const int nq = (int)p.nq, rows = (int)p.rows;

    // -- this CTA's keys: its split, clipped to the sequence and to the band of its queries --
    i64 len = p.seqlens ? (i64)p.seqlens[batch] : p.capacity;
    len = len < 0 ? 0 : (len > p.capacity ? p.capacity : len);
    const i64 shift = len - nq;  // query i's diagonal: key i + shift
    const i64 lo = p.window_left < 0 ? -kUnbounded : -p.window_left;
    const i64 hi = p.window_right < 0 ? kUnbounded : p.window_right;
    i64 key_first = (i64)split * p.tiles_per_split * BC, key_end = key_first + p.tiles_per_split * BC;
    key_first = key_first > shift + lo ? key_first : shift + lo;   // query 0's first key
    key_end = key_end < len ? key_end : len;
    key_end = key_end < nq + shift + hi ? key_end : nq + shift + hi;  // one past query nq-1's last
    const int tile_first = (int)(key_first / BC);
    const int n_tiles = key_end > key_first ? (int)((key_end + BC - 1) / BC) - tile_first : 0;
    // Keys every query sees (no element mask): [clean_first, clean_last].
    const i64 clean_first = nq - 1 + shift + lo, clean_last = shift + hi < len - 1 ? shift + hi : len - 1;

    // In the m16n8 accumulator layout a thread holds rows lane/4 and lane/4 + 8. Its rows'
    // keys: [row_key_lo[h], row_key_hi[h]] (32-bit: positions are < 2^31).
    int row_key_lo[2], row_key_hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = (row0 + warp_row0 + lane / 4 + 8 * h) % nq;
        const i64 first = i + shift + lo, last = i + shift + hi;
        row_key_lo[h] = (int)(first < 0 ? 0 : first);
        row_key_hi[h] = (int)(last < len - 1 ? last : len - 1);
    }

    const T* gK = static_cast<const T*>(p.k) + head_kv * p.k_head_stride;
    const T* gV = static_cast<const T*>(p.v) + head_kv * p.v_head_stride;
    if (!PAGED) {
        gK += batch * p.k_batch_stride;
        gV += batch * p.v_batch_stride;
    }
    const int* table_row = PAGED ? p.page_table + batch * p.max_pages : nullptr;
    const int page_mask = (1 << p.page_shift) - 1;
    const int ilen = (int)len;
    const int k_row_bytes = (int)(p.k_row_stride * (i64)sizeof(T)), v_row_bytes = (int)(p.v_row_stride * (i64)sizeof(T));

    // Stage u's copies: K and V of key tile tile_first + u (paged: rows from slot u % page_slots).
    auto load_tile = [&](int u) {
        const int stage = u % STAGES;
        const int k0 = (tile_first + u) * BC;
        if constexpr (PAGED) {
            const int slot = (u % L::page_slots) * L::pages_per_tile;
            load_paged_tile_async<BC, HD, NT>(sK + stage * L::kv_elems, sKRows + slot, gK, k_row_bytes, k0,
                                              ilen, p.d, tid);
            load_paged_tile_async<BC, HD, NT>(sV + stage * L::kv_elems, sVRows + slot, gV, v_row_bytes, k0,
                                              ilen, p.dv, tid);
        } else {
            load_kv_tile_async<BC, HD, NT>(sK + stage * L::kv_elems, gK, p.k_row_stride, k0, ilen, p.d, tid);
            load_kv_tile_async<BC, HD, NT>(sV + stage * L::kv_elems, gV, p.v_row_stride, k0, ilen, p.dv, tid);
        }
    };
    // Paged: thread tid < kPageBatch * pages_per_tile reads the page of group tid % pages_per_tile
    // of tile tid / pages_per_tile of batch b (tiles [kPageBatch b, kPageBatch b + kPageBatch)),
    // or -1 ...
    constexpr int PAGE_READERS = kPageBatch * L::pages_per_tile;
    static_assert(!PAGED || PAGE_READERS <= NT, "a thread for each group of a batch of tiles");
    // The tile of batch b that a reading thread covers, and the first key of its group in tile u.
    auto batch_tile = [&](int b) { return b * kPageBatch + tid / L::pages_per_tile; };
    auto group_key = [&](int u) { return (tile_first + u) * BC + tid % L::pages_per_tile * kPageGroup; };
    auto fetch_page = [&](int b) {
        const int u = batch_tile(b);
        return u < n_tiles ? page_entry(table_row, group_key(u), ilen, (int)p.page_shift) : -1;
    };
    // ... and stores that group's first row of K and of V in the page to its tile's slot, or
    // null where the group must not be read: past the end, or an index outside [0, num_pages).
    auto store_group_rows = [&](int b, int page) {
        page = page >= 0 && page < p.num_pages ? page : -1;
        const int u = batch_tile(b);
        const int at = (u % L::page_slots) * L::pages_per_tile + tid % L::pages_per_tile;
        const i64 row = group_key(u) & page_mask;
        sKRows[at] = page < 0 ? nullptr : gK + page * p.k_batch_stride + row * p.k_row_stride;
        sVRows[at] = page < 0 ? nullptr : gV + page * p.v_batch_stride + row * p.v_row_stride;
    };
    int batch_page = -1;  // a page read at one iteration and stored kPageBatch - 1 later

    const float scale_log2 = (float)p.scale_log2;
    float acc_o[HD / 8][4];
    zero(acc_o);
    OnlineSoftmax<2> softmax;
    softmax.init();

    if (n_tiles > 0) {
        // -- Q: the CTA's packed rows (zero past the group's rows and past d) --
        const T* gQ = static_cast<const T*>(p.q) + batch * p.q_batch_stride;
        constexpr int Q_CHUNKS = HD / 8;
        for (int i = tid; i < CTA_ROWS * Q_CHUNKS; i += NT) {
            const int r = i / Q_CHUNKS, c = i % Q_CHUNKS, R = row0 + r;
            const bool valid = R < rows && c * 8 < p.d;
            const int g = R / nq, qi = R % nq;
            const T* src = valid ? gQ + (head_kv * p.group + g) * p.q_head_stride + qi * p.q_row_stride + c * 8 : gQ;
            cp_async_16(smem_addr(sQ + swizzled<HD>(r, c)), src, valid);
        }
        if constexpr (PAGED) {
            if (tid < PAGE_READERS) {
                store_group_rows(0, fetch_page(0));
                batch_page = fetch_page(1);
            }
            __syncthreads();
        }
        for (int u = 0; u < STAGES - 1; ++u) {
            if (u < n_tiles) load_tile(u);
            cp_async_commit();  // Q rides in group 0
        }
    }

    // ldmatrix addresses. A lane reads row r at 16-column step j, i.e. chunk 2j + h (h: which
    // half of the 16 columns the lane's matrix holds), stored at chunk (2j + h) ^ (r % 8) =
    // ((h ^ r % 8) ^ 2j): the lane's address for step 0 XOR 32j, as every row starts on a
    // ROW_BYTES boundary and 32j stays inside the row. The XOR is one instruction on the
    // running address (offsets held a step each cost registers). Rows r % 8 = lane % 8 in all three.
    const int lane_swizzle = lane % 8;
    const u32 q_lane = smem_addr(sQ) + (warp_row0 + lane % 16) * ROW_BYTES + (((lane / 16) ^ lane_swizzle) << 4);
    const u32 k_lane = (warp_key * KW + lane % 8 + (lane / 16) * 8) * ROW_BYTES + ((((lane / 8) % 2) ^ lane_swizzle) << 4);
    const u32 v_lane = (warp_key * KW + lane % 8 + ((lane / 8) % 2) * 8) * ROW_BYTES + (((lane / 16) ^ lane_swizzle) << 4);
    const int my_col = 2 * (lane % 4);
    for (int t = 0; t < n_tiles; ++t) {
        // Tile t has landed, and every warp is done with tile t - 1, whose buffers are refilled.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (t + STAGES - 1 < n_tiles) load_tile(t + STAGES - 1);
        cp_async_commit();
        // Paged: batch b's pages are read at iteration kPageBatch (b - 1) - STAGES + 1 and stored
        // at the end of iteration kPageBatch b - STAGES (the read's latency, which under a
        // saturated memory outlasts one tile's math, hides behind kPageBatch - 1 tiles'),
        // then published by the next barrier, just before tile kPageBatch b's copies.
        if (PAGED && tid < PAGE_READERS && (t + STAGES - 1) % kPageBatch == 0)
            batch_page = fetch_page((t + STAGES - 1) / kPageBatch + 1);

        const int stage = t % STAGES;
        const u32 cK = smem_addr(sK + stage * L::kv_elems) + k_lane;  // this lane's row of the warp's keys
        const u32 cV = smem_addr(sV + stage * L::kv_elems) + v_lane;
        const int kw0 = (tile_first + t) * BC + warp_key * KW;

        // -- S = Q K^T over this warp's KW keys (raw scores, fp32) --
        float acc_s[KW / 8][4];
        zero(acc_s);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, q_lane ^ (kk << 5));
#pragma unroll
            for (int nn = 0; nn < KW / 16; ++nn) {
                u32 b[4];
                ldmatrix_x4(b, (cK + nn * 16 * ROW_BYTES) ^ (kk << 5));
                mma_16816<T>(acc_s[2 * nn], a, b[0], b[1]);
                mma_16816<T>(acc_s[2 * nn + 1], a, b[2], b[3]);
            }
        }

        // -- mask: keys outside a row's band or past the end, and (paged) masked pages --
        bool masked = kw0 < clean_first || kw0 + KW - 1 > clean_last;
        const T* const* group_rows = sKRows + (t % L::page_slots) * L::pages_per_tile + warp_key * KW / kPageGroup;
        if constexpr (PAGED) {
#pragma unroll
            for (int g = 0; g < KW / kPageGroup; ++g) masked |= group_rows[g] == nullptr;
        }
        if (masked) {
#pragma unroll
            for (int n = 0; n < KW / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kl = n * 8 + my_col + (e & 1), key = kw0 + kl, h = e / 2;
                    bool ok = key >= row_key_lo[h] && key <= row_key_hi[h];
                    if constexpr (PAGED) ok = ok && group_rows[kl / kPageGroup] != nullptr;
                    if (!ok) acc_s[n][e] = neg_inf();
                }
        }

        // -- online softmax over the warp's keys, P packed as m16k16 A fragments --
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < KW / 8; ++n) {
            tile_max[0] = fmaxf(tile_max[0], fmaxf(acc_s[n][0], acc_s[n][1]));
            tile_max[1] = fmaxf(tile_max[1], fmaxf(acc_s[n][2], acc_s[n][3]));
        }
        float base[2], correction[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) correction[h] = softmax.advance(h, quad_max(tile_max[h]), scale_log2, base[h]);
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            acc_o[n][0] *= correction[0];
            acc_o[n][1] *= correction[0];
            acc_o[n][2] *= correction[1];
            acc_o[n][3] *= correction[1];
        }
        u32 p_frag[KW / 16][4];
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float* s = acc_s[2 * kk + half];
                const float p0 = fast_exp2((s[0] - base[0]) * scale_log2);
                const float p1 = fast_exp2((s[1] - base[0]) * scale_log2);
                const float p2 = fast_exp2((s[2] - base[1]) * scale_log2);
                const float p3 = fast_exp2((s[3] - base[1]) * scale_log2);
                softmax.l[0] += p0 + p1;
                softmax.l[1] += p2 + p3;
                p_frag[kk][2 * half] = pack2<T>(p0, p1);
                p_frag[kk][2 * half + 1] = pack2<T>(p2, p3);
            }

        // -- O += P V (V read transposed by ldmatrix.trans) --
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk)
#pragma unroll
            for (int nd = 0; nd < HD / 16; ++nd) {
                u32 b[4];
                ldmatrix_x4_trans(b, (cV + kk * 16 * ROW_BYTES) ^ (nd << 5));
                mma_16816<T>(acc_o[2 * nd], p_frag[kk], b[0], b[1]);
                mma_16816<T>(acc_o[2 * nd + 1], p_frag[kk], b[2], b[3]);
            }

        if (PAGED && tid < PAGE_READERS && (t + STAGES) % kPageBatch == 0)
            store_group_rows((t + STAGES) / kPageBatch, batch_page);
    }

    // -- merge the key warps' states: each warp's O rescaled to its row tile's common max and
    //    divided by the common sum, then summed through shared memory (the K/V buffers, free
    //    now). Warp w's m and l of row r sit at [w][r]; a row tile's key warps are adjacent. --
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the K/V buffers
    float m_warp[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(softmax.l[h]);
        m_warp[h] = softmax.m[h];
        if (lane % 4 == 0) {
            sStatM[warp * kDecodeRows + lane / 4 + 8 * h] = m_warp[h];
            sStatL[warp * kDecodeRows + lane / 4 + 8 * h] = l;
        }
    }
    __syncthreads();  // the stats are out
    // The common max and sum of row r of row warp wr over its key warps (base: the max, or 0
    // for a row without keys, whose factors are then exp2(-inf) = 0).
    auto row_state = [&](int wr, int r, float& base, float& m_all, float& l_all) {
        const float* m_row = sStatM + wr * KEY_WARPS * kDecodeRows + r;
        const float* l_row = sStatL + wr * KEY_WARPS * kDecodeRows + r;
        m_all = neg_inf();
#pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) m_all = fmaxf(m_all, m_row[w * kDecodeRows]);
        base = m_all == neg_inf() ? 0.f : m_all;
        l_all = 0.f;
#pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) l_all += l_row[w * kDecodeRows] * fast_exp2((m_row[w * kDecodeRows] - base) * scale_log2);
    };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = lane / 4 + 8 * h;
        float base, m_all, l_all;
        row_state(warp_row, r, base, m_all, l_all);
        const float factor = l_all > 0.f ? fast_exp2((m_warp[h] - base) * scale_log2) / l_all : 0.f;
        float* row = sO + (warp * kDecodeRows + r) * L::o_pitch;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
            *reinterpret_cast<float2*>(row + n * 8 + my_col) =
                make_float2(acc_o[n][2 * h] * factor, acc_o[n][2 * h + 1] * factor);
    }
    __syncthreads();

    // -- store: o / l in q's dtype with l, m (one split), or the split's part as float32 --
    const bool split_out = p.num_splits > 1;
    const i64 flat_row0 = bidx * p.rows + row0;  // (batch, Hq, nq) row of packed row row0
    const i64 total_rows = p.num_bh * p.rows;
    constexpr int O_CHUNKS = HD / 4;  // 4 floats a chunk
    for (int i = tid; i < CTA_ROWS * O_CHUNKS; i += NT) {
        const int r = i / O_CHUNKS, c = i % O_CHUNKS;
        if (row0 + r >= rows || c * 4 >= p.dv) continue;
        const int wr = r / kDecodeRows, rr = r % kDecodeRows;
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) {
            const float4 x = *reinterpret_cast<const float4*>(
                sO + ((wr * KEY_WARPS + w) * kDecodeRows + rr) * L::o_pitch + 4 * c);
            sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
        }
        const i64 flat_row = flat_row0 + r;
        if (split_out) {
            *reinterpret_cast<float4*>(p.ws_o + (split * total_rows + flat_row) * p.dv + 4 * c) = sum;
        } else {
            T* out = static_cast<T*>(p.o) + flat_row * p.dv + 4 * c;
            *reinterpret_cast<uint2*>(out) = make_uint2(pack2<T>(sum.x, sum.y), pack2<T>(sum.z, sum.w));
        }
        if (c == 0) {
            float base, m_all, l_all;
            row_state(wr, rr, base, m_all, l_all);
            if (split_out) {
                p.ws_l[split * total_rows + flat_row] = l_all;
                p.ws_m[split * total_rows + flat_row] = m_all;
            } else {
                p.l[flat_row] = l_all;
                p.m[flat_row] = m_all == neg_inf() ? m_all : m_all * (float)p.scale;
            }
        }
    }
}

// The exact merge of the splits' (o / l, l, m) by their log-sum-exp: one CTA a row. With
// M = max_s m_s and w_s = l_s exp(scale (m_s - M)): l = sum_s w_s, o = sum_s w_s o_s / l. Empty
// splits (l = 0, m = -inf) weigh 0; a row with no key anywhere gets o = 0, l = 0, m = -inf.
// The weights go to shared memory first, so that the warps' reads of o_s (the splits taken in
// turn, 4 columns a lane) depend on no global load and issue back to back; when each read
// waited for its split's l and m, a batch-1 MQA row of 256 splits took 10.8 us (cuDNN's merge
// of the same 3.8). Few rows take more warps (DecodeCombine.warps, cuflash/_config.py).
template <int NWARPS>
__device__ __forceinline__ float combine_block_reduce(float x, bool is_max, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        const float y = __shfl_xor_sync(0xffffffffu, x, o);
        x = is_max ? fmaxf(x, y) : x + y;
    }
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
    __syncthreads();
    x = scratch[0];
#pragma unroll
    for (int w = 1; w < NWARPS; ++w) x = is_max ? fmaxf(x, scratch[w]) : x + scratch[w];
    __syncthreads();  // scratch is reused; and the weights written before the call are visible
    return x;
}

constexpr int kMaxDecodeSplits = CUFLASH_MAX_DECODE_SPLITS;  // cuflash/_constants.py

// One variant: a parameter for each field of cuflash/_variants.py's DecodeCombine.
template <typename dtype, int warps>
struct DecodeCombineTraits {
    using T = dtype;
    static constexpr int NWARPS = warps;
};

template <class K>
__global__ void __launch_bounds__(K::NWARPS * 32)
flash_decode_combine_kernel(const __grid_constant__ DecodeCombineParams p) {
    using T = typename K::T;
    constexpr int NWARPS = K::NWARPS;
    __shared__ float scratch[NWARPS];
    __shared__ float weights[kMaxDecodeSplits];
    __shared__ float4 partial[NWARPS][32];
    const i64 row = blockIdx.x;  // the grid has one CTA a row
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int splits = (int)p.num_splits;
    const float scale_log2 = (float)p.scale_log2;
    const i64 stride = p.total_rows;  // between splits, in rows

    float m_all = neg_inf();
    for (int s = threadIdx.x; s < splits; s += NWARPS * 32) m_all = fmaxf(m_all, p.ws_m[s * stride + row]);
    m_all = combine_block_reduce<NWARPS>(m_all, true, scratch);
    const float base = m_all == neg_inf() ? 0.f : m_all;
    float l_all = 0.f;
    for (int s = threadIdx.x; s < splits; s += NWARPS * 32) {
        const float w = p.ws_l[s * stride + row] * fast_exp2((p.ws_m[s * stride + row] - base) * scale_log2);
        weights[s] = w;
        l_all += w;
    }
    l_all = combine_block_reduce<NWARPS>(l_all, false, scratch);
    const float inv_l = l_all > 0.f ? 1.f / l_all : 0.f;

    const int dv = (int)p.dv;
    for (int c0 = 0; c0 < dv; c0 += 4 * 32) {  // every thread runs every pass: the barriers need all
        const int c = c0 + 4 * lane;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < dv) {
            const float* col = p.ws_o + row * dv + c;
#pragma unroll 8
            for (int s = warp; s < splits; s += NWARPS) {
                // Every split wrote its o_s (an empty one zeros), so the read needs no test; its
                // weight (0 when empty) selects, and a 0 never meets a stray value.
                const float4 x = *reinterpret_cast<const float4*>(col + s * stride * dv);
                const float w = weights[s];
                if (w != 0.f) { acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w; }
            }
        }
        partial[warp][lane] = acc;
        __syncthreads();
        if (warp == 0 && c < dv) {
#pragma unroll
            for (int w = 1; w < NWARPS; ++w) {
                const float4 x = partial[w][lane];
                acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
            }
            T* out = static_cast<T*>(p.o) + row * dv + c;
            *reinterpret_cast<uint2*>(out) = make_uint2(pack2<T>(acc.x * inv_l, acc.y * inv_l),
                                                        pack2<T>(acc.z * inv_l, acc.w * inv_l));
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        p.l[row] = l_all;
        p.m[row] = m_all == neg_inf() ? m_all : m_all * (float)p.scale;
    }
}

}  // namespace cuflash
