// bwd_common.cuh: how the backward kernels write their gradients (flash_bwd.cu and
// flash_bwd_sm90.cu).
#pragma once
#include "common.cuh"

namespace cuflash {

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
