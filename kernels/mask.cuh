// mask.cuh: which (query, key) pairs take part.
//
// Causal attention is aligned at the bottom right (flash-attention >= 2.1): query i may see
// key j when j <= i + (nk - nq). With nq > nk the first nq - nk queries see no key at all.
#pragma once
#include "common.cuh"

namespace cuflash {

// The last key (exclusive bound) any query in [q_begin, q_end) may see.
template <bool CAUSAL>
__device__ __forceinline__ i64 key_limit(i64 q_end, i64 nq, i64 nk) {
    if (!CAUSAL) return nk;
    const i64 lim = q_end + (nk - nq);  // last query q_end-1 sees keys < q_end + nk - nq
    return lim < 0 ? 0 : (lim < nk ? lim : nk);
}

template <bool CAUSAL>
__device__ __forceinline__ bool key_allowed(i64 q, i64 key, i64 nq, i64 nk) {
    return key < nk && (!CAUSAL || key <= q + (nk - nq));
}

// Does a (query tile, key tile) pair need element-wise masking? Only tiles that cross the
// end of the keys or the causal diagonal do; the rest run unmasked.
template <bool CAUSAL>
__device__ __forceinline__ bool tile_needs_mask(i64 q_begin, i64 key_begin, int key_rows,
                                                i64 nq, i64 nk) {
    if (key_begin + key_rows > nk) return true;
    return CAUSAL && key_begin + key_rows - 1 > q_begin + (nk - nq);
}

// The same test in 32-bit tile-local coordinates, for the inner loops where 64-bit index
// arithmetic would cost registers. For a tile whose first query is q0 and first key k0:
//   key_room = nk - k0 (keys at local index >= key_room do not exist),
//   diagonal = q0 + (nk - nq) - k0 (key local kl sees query local ql iff kl - ql <= diagonal).
// Both are clamped into int range; only their comparison with small local indices matters.
struct TileMask {
    int key_room, diagonal;
    __device__ __forceinline__ TileMask(i64 q0, i64 k0, i64 nq, i64 nk) {
        key_room = (int)clamp_small(nk - k0);
        diagonal = (int)clamp_small(q0 + (nk - nq) - k0);
    }
    template <bool CAUSAL>
    __device__ __forceinline__ bool allowed(int q_local, int k_local) const {
        return k_local < key_room && (!CAUSAL || k_local - q_local <= diagonal);
    }
    __device__ __forceinline__ static i64 clamp_small(i64 x) {
        return x > (1 << 30) ? (1 << 30) : (x < -(1 << 30) ? -(1 << 30) : x);
    }
};

}  // namespace cuflash
