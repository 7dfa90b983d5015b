// mask.cuh: which (query, key) pairs take part, and which tiles a CTA visits.
//
// Three rules combine, all optional:
//   causal   query i may see key j when j <= i + (nk - nq): aligned at the bottom right
//            (flash-attention >= 2.1). With nq > nk the first nq - nk queries see no key.
//   window   i + (nk - nq) - left <= j <= i + (nk - nq) + right (-1: that side unbounded),
//            the same alignment; causal is the window's right side clipped to 0.
//   blocks   a block mask (block_q x block_k elements per block) from the host, given to
//            each CTA as the list of tiles it visits (FwdParams::tile_lists). Tiles off the
//            list are skipped entirely; tiles that straddle present and absent blocks are
//            flagged kPartialTile and masked element by element from FwdParams::blocks.
// Causal and the window form a diagonal band: a CTA first clips its tile range to the band,
// then masks element-wise only the tiles that cross the band's edges or the end of the keys.
#pragma once
#include "common.cuh"

namespace cuflash {

constexpr i64 kUnbounded = (i64)1 << 40;  // farther than any sequence

// The band |query-to-key offset| of causal and the window, in absolute positions:
// query i sees key j iff lo <= j - i - shift <= hi, with shift = nk - nq.
struct Band {
    i64 shift, lo, hi;

    // The band of a slice of nq queries and nk keys (a varlen launch: one sequence's).
    template <bool CAUSAL>
    __device__ __forceinline__ static Band of(const FwdParams& p, i64 nq, i64 nk) {
        Band b;
        b.shift = nk - nq;
        b.lo = p.window_left < 0 ? -kUnbounded : -p.window_left;
        b.hi = p.window_right < 0 ? kUnbounded : p.window_right;
        if (CAUSAL && b.hi > 0) b.hi = 0;
        return b;
    }
    template <bool CAUSAL>
    __device__ __forceinline__ static Band of(const FwdParams& p) {
        return of<CAUSAL>(p, p.nq, p.nk);
    }
    // Keys [first, end) that any query of [q0, q_end) may see (before the key end nk).
    __device__ __forceinline__ void keys_of(i64 q0, i64 q_end, i64 nk, i64& first, i64& end) const {
        first = q0 + shift + lo;
        end = q_end - 1 + shift + hi + 1;
        first = first < 0 ? 0 : first;
        end = end > nk ? nk : end;
    }
    // Queries [first, end) that see any key of [k0, k_end).
    __device__ __forceinline__ void queries_of(i64 k0, i64 k_end, i64 nq, i64& first, i64& end) const {
        first = k0 - shift - hi;
        end = k_end - 1 - shift - lo + 1;
        first = first < 0 ? 0 : first;
        end = end > nq ? nq : end;
    }
    __device__ __forceinline__ bool allows(i64 q, i64 k) const {
        const i64 off = k - q - shift;
        return off >= lo && off <= hi;
    }
    // The key tiles (of bc keys) [first, last] that hold no pair outside the band for the
    // queries [q0, q0 + rows), and no key past nk: those run unmasked. Two ints, so that the
    // per-tile test costs no registers across the loop.
    __device__ __forceinline__ void clean_key_tiles(i64 q0, int rows, int bc, i64 nk, int& first, int& last) const {
        first = ceil_div(small(q0 + rows - 1 + shift + lo), bc);
        const i64 last_key = q0 + shift + hi < nk - 1 ? q0 + shift + hi : nk - 1;
        last = floor_div(small(last_key + 1), bc) - 1;
    }
    // The query tiles (of br queries) [first, last] in which every query sees every key of
    // [k0, k0 + bc) that exists; none when the key tile runs past nk.
    __device__ __forceinline__ void clean_query_tiles(i64 k0, int bc, int br, i64 nk, int& first, int& last) const {
        first = ceil_div(small(k0 + bc - 1 - shift - hi), br);
        last = floor_div(small(k0 - br + 1 - shift - lo), br);
        if (k0 + bc > nk) last = first - 1;
    }

    // 32-bit arithmetic on purpose: a 64-bit division is a called subroutine, and a call in
    // a kernel this register-bound makes ptxas spill around it. Positions are < 2^31.
    __device__ __forceinline__ static int small(i64 x) {
        return (int)(x > (1 << 30) ? (1 << 30) : (x < -(1 << 30) ? -(1 << 30) : x));
    }
    __device__ __forceinline__ static int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
    __device__ __forceinline__ static int ceil_div(int a, int b) { return -floor_div(-a, b); }
};

// A tile's element mask in 32-bit tile-local coordinates (cheap in the inner loops). For the
// tile whose first query is q0 and first key k0, key local kl and query local ql:
//   kl < key_room (the key exists),  diag_lo <= kl - ql <= diag_hi (inside the band).
struct TileMask {
    int key_room, diag_lo, diag_hi;
    __device__ __forceinline__ TileMask(const Band& band, i64 q0, i64 k0, i64 nk) {
        key_room = (int)clamp_small(nk - k0);
        diag_lo = (int)clamp_small(q0 + band.shift + band.lo - k0);
        diag_hi = (int)clamp_small(q0 + band.shift + band.hi - k0);
    }
    __device__ __forceinline__ bool allowed(int q_local, int k_local) const {
        const int off = k_local - q_local;
        return k_local < key_room && off >= diag_lo && off <= diag_hi;
    }
    __device__ __forceinline__ static i64 clamp_small(i64 x) {
        return x > (1 << 30) ? (1 << 30) : (x < -(1 << 30) ? -(1 << 30) : x);
    }
};

// The inner tiles one CTA visits, in order: a dense range, or (SPARSE) a slice of its
// block-sparse list, clipped to the band either way. Dense variants carry no list at all, so
// block sparsity costs the dense kernels no registers.
template <bool SPARSE>
struct TileList {
    const int* entries;  // SPARSE: this CTA's list; tile i = entries[i] without the flag
    int first, count;    // dense: tile i = first + i
    int mask_batch;      // SPARSE: which slice of the block mask

    // outer: this CTA's tile on its own axis; [band_first, band_end) its band on the other
    // axis in elements (< 2^31), visited in tiles of `inner` elements.
    __device__ __forceinline__ static TileList make(const FwdParams& p, i64 bidx, int outer,
                                                    i64 band_first, i64 band_end, int inner) {
        TileList t;
        const int lo = (int)band_first / inner;
        const int hi = band_end > band_first ? ((int)band_end + inner - 1) / inner : lo;
        t.entries = nullptr;
        t.first = lo;
        t.count = hi - lo;
        t.mask_batch = 0;
        if constexpr (SPARSE) {
            // lead_offset in 32 bits (a 64-bit division is a called subroutine)
            u32 flat = (u32)bidx, mb = 0;
#pragma unroll
            for (int i = kMaxLead - 1; i >= 0; --i) {
                const u32 n = (u32)p.lead_shape[i];
                mb += (flat % n) * (u32)p.mask_lead_stride[i];
                flat /= n;
            }
            t.mask_batch = (int)mb;
            const i64 row = (i64)mb * p.n_outer + outer;
            const int* list = p.tile_lists + row * p.list_stride;
            int b = 0, e = p.tile_counts[row];  // the list is ascending: drop tiles outside [lo, hi)
            while (b < e && (list[b] & ~kPartialTile) < lo) ++b;
            while (e > b && (list[e - 1] & ~kPartialTile) >= hi) --e;
            t.entries = list + b;
            t.first = 0;
            t.count = e - b;
        }
        return t;
    }
    __device__ __forceinline__ int tile(int i) const {
        if constexpr (SPARSE) return entries[i] & ~kPartialTile;
        return first + i;
    }
    __device__ __forceinline__ bool partial(int i) const {
        if constexpr (SPARSE) return (entries[i] & kPartialTile) != 0;
        return false;
    }
    // For a partial tile: is the block holding (query q < nq, key k < nk) present?
    __device__ __forceinline__ bool block_present(const FwdParams& p, i64 q, i64 k) const {
        const int tq = (int)p.mask_tq, tk = (int)p.mask_tk;
        const int bq = (int)q / (int)p.block_q, bk = (int)k / (int)p.block_k;
        return p.blocks[((i64)mask_batch * tq + bq) * tk + bk] != 0;
    }
};

// The key tiles (of bc keys) a CTA of queries [q0, q_end) visits, and the query tiles (of br
// queries) a CTA of keys [k0, k0 + bc) visits, in a slice of nq queries and nk keys.
template <bool SPARSE>
__device__ __forceinline__ TileList<SPARSE> key_tiles(const FwdParams& p, const Band& band, i64 bidx, int outer,
                                                      i64 q0, i64 q_end, int bc, i64 nk) {
    i64 first, end;
    band.keys_of(q0, q_end, nk, first, end);
    return TileList<SPARSE>::make(p, bidx, outer, first, end, bc);
}
template <bool SPARSE>
__device__ __forceinline__ TileList<SPARSE> query_tiles(const FwdParams& p, const Band& band, i64 bidx, int outer,
                                                        i64 k0, int bc, int br, i64 nq, i64 nk) {
    i64 first, end;
    band.queries_of(k0, k0 + bc < nk ? k0 + bc : nk, nq, first, end);
    return TileList<SPARSE>::make(p, bidx, outer, first, end, br);
}

// A partial tile's element mask for one thread's m16n8 accumulator tiles: bit (mt NT + n) 4 + e
// says whether the pair of element e of tile (mt, n) is in range and its block present. The
// element's row is row0 + 16 mt + lane / 4 + 8 (e / 2), its column col0 + 8 n + 2 (lane % 4)
// + (e & 1); rows are queries and columns keys, or the other way round with KEY_ROWS (the
// backward key pass's S^T). The look-ups run in a rolled loop: unrolled over every element
// inside the wgmma kernels' score loops, they were two thirds of the sparse forward's code and
// the sparse backward key pass's 132-204 bytes of spill. (The mma.sync kernels still unroll
// theirs: moving them here changed the code of some of their dense sm_80 variants too, which
// a change made without a GPU must not.)
template <int MT, int NT, bool KEY_ROWS, bool SPARSE>
__device__ __forceinline__ unsigned long long partial_tile_keep(const FwdParams& p, const TileList<SPARSE>& tiles,
                                                                i64 row0, i64 col0, int lane) {
    static_assert(MT * NT * 4 <= 64, "one bit an element of at most 64");
    unsigned long long keep = 0ull;
#pragma unroll 1
    for (int i = 0; i < MT * NT * 4; ++i) {
        const int e = i % 4, n = (i / 4) % NT, mt = i / (4 * NT);
        const i64 row = row0 + 16 * mt + lane / 4 + 8 * (e / 2), col = col0 + 8 * n + 2 * (lane % 4) + (e & 1);
        const i64 q = KEY_ROWS ? col : row, k = KEY_ROWS ? row : col;
        if (q < p.nq && k < p.nk && tiles.block_present(p, q, k)) keep |= 1ull << i;
    }
    return keep;
}

// Whether element e of accumulator tile (mt, n) is kept by a partial_tile_keep mask.
template <int NT>
__device__ __forceinline__ bool kept(unsigned long long keep, int mt, int n, int e) {
    return (keep >> ((mt * NT + n) * 4 + e)) & 1ull;
}

// The whole test for one pair of a slice of nq queries and nk keys, for kernels that check
// every pair (the float32 ones).
template <bool SPARSE>
__device__ __forceinline__ bool pair_allowed(const FwdParams& p, const Band& band, const TileList<SPARSE>& tiles,
                                             bool partial, i64 q, i64 k, i64 nq, i64 nk) {
    if (q >= nq || k >= nk || !band.allows(q, k)) return false;
    return !partial || tiles.block_present(p, q, k);
}

}  // namespace cuflash
