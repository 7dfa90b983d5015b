// bwd_common.cuh: where the backward kernels read a slice's inputs, and how they write their
// gradients (flash_bwd.cu, flash_bwd_sm90.cu, flash_bwd_f32.cu).
#pragma once
#include "common.cuh"
#include "slice.cuh"

namespace cuflash {

// One slice's backward inputs: where its q, k, v, dO and O rows start, and its row statistics
// ((m, log2 l) pairs and D, rows padded as slice_geometry says) as the preprocess wrote them.
template <typename T>
struct BwdSlice {
    const T *q, *k, *v, *dout, *out;
    const float *lse2, *delta;
};

// Where slice bidx's head starts (elements) in dO or O, given its leading strides: a varlen
// dO and O are (heads, total_q, dv), strided like q, so there it is head g.head's start.
template <bool VARLEN>
__device__ __forceinline__ i64 head_offset(const FwdParams& p, const SliceGeometry& g, i64 bidx,
                                           const i64 (&lead_stride)[kMaxLead]) {
    return VARLEN ? g.head * lead_stride[kMaxLead - 1] : lead_offset(p, bidx, lead_stride);
}

// g: slice_geometry<VARLEN>(p, bidx, b.nq_pad).
template <typename T, bool VARLEN>
__device__ __forceinline__ BwdSlice<T> bwd_slice(const FwdParams& p, const BwdParams& b, const SliceGeometry& g,
                                                 i64 bidx) {
    i64 dout = head_offset<VARLEN>(p, g, bidx, b.do_lead_stride), out = head_offset<VARLEN>(p, g, bidx, b.o_lead_stride);
    if constexpr (VARLEN) {  // ... and its sequence's first row
        dout += g.q_start * b.do_row_stride;
        out += g.q_start * b.o_row_stride;
    }
    return {static_cast<const T*>(p.q) + g.q, static_cast<const T*>(p.k) + g.k, static_cast<const T*>(p.v) + g.v,
            static_cast<const T*>(b.dout) + dout, static_cast<const T*>(b.out) + out,
            b.lse2 + 2 * g.stats, b.delta + g.stats};
}

// Stores two adjacent gradient values at row_offset + col (col < ncols, even), as fp32 or,
// when in_dtype, packed in the input dtype T.
template <typename T>
__device__ __forceinline__ void store_pair(float* base, i64 row_offset, int col, i64 ncols, i64 in_dtype,
                                           float x0, float x1) {
    if (col >= ncols) return;
    if (in_dtype)
        *reinterpret_cast<u32*>(reinterpret_cast<T*>(base) + row_offset + col) = pack2<T>(x0, x1);
    else
        *reinterpret_cast<float2*>(base + row_offset + col) = make_float2(x0, x1);
}

// dst[0] += x, dst[1] += y in device memory (8-byte aligned): one vector reduction on sm_90.
__device__ __forceinline__ void atomic_add_pair(float* dst, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(dst, x);
    atomicAdd(dst + 1, y);
#endif
}

}  // namespace cuflash
