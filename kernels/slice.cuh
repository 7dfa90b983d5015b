// slice.cuh: where one CTA's slice lies in the tensors, for dense and packed variable-length
// (varlen) launches alike; every kernel a varlen call can reach takes its geometry from here.
//
// Dense: a slice is one (batch..., head) of the output's leading dims, nq queries against nk
// keys, at the offsets batch_offsets gives; its rows of o, l, m start at flat * nq.
// Varlen: q (heads, total_q, d), k and v (heads_kv, total_k, d / dv); slice flat = (sequence
// s, head h), s = flat / heads, h = flat % heads. Sequence s owns the packed rows
// [cu_seqlens_q[s], cu_seqlens_q[s + 1]) of q and [cu_seqlens_k[s], ...) of k. The host never
// reads the boundaries, so they are trusted for nothing: each is clamped into [0, total] and
// an end before its start is an empty sequence. Whatever they hold, no row outside the packed
// tensors is read or written.
#pragma once
#include "mask.cuh"

namespace cuflash {

struct SliceGeometry {
    i64 q_head, k_head, v_head;  // element offsets of the slice's head in q, k, v
    i64 q_start, k_start;        // the packed row of its first query and its first key (dense: 0)
    i64 q, k, v;                 // element offsets of its first row: head + start * row stride
    i64 rows;                    // its first row of o, l, m and of dQ's float32 accumulator
    i64 kv_rows;                 // its first row of dK's and dV's accumulators (over q's heads)
    i64 stats;                   // its first row of the backward's statistics (lse2 pairs, D)
    i64 nq, nk;                  // its queries and keys
    i64 head;                    // varlen: h, for the backward's dO and O offsets

    template <bool CAUSAL>
    __device__ __forceinline__ Band band(const FwdParams& p) const { return Band::of<CAUSAL>(p, nq, nk); }
};

// Rows [start, start + n) of a sequence whose boundaries are cu[seq] and cu[seq + 1], clamped
// into [0, total]; an end before the start gives n = 0.
__device__ __forceinline__ void packed_rows(const int* cu, u32 seq, i64 total, i64& start, i64& n) {
    i64 s = cu[seq], e = cu[seq + 1];
    s = s < 0 ? 0 : (s > total ? total : s);
    e = e > total ? total : e;
    start = s;
    n = e > s ? e - s : 0;
}

// The geometry of slice `flat`. stats_pitch: the backward's statistics rows per slice (dense)
// or per head (varlen), BwdParams::nq_pad; 0 in the forward, which has none.
//
// Varlen statistics: sequence s of head h starts at row h * stats_pitch + R (ceil(start / R)
// + s), R = kStatsRowMultiple, and owns round_up(nq_s, R) rows, so that query tiles read
// whole padded tiles of their own sequence only, 16-byte aligned. These regions never
// overlap: ceil(a / R) + ceil(n / R) <= ceil((a + n) / R) + 1, and they end by
// R (ceil(total_q / R) + num_seqs), the pitch the host gives (clamping keeps that true for
// any boundaries).
template <bool VARLEN>
__device__ __forceinline__ SliceGeometry slice_geometry(const FwdParams& p, i64 flat, i64 stats_pitch = 0) {
    SliceGeometry g;
    if constexpr (!VARLEN) {
        const BatchOffsets off = batch_offsets(p, flat);
        g.q_head = g.q = off.q;
        g.k_head = g.k = off.k;
        g.v_head = g.v = off.v;
        g.q_start = g.k_start = 0;
        g.rows = flat * p.nq;
        g.kv_rows = flat * p.nk;
        g.stats = flat * stats_pitch;
        g.nq = p.nq;
        g.nk = p.nk;
        g.head = 0;
    } else {
        // 32-bit division: a 64-bit one is a called subroutine (num_batch < 2^32: slice_grid).
        const u32 heads = (u32)p.lead_shape[kMaxLead - 1];
        const u32 head = (u32)flat % heads, seq = (u32)flat / heads, head_kv = head / (u32)p.kv_group;
        g.head = head;
        g.q_head = head * p.q_lead_stride[kMaxLead - 1];
        g.k_head = head_kv * p.k_lead_stride[kMaxLead - 1];
        g.v_head = head_kv * p.v_lead_stride[kMaxLead - 1];
        packed_rows(p.cu_seqlens_q, seq, p.nq, g.q_start, g.nq);
        packed_rows(p.cu_seqlens_k, seq, p.nk, g.k_start, g.nk);
        g.q = g.q_head + g.q_start * p.q_row_stride;
        g.k = g.k_head + g.k_start * p.k_row_stride;
        g.v = g.v_head + g.k_start * p.v_row_stride;
        g.rows = head * p.nq + g.q_start;
        g.kv_rows = head * p.nk + g.k_start;
        g.stats = head * stats_pitch + kStatsRowMultiple * ((g.q_start + kStatsRowMultiple - 1) / kStatsRowMultiple + seq);
    }
    return g;
}

// Tiles of `size` rows in n rows.
__device__ __forceinline__ int tiles_of(i64 n, int size) { return (int)((n + size - 1) / size); }

// ---- work items along the grid's x axis ----------------------------------------------------
// A dense CTA has one item, the tile its grid position names. A varlen grid is sized from
// max_seqlen, which a sequence may exceed: its CTA walks items x, x + gridDim.x, ... while they
// are below the sequence's n_tiles, so no tile is skipped (x: blockIdx.x, or the tile of its
// grid cell where the kernel reads the grid tile-major, below). A kernel loops
// `for (int i = first_item<VARLEN>(); i < item_count<VARLEN>(n); i += item_step<VARLEN>())`
// (ItemWalk, below, for a CTA's own slice), which for dense code is one pass the compiler removes.
template <bool VARLEN> __device__ __forceinline__ int first_item() { return VARLEN ? (int)blockIdx.x : 0; }
template <bool VARLEN> __device__ __forceinline__ int first_item(int cell_tile) { return VARLEN ? cell_tile : 0; }
template <bool VARLEN> __device__ __forceinline__ int item_step() { return VARLEN ? (int)gridDim.x : 1; }
template <bool VARLEN> __device__ __forceinline__ int item_count(int n_tiles) { return VARLEN ? n_tiles : 1; }
// The tile of item i; REVERSED walks the last tiles first (causal: they see the most keys, so
// launching them first shortens the tail).
template <bool VARLEN, bool REVERSED>
__device__ __forceinline__ int item_tile(int i, int n_tiles) {
    if (VARLEN) return REVERSED ? n_tiles - 1 - i : i;
    return REVERSED ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
}

// ---- the (tile, slice) of a CTA ---------------------------------------------------------------
// A grid is (tiles, slices...) and the hardware starts CTAs in linear order, x fastest:
// every slice's tiles start together, one slice after another. Under causal masking the tiles
// differ in work (the first key tiles of the backward and the last query tiles of the forward
// see the most), so the last slices' long tiles start last and run on alone at the end. Read
// tile-major, the linear order is groups of kSliceGroup slices walked tile by tile (the group's
// first tiles, then its second tiles, ...): long tiles start early in every group, and a group's
// tiles still run together, sharing their slices' rows in L2. Only for grids of at most
// kTileMajorForward (forward) or kTileMajorBackward (backward) tiles a slice, where it measured
// faster: with more, the slices' own tiles fill the GPU (bench/NOTES.md, Forward (mma.sync) and
// Backward). A varlen grid's x is its longest sequence's tiles, and its CTAs start their items
// from the cell's tile: its backward takes the order up to kTileMajorVarlenBackward tiles (from
// 16, with lengths that differ, it measured level or slower; bench/NOTES.md, Packed batches
// (varlen)), its forward never.
constexpr u32 kSliceGroup = CUFLASH_SLICE_GROUP;
constexpr u32 kTileMajorForward = CUFLASH_TILE_MAJOR_FORWARD_TILES;
constexpr u32 kTileMajorBackward = CUFLASH_TILE_MAJOR_BACKWARD_TILES;
constexpr u32 kTileMajorVarlenBackward = CUFLASH_TILE_MAJOR_VARLEN_BACKWARD_TILES;

struct GridCell {
    int tile;   // the grid x index this CTA takes
    i64 slice;  // its flat (batch..., head) index, as flat_batch_index() (may be past num_batch)
};

// tile_major: whether this launch's form may take that order; most_tiles: up to how many tiles a slice.
__device__ __forceinline__ GridCell grid_cell(bool tile_major, u32 most_tiles) {
    if (!tile_major || gridDim.x > most_tiles) return {(int)blockIdx.x, flat_batch_index()};
    // 64-bit: tiles x slices can pass 2^32 (a few multiply-adds once a CTA)
    const u64 tiles = gridDim.x, slices = (u64)gridDim.y * gridDim.z;
    const u64 linear = blockIdx.x + tiles * (u64)flat_batch_index();
    const u64 group = linear / (kSliceGroup * tiles), within = linear % (kSliceGroup * tiles);
    const u64 first = group * kSliceGroup;
    const u64 width = slices - first < kSliceGroup ? slices - first : kSliceGroup;  // the last group may be short
    return {(int)(within / width), (i64)(first + within % width)};
}

// The thread index, opaque to the optimizer inside a varlen item loop. Without it the compiler
// hoists every shared-memory address derived from it out of the loop, and they stay live
// through the whole tile: the 16-bit forward's varlen form spilled 416 bytes, 0 with this.
template <bool VARLEN>
__device__ __forceinline__ int item_thread_index() {
    int tid = threadIdx.x;
    if (VARLEN) asm volatile("" : "+r"(tid));
    return tid;
}

// The work items of the CTA's slice, of n_tiles tiles in all, walked as
//     for (ItemWalk<VARLEN, REVERSED> walk(n_tiles); walk.more(); walk.next()) {
//         const int tid = walk.start(), tile = walk.tile();
//         ...
// The loop's body stays in the kernel: inside a function (a lambda) the compiler simplifies it
// before it is inlined, without the kernel around it, and the forward's registers moved.
template <bool VARLEN, bool REVERSED>
struct ItemWalk {
    int item;
    const int n_tiles;
    __device__ __forceinline__ explicit ItemWalk(int n) : item(first_item<VARLEN>()), n_tiles(n) {}
    __device__ __forceinline__ bool more() const { return item < item_count<VARLEN>(n_tiles); }
    __device__ __forceinline__ void next() { item += item_step<VARLEN>(); }
    // Begins the item, once every warp is done with the last item's buffers: the thread index
    // (item_thread_index).
    __device__ __forceinline__ int start() const {
        if (item != first_item<VARLEN>()) __syncthreads();
        return item_thread_index<VARLEN>();
    }
    // The item's tile (REVERSED: as item_tile).
    __device__ __forceinline__ int tile() const { return item_tile<VARLEN, REVERSED>(item, n_tiles); }
};

}  // namespace cuflash
