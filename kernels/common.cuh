// common.cuh: the parameter block every cuflash kernel receives, batch/head offset arithmetic,
// and thin wrappers over the PTX instructions the tensor-core kernels use (cp.async, ldmatrix,
// mma.sync, ex2). No CUDA headers are included: NVRTC then needs no include path, and the same
// source compiles without a GPU or a toolkit on the machine.
#pragma once

namespace cuflash {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// Element-type tags. Storage is raw 16-bit; arithmetic happens in fp32 or on the tensor cores.
struct bf16 { u16 bits; };
struct fp16 { u16 bits; };

// The numbers the kernels share with Python are fixed in cuflash/_constants.py (the Hopper CTA
// shapes in cuflash/_variants.py) and arrive as -D defines (_variants.kernel_defines(),
// _loader.base_options()); each is named here once.
constexpr int kMaxLead = CUFLASH_MAX_LEAD;  // leading (batch) dims after Python has merged what it can

// offsetof, for the checks of the parameter blocks against Python's packing: NVRTC has no
// <cstddef> without an include path, so it is spelled with the front end's __INTADDR__ (the
// integer value of an address constant), which NVRTC 12.9 and 13.5 take in a static_assert.
#define CUFLASH_OFFSETOF(type, member) __INTADDR__(&((type*)0)->member)

// Each member of a parameter block at the word cuflash/_params.py packs it in: a define from
// _variants.kernel_defines() lists CUFLASH_PARAM_WORD(name, word) for every member of a block,
// expanded where CUFLASH_PARAM_BLOCK names the struct (#define, the list, #undef).
#define CUFLASH_STRINGIFY(x) CUFLASH_STRINGIFY_(x)
#define CUFLASH_STRINGIFY_(x) #x
#define CUFLASH_PARAM_WORD(name, word)                                                    \
    static_assert(CUFLASH_OFFSETOF(CUFLASH_PARAM_BLOCK, name) == 8 * (word),              \
                  CUFLASH_STRINGIFY(CUFLASH_PARAM_BLOCK) "::" #name " against cuflash/_params.py");

// Every member is 8 bytes wide so the Python side can pack it with struct.pack('<...q/d')
// without caring about padding rules; cuflash/_params.py lays it out (FWD_PARAM_FIELDS), and the
// static_asserts after BwdParams hold the two in step.
struct FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;        // (..., nq, dv) contiguous, same dtype as q
    float* l;       // (..., nq) contiguous
    float* m;       // (..., nq) contiguous
    i64 nq, nk, d, dv;
    i64 num_batch;                 // product of lead_shape
    i64 lead_shape[kMaxLead];      // output leading dims, outermost first, padded with 1s in front
    i64 q_lead_stride[kMaxLead];   // element strides; 0 where the input is broadcast
    i64 k_lead_stride[kMaxLead];
    i64 v_lead_stride[kMaxLead];
    i64 q_row_stride, k_row_stride, v_row_stride;
    i64 kv_group;                  // q heads per k/v head along the last leading dim (GQA), else 1
    double scale;                  // S = scale * q k^T
    double scale_log2;             // scale * log2(e): softmax runs on exp2
    // Sliding window, aligned at the bottom right like causal: query i sees key j when
    // i + (nk - nq) - window_left <= j <= i + (nk - nq) + window_right; -1 = unbounded side.
    i64 window_left, window_right;
    // Block sparsity (null tile_counts = dense). For each (mask batch, tile this kernel walks
    // over its grid) a list of the tiles it visits on the other axis, ascending, in units of
    // this launch's tile sizes: tile_counts[mb * n_outer + t] entries at
    // tile_lists[(mb * n_outer + t) * list_stride ...]. An entry with kPartialTile set also
    // needs the element-wise lookup in `blocks` (the (mask_tq, mask_tk) bytes of the user's
    // block mask, block_q x block_k elements each), because it straddles blocks that differ.
    const int* tile_counts;
    const int* tile_lists;
    const unsigned char* blocks;
    i64 n_outer, list_stride;
    i64 block_q, block_k, mask_tq, mask_tk;
    i64 mask_lead_stride[kMaxLead];  // mask-batch strides over the output's leading dims, 0 = broadcast
    // Packed variable-length batches (varlen; null cu_seqlens_q = dense). Sequence s owns the
    // packed rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) of q, o, l, m and [cu_seqlens_k[s],
    // cu_seqlens_k[s + 1]) of k and v; nq and nk are then the packed totals, into which every
    // boundary is clamped (slice.cuh). The leading dim is the heads alone, and the flat index
    // is sequence-major: num_batch = num_seqs * heads. Appended last, so that no dense field
    // moves.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    i64 num_seqs;
    i64 varlen_tiles;  // a persistent varlen forward: the query tiles its items span (else 0)
};

constexpr int kPartialTile = CUFLASH_PARTIAL_TILE;  // flag bit of a tile_lists entry
static_assert(kPartialTile > 0 && (kPartialTile & (kPartialTile - 1)) == 0, "the partial-tile flag is one bit");
// Rows of the backward's per-row statistics (BwdParams::lse2, delta) are padded to a multiple
// of this, so that a kernel reading them a whole query tile at a time needs its tile to divide it.
constexpr int kStatsRowMultiple = CUFLASH_STATS_ROW_MULTIPLE;

// Extra tensors of the backward pass. Their leading dims are the output's (FwdParams::lead_shape).
struct BwdParams {
    const void* dout;  // dO, (..., nq, dv), strided like o
    const void* out;   // O (read by the preprocess only)
    const float* l;    // (num_batch, nq) contiguous, from the forward
    const float* m;
    float* lse2;       // (num_batch, nq_pad, 2): (m, log2 l) per row, (+inf, 0) without keys
    float* delta;      // (num_batch, nq_pad): rowsum(dO * O)
    float* dq_acc;     // (num_batch, nq, d) fp32; zeroed first when dQ is accumulated atomically
    float* dk_acc;     // (num_batch, nk, d): fp32, or the input dtype when dkv_in_dtype
    float* dv_acc;     // (num_batch, nk, dv): likewise
    i64 nq_pad;        // a multiple of every query tile, so statistics tiles never read past it
    i64 do_lead_stride[kMaxLead];
    i64 o_lead_stride[kMaxLead];
    i64 do_row_stride, o_row_stride;
    i64 dkv_in_dtype;  // 1: k/v are not broadcast, so dK/dV are final and stored as T directly
    i64 zero_dq_acc;   // 1: the preprocess zeroes each slice's rows of dq_acc (dense, atomic dQ)
    // Query heads one wgmma key-pass CTA walks (flash_bwd_sm90.cu): G > 1 sums dK and dV over G
    // consecutive heads of a k/v group in registers, its grid then spans num_batch / G slices; 1
    // elsewhere (every other kernel reads it as 1).
    i64 head_group;
};

// The blocks as cuflash/_params.py lays them out (FWD_PARAM_FIELDS, BWD_PARAM_FIELDS: each
// member's word, their sizes and the words a call writes): a member renamed, moved, added or
// dropped on one side only fails every build here.
#define CUFLASH_PARAM_BLOCK FwdParams
CUFLASH_FWD_PARAM_WORDS
#undef CUFLASH_PARAM_BLOCK
#define CUFLASH_PARAM_BLOCK BwdParams
CUFLASH_BWD_PARAM_WORDS
#undef CUFLASH_PARAM_BLOCK
static_assert(sizeof(FwdParams) == CUFLASH_FWD_PARAM_BYTES, "FwdParams against _params.FWD_PARAM_FORMAT");
static_assert(CUFLASH_OFFSETOF(FwdParams, nq) == 8 * CUFLASH_FWD_POINTER_WORDS,
              "q .. m, the pointers a call writes, are the first words");
static_assert(CUFLASH_OFFSETOF(FwdParams, cu_seqlens_q) == 8 * CUFLASH_CU_SEQLENS_WORD &&
                  CUFLASH_OFFSETOF(FwdParams, cu_seqlens_k) == 8 * CUFLASH_CU_SEQLENS_WORD + 8,
              "the two words a varlen call writes (_params.CU_SEQLENS_WORD)");
static_assert(sizeof(BwdParams) == CUFLASH_BWD_PARAM_BYTES, "BwdParams against _params.BWD_PARAM_FORMAT");
static_assert(CUFLASH_OFFSETOF(BwdParams, nq_pad) == 8 * CUFLASH_BWD_POINTER_WORDS,
              "dout .. dv_acc, the pointers a call writes, are the first words");

// Offset of one (batch..., head) slice of a tensor laid out over the output's leading dims.
__device__ __forceinline__ i64 lead_offset(const FwdParams& p, i64 flat, const i64 (&stride)[kMaxLead]) {
    i64 off = 0;
#pragma unroll
    for (int i = kMaxLead - 1; i >= 0; --i) {
        off += (flat % p.lead_shape[i]) * stride[i];
        flat /= p.lead_shape[i];
    }
    return off;
}

// Offsets of one (batch..., head) slice in q, k and v. GQA divides the last coordinate for k/v.
struct BatchOffsets { i64 q, k, v; };

__device__ __forceinline__ BatchOffsets batch_offsets(const FwdParams& p, i64 flat) {
    BatchOffsets off = {0, 0, 0};
#pragma unroll
    for (int i = kMaxLead - 1; i >= 0; --i) {
        const i64 c = flat % p.lead_shape[i];
        flat /= p.lead_shape[i];
        const i64 ckv = (i == kMaxLead - 1) ? c / p.kv_group : c;
        off.q += c * p.q_lead_stride[i];
        off.k += ckv * p.k_lead_stride[i];
        off.v += ckv * p.v_lead_stride[i];
    }
    return off;
}

// The flat (batch..., head) index of this CTA: grid.y * grid.z covers num_batch (y alone is
// limited to 65535).
__device__ __forceinline__ i64 flat_batch_index() {
    return (i64)blockIdx.z * gridDim.y + blockIdx.y;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

constexpr float kLog2e = 1.4426950408889634f;  // 1 / ln(2)

// Accumulators to 0: an m16n8 tile's four values per (row tile, column tile), or a float32
// kernel's per (row, column slice).
template <int ROWS, int COLS>
__device__ __forceinline__ void zero(float (&acc)[ROWS][COLS]) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int j = 0; j < COLS; ++j) acc[i][j] = 0.f;
}
template <int MT, int NT, int E>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][E]) {
#pragma unroll
    for (int i = 0; i < MT; ++i) zero(acc[i]);
}

// Python sizes every launch's dynamic shared memory from the same layout the kernel uses;
// a kernel calls this first, so that if the two ever drift it fails loudly instead of
// reading past its allocation.
__device__ __forceinline__ void require_dynamic_smem(u32 bytes) {
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < bytes) __trap();
}

// 2^x on the SFU. ftz is harmless here: arguments are <= 0 and results below 2^-126 are
// negligible next to the row's largest term, which is exactly 1.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// P of one score in the backward, from the forward's row statistics m (scaled max) and log2 l:
// exp(scale * s - m) / l. The product is rounded on its own, exactly as the forward rounded the
// row's maximum into m, so the largest score of a row gives exp2(0 - log2 l) exactly even when
// scale * s is ~1e4, where one fused multiply-add against a pre-scaled m would be off by
// ~1e-3 in the exponent.
__device__ __forceinline__ float recompute_p(float s, float scale, float m, float log2l) {
    return fast_exp2((__fmul_rn(s, scale) - m) * kLog2e - log2l);
}

// ---- conversions -------------------------------------------------------------------------
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 pack2<fp16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The two 16-bit values of a pack2 result, back in fp32 (lo first).
template <typename T> __device__ __forceinline__ float2 unpack2(u32 x);
template <> __device__ __forceinline__ float2 unpack2<bf16>(u32 x) {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 unpack2<fp16>(u32 x) {
    float lo, hi;
    asm("{\n\t.reg .f16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
        : "=f"(lo), "=f"(hi) : "r"(x));
    return make_float2(lo, hi);
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<bf16>(bf16 x) {
    return __uint_as_float(((u32)x.bits) << 16);
}
template <> __device__ __forceinline__ float to_float<fp16>(fp16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }

// ---- asynchronous copies -----------------------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16-byte global->shared copy; when `valid` is false the destination is zero-filled and the
// source is not read (src-size 0), which is how ragged tile edges and padded head dims become 0.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- ldmatrix / mma ----------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// D += A * B for one m16n8k16 tile, fp32 accumulation; TYPE is the PTX name of T.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
#define CUFLASH_DEFINE_MMA_16816(TYPE_TAG, TYPE)                                                    \
    template <>                                                                                      \
    __device__ __forceinline__ void mma_16816<TYPE_TAG>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) { \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                  \
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                        \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                \
    }
CUFLASH_DEFINE_MMA_16816(bf16, "bf16")
CUFLASH_DEFINE_MMA_16816(fp16, "f16")
#undef CUFLASH_DEFINE_MMA_16816

}  // namespace cuflash
