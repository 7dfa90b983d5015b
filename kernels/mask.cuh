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

}  // namespace cuflash
