// bwd_common.cuh: where the backward kernels read a slice's inputs, and how they write their
// gradients (flash_bwd.cu, flash_bwd_sm90.cu, flash_bwd_f32.cu).
#pragma once
#include "common.cuh"

namespace cuflash {

// One slice's backward inputs: where its q, k, v and dO rows start, and its row statistics
// ((m, log2 l) pairs and D, rows padded to nq_pad) as the preprocess wrote them.
template <typename T>
struct BwdSlice {
    const T *q, *k, *v, *dout;
    const float *lse2, *delta;
};

template <typename T>
__device__ __forceinline__ BwdSlice<T> bwd_slice(const FwdParams& p, const BwdParams& b, i64 bidx) {
    const BatchOffsets off = batch_offsets(p, bidx);
    return {static_cast<const T*>(p.q) + off.q, static_cast<const T*>(p.k) + off.k,
            static_cast<const T*>(p.v) + off.v,
            static_cast<const T*>(b.dout) + lead_offset(p, bidx, b.do_lead_stride),
            b.lse2 + 2 * bidx * b.nq_pad, b.delta + bidx * b.nq_pad};
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
