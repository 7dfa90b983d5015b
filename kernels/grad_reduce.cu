// grad_reduce.cu: the last step of the backward for gradients accumulated in float32.
//
// dQ is summed over key tiles with float atomics, and dK / dV of grouped (GQA) heads arrive
// per query head; this kernel sums `groups` consecutive slices of such an accumulator and
// stores the sum in the input dtype. groups == 1 is the plain float32 -> 16-bit conversion.
// One pass over the accumulator: 16-byte loads, 8-byte stores (4 elements a thread a step).
#include "common.cuh"

namespace cuflash {

struct GradReduceParams {
    const float* src;  // (outer, groups, inner) float32, contiguous
    void* dst;         // (outer, inner) in T, contiguous
    i64 groups;
    i64 inner;         // elements of one slice: a multiple of 4 (head dims are multiples of 8)
    i64 outer;
};
// As cuflash/_params.py lays it out (REDUCE_PARAM_FIELDS), member by member (common.cuh).
#define CUFLASH_PARAM_BLOCK GradReduceParams
CUFLASH_REDUCE_PARAM_WORDS
#undef CUFLASH_PARAM_BLOCK
static_assert(sizeof(GradReduceParams) == CUFLASH_REDUCE_PARAM_BYTES, "against _params.REDUCE_PARAM_FORMAT");
static_assert(CUFLASH_OFFSETOF(GradReduceParams, groups) == 8 * CUFLASH_REDUCE_POINTER_WORDS,
              "src, dst, the pointers a call writes, are the first words");

template <typename T> __device__ __forceinline__ void store4(void* dst, i64 i, float4 x);
template <> __device__ __forceinline__ void store4<bf16>(void* dst, i64 i, float4 x) {
    *reinterpret_cast<uint2*>(reinterpret_cast<u16*>(dst) + i) = make_uint2(pack2<bf16>(x.x, x.y), pack2<bf16>(x.z, x.w));
}
template <> __device__ __forceinline__ void store4<fp16>(void* dst, i64 i, float4 x) {
    *reinterpret_cast<uint2*>(reinterpret_cast<u16*>(dst) + i) = make_uint2(pack2<fp16>(x.x, x.y), pack2<fp16>(x.z, x.w));
}
template <> __device__ __forceinline__ void store4<float>(void* dst, i64 i, float4 x) {
    *reinterpret_cast<float4*>(reinterpret_cast<float*>(dst) + i) = x;
}

// One variant: a parameter for each field of cuflash/_variants.py's GradientReduce.
template <typename dtype, int warps>
struct GradReduceTraits {
    using T = dtype;
    static constexpr int WARPS = warps;
};

template <class K>
__global__ void __launch_bounds__(32 * K::WARPS) grad_reduce_kernel(const GradReduceParams p) {
    using T = typename K::T;
    const i64 total = p.outer * p.inner;
    const i64 step = 4 * static_cast<i64>(gridDim.x) * blockDim.x;
    for (i64 i = 4 * (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x); i < total; i += step) {
        const i64 slice = i / p.inner, col = i - slice * p.inner;
        const float* src = p.src + slice * p.groups * p.inner + col;
        float4 sum = *reinterpret_cast<const float4*>(src);
        for (i64 g = 1; g < p.groups; ++g) {
            const float4 x = *reinterpret_cast<const float4*>(src + g * p.inner);
            sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
        }
        store4<T>(p.dst, i, sum);
    }
}

}  // namespace cuflash
