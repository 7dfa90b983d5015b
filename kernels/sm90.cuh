// sm90.cuh: Hopper's warpgroup matrix multiply (wgmma), mbarriers and register reallocation,
// as thin inline-PTX wrappers. Everything here needs the sm_90a target; only
// flash_fwd_sm90.cu includes it.
//
// Shared-memory operands use the 128-byte swizzle: a tile is stored as column blocks of 64
// 16-bit elements (128 bytes a row), each block [rows][64] with the 16-byte unit u of row r at
// unit u ^ (r % 8). Blocks start on 1024-byte boundaries, so the swizzle pattern is aligned
// and the descriptors' base offset is 0.
#pragma once
#include "common.cuh"

namespace cuflash {
namespace sm90 {

constexpr int kSwizzleRowBytes = 128;  // one row of a 64-element column block
constexpr int kSwizzleCols = 64;

// Byte offset of the 16-byte unit holding columns [8u, 8u + 8) of row r in a swizzled tile of
// ROWS rows: column block u / 8, then the row, then the unit permuted within the row.
template <int ROWS>
__device__ __forceinline__ u32 swizzled_offset(int r, int u) {
    return (u32)((u / 8) * ROWS * kSwizzleRowBytes + r * kSwizzleRowBytes + (((u % 8) ^ (r % 8)) * 16));
}

// Copies rows [row0, row0 + ROWS) and columns [0, COLS) of a row-major global matrix into a
// swizzled tile with 16-byte cp.async, NT threads (thread index tid) sharing the work. Rows
// at or past nrows and columns at or past ncols are zero-filled, never read.
// NT is a multiple of the row's 16-byte units, so a thread copies one fixed unit u of every
// STEP-th row; STEP is a multiple of 8, so the unit's swizzled position is the same in all
// its rows and both addresses just advance. The loop stays rolled: the producer warpgroup
// runs it with 40 registers a thread.
template <int ROWS, int COLS, int NT, typename T>
__device__ __forceinline__ void load_tile_swizzled(u32 smem, const T* gmem, i64 row_stride, i64 row0,
                                                   i64 nrows, i64 ncols, int tid) {
    if constexpr (COLS > NT) {  // wider than NT / 8 units: in halves of whole column blocks
        constexpr int HALF = COLS / 2, HALF_OFFSET = HALF / kSwizzleCols * ROWS * kSwizzleRowBytes;
        load_tile_swizzled<ROWS, HALF, NT>(smem, gmem, row_stride, row0, nrows, ncols, tid);
        load_tile_swizzled<ROWS, HALF, NT>(smem + HALF_OFFSET, gmem + HALF, row_stride, row0, nrows, ncols - HALF, tid);
    } else {
        constexpr int UNITS = COLS / 8;
        constexpr int STEP = NT / UNITS;
        static_assert(NT % UNITS == 0 && STEP % 8 == 0 && ROWS % STEP == 0, "fixed unit per thread");
        const int r = tid / UNITS, u = tid % UNITS;
        const T* src = gmem + (row0 + r) * row_stride + u * 8;
        u32 dst = smem + swizzled_offset<ROWS>(r, u);
        const i64 rows_left = nrows - row0 - r;
        const bool col_ok = u * 8 < ncols;
#pragma unroll 1
        for (int it = 0; it < ROWS / STEP; ++it) {
            const bool valid = col_ok && it * STEP < rows_left;
            cp_async_16(dst, valid ? src : gmem, valid);
            src += STEP * row_stride;
            dst += STEP * kSwizzleRowBytes;
        }
    }
}

// ---- matrix descriptors ----------------------------------------------------------------
// Bits 0-13: start address >> 4; 16-29: leading byte offset >> 4; 32-45: stride byte offset
// >> 4; 62-63: layout (1 = 128-byte swizzle).
__device__ __forceinline__ unsigned long long descriptor(u32 addr, u32 leading, u32 stride) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(leading >> 4) << 16) |
           ((unsigned long long)(stride >> 4) << 32) | (1ull << 62);
}

// An operand stored K-major (the reduction dim contiguous: Q and K of S = Q K^T), rows from
// `row` on, reduction columns [16 kk, 16 kk + 16). Eight-row groups are 1024 bytes apart; the
// leading offset is unused with this swizzle. Inside a column block the start moves by 32
// bytes per 16 columns.
//
// The step from the descriptor of column 0 is added to the descriptor itself, a constant for
// an unrolled kk: the start field holds address >> 4 and a shared-memory address stays under
// 2^18, so the sum never carries out of it. (Encoding each step's descriptor from its address
// cost ten instructions a wgmma, a third of the backward's loop.)
template <int ROWS>
__device__ __forceinline__ unsigned long long kmajor_desc(u32 tile, int row, int kk) {
    return descriptor(tile + row * kSwizzleRowBytes, 16, 1024) +
           (u32)(((kk / 4) * ROWS * kSwizzleRowBytes + (kk % 4) * 32) >> 4);
}

// An operand stored MN-major (the output dim contiguous: V of O += P V, whose reduction dim
// is the key): keys [16 kk, 16 kk + 16) of a tile of ROWS keys. Eight keys are 1024 bytes
// apart (stride offset); 64-wide column blocks are ROWS rows apart (leading offset).
template <int ROWS>
__device__ __forceinline__ unsigned long long mnmajor_desc(u32 tile, int kk) {
    return descriptor(tile, ROWS * kSwizzleRowBytes, 1024) + (u32)((kk * 16 * kSwizzleRowBytes) >> 4);
}

// ---- wgmma -------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Pins an accumulator's registers at this point of the program: the compiler may neither
// read them before the wgmma that writes them has been waited for, nor move the wait.
template <int NT>
__device__ __forceinline__ void fence_operand(float (&d)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e])::"memory");
}

#define CUFLASH_ACC8(d, n)                                                                  \
    "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3]), "+f"(d[n + 1][0]),          \
        "+f"(d[n + 1][1]), "+f"(d[n + 1][2]), "+f"(d[n + 1][3])
#define CUFLASH_ACC32(d, n) CUFLASH_ACC8(d, n), CUFLASH_ACC8(d, n + 2), CUFLASH_ACC8(d, n + 4), CUFLASH_ACC8(d, n + 6)

#define CUFLASH_REGS32                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUFLASH_REGS64                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
    "%56, %57, %58, %59, %60, %61, %62, %63}"

#define CUFLASH_REGS128                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, " \
    "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, " \
    "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, " \
    "%120, %121, %122, %123, %124, %125, %126, %127}"

// D (64 x N, fp32, the mma.sync accumulator layout repeated: d[n][e] is row 16*warp + lane/4
// + 8*(e/2), column 8n + 2*(lane%4) + e%2) {=, +=} A B for one k-step of 16. SS: A and B from
// shared memory, both K-major. RS: A from registers in the m16n8k16 A-fragment layout (which
// is how P leaves the softmax), B from shared memory MN-major. `accumulate` = 0 overwrites D.
// REGS names the accumulators; A0.. name the operands after them (%32.. for N = 64, %64..
// for N = 128, %128.. for the RS form's N = 256, P V at head dim 256); TRANS is the SS
// form's "trans-a, trans-b" (1 = MN-major).
#define CUFLASH_WGMMA_SS_T(N, TYPE, REGS, ACC, A0, A1, A2, TRANS)                           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " A2 ", 0;\n"                             \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS     \
                 ", " A0 ", " A1 ", p, 1, 1, " TRANS ";\n}\n"                                \
                 : ACC : "l"(a_desc), "l"(b_desc), "r"(accumulate))
#define CUFLASH_WGMMA_RS(N, TYPE, REGS, ACC, A0, A1, A2, A3, A4, A5)                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " A5 ", 0;\n"                             \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS     \
                 ", {" A0 ", " A1 ", " A2 ", " A3 "}, " A4 ", p, 1, 1, 1;\n}\n"              \
                 : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate))

template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], unsigned long long a_desc,
                                         unsigned long long b_desc, int accumulate);
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const u32 (&a)[4], unsigned long long b_desc,
                                         int accumulate);
// SS with both operands MN-major (A stored [k][m], B stored [k][n]); N = 64 only.
template <typename T>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[8][4], unsigned long long a_desc, unsigned long long b_desc,
                                            int accumulate);

#define CUFLASH_DEFINE_WGMMA(TYPE_TAG, TYPE)                                                   \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_ss<TYPE_TAG, 64>(float (&d)[8][4], unsigned long long a_desc, \
                                                           unsigned long long b_desc, int accumulate) { \
        CUFLASH_WGMMA_SS_T(64, TYPE, CUFLASH_REGS32, CUFLASH_ACC32(d, 0), "%32", "%33", "%34", "0, 0"); \
    }                                                                                           \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_ss<TYPE_TAG, 128>(float (&d)[16][4], unsigned long long a_desc, \
                                                            unsigned long long b_desc, int accumulate) { \
        CUFLASH_WGMMA_SS_T(128, TYPE, CUFLASH_REGS64, CUFLASH_ACC32(d, 0) COMMA CUFLASH_ACC32(d, 8), \
                           "%64", "%65", "%66", "0, 0");                                        \
    }                                                                                           \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_ss_mn<TYPE_TAG>(float (&d)[8][4], unsigned long long a_desc, \
                                                          unsigned long long b_desc, int accumulate) { \
        CUFLASH_WGMMA_SS_T(64, TYPE, CUFLASH_REGS32, CUFLASH_ACC32(d, 0), "%32", "%33", "%34", "1, 1"); \
    }                                                                                           \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_rs<TYPE_TAG, 64>(float (&d)[8][4], const u32 (&a)[4], \
                                                           unsigned long long b_desc, int accumulate) { \
        CUFLASH_WGMMA_RS(64, TYPE, CUFLASH_REGS32, CUFLASH_ACC32(d, 0), "%32", "%33", "%34", "%35", \
                         "%36", "%37");                                                         \
    }                                                                                           \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_rs<TYPE_TAG, 128>(float (&d)[16][4], const u32 (&a)[4], \
                                                            unsigned long long b_desc, int accumulate) { \
        CUFLASH_WGMMA_RS(128, TYPE, CUFLASH_REGS64, CUFLASH_ACC32(d, 0) COMMA CUFLASH_ACC32(d, 8), \
                         "%64", "%65", "%66", "%67", "%68", "%69");                             \
    }                                                                                           \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_rs<TYPE_TAG, 256>(float (&d)[32][4], const u32 (&a)[4], \
                                                            unsigned long long b_desc, int accumulate) { \
        CUFLASH_WGMMA_RS(256, TYPE, CUFLASH_REGS128,                                            \
                         CUFLASH_ACC32(d, 0) COMMA CUFLASH_ACC32(d, 8) COMMA CUFLASH_ACC32(d, 16) \
                             COMMA CUFLASH_ACC32(d, 24),                                        \
                         "%128", "%129", "%130", "%131", "%132", "%133");                       \
    }

#define COMMA ,
CUFLASH_DEFINE_WGMMA(bf16, "bf16")
CUFLASH_DEFINE_WGMMA(fp16, "f16")
#undef COMMA
#undef CUFLASH_DEFINE_WGMMA
#undef CUFLASH_WGMMA_SS_T
#undef CUFLASH_WGMMA_RS
#undef CUFLASH_REGS32
#undef CUFLASH_REGS64
#undef CUFLASH_REGS128
#undef CUFLASH_ACC32
#undef CUFLASH_ACC8

// ---- mbarriers ---------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Blocks until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// Arrives on the barrier once every cp.async this thread has issued so far has landed,
// without waiting for them here (the barrier's count includes this arrival: noinc).
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Makes initialised barriers visible to the async proxy (the copy engine completes on them).
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arms the barrier for `bytes` of bulk copies and arrives once (the producer thread that
// issues them); the phase completes when the arrival count and the bytes are both in.
__device__ __forceinline__ void mbarrier_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// ---- bulk reductions ---------------------------------------------------------------------
// Adds `bytes` (a multiple of 16) of float32 from shared memory into global memory, element by
// element, on the copy engine; the operation completes in this thread's current bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's bulk groups are still reading their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// Until at most N of this thread's bulk groups are incomplete (their writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---- bulk tensor copies (TMA) ------------------------------------------------------------
// A CUtensorMap as the driver encodes it (cuflash/_tma.py): 128 opaque bytes.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};
// The maps of q, k and v for one forward launch, as (head dim, rows, slices) tensors, and the
// slice stride of each in elements: a (batch..., head) slice at element offset `off` is slice
// off / stride. Passed by value as a __grid_constant__ parameter.
struct alignas(64) Sm90Maps {
    TensorMap q, k, v;
    i64 q_slice, k_slice, v_slice;
};
static_assert(sizeof(Sm90Maps) == CUFLASH_SM90_MAPS_BYTES, "the parameter block cuflash/_tma.py packs");
// The backward's: q and dO read in query tiles, k and v in key tiles, and their slice strides.
struct alignas(64) Bwd90Maps {
    TensorMap q, k, v, dout;
    i64 q_slice, k_slice, v_slice, do_slice;
};
static_assert(sizeof(Bwd90Maps) == CUFLASH_SM90_BWD_MAPS_BYTES, "the parameter block cuflash/_tma.py packs");

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared
// memory on the copy engine, completing on `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Copies the box at (x, y, z) of a 3-D tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}

// Rows [row0, row0 + ROWS) of slice z, all COLS columns, as the swizzled tile the kernels use:
// one 64-column box per column block (the map's 128-byte swizzle writes the same layout
// swizzled_offset describes).
template <int ROWS, int COLS>
__device__ __forceinline__ void tma_load_tile(u32 smem, const TensorMap* map, int row0, int z, u32 bar) {
#pragma unroll
    for (int b = 0; b < COLS / kSwizzleCols; ++b)
        tma_load_3d(smem + b * ROWS * kSwizzleRowBytes, map, b * kSwizzleCols, row0, z, bar);
}

// ---- warpgroups --------------------------------------------------------------------------

// tid / 128, broadcast from lane 0: the same value, but one the compiler knows to be the same
// in every lane of a warp, so branches on it are not divergent. Without it ptxas serialized
// wgmma on some of the backward's warpgroup branches (C7514-C7520) and spilled more registers
// (bench/NOTES.md, Backward on Hopper (key pass)).
__device__ __forceinline__ int uniform_warpgroup(int tid) {
    return __shfl_sync(0xffffffffu, tid / 128, 0);
}

// ---- named barriers ----------------------------------------------------------------------
// Barrier 0 is __syncthreads; the kernels number theirs from 1.

// bar.sync on a barrier chosen at run time, among 128 threads (one warpgroup): no branch on it.
__device__ __forceinline__ void named_barrier_sync_128(int id) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
template <int ID, int THREADS>
__device__ __forceinline__ void named_barrier_sync() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(THREADS) : "memory");
}
template <int ID, int THREADS>
__device__ __forceinline__ void named_barrier_arrive() {
    asm volatile("bar.arrive %0, %1;\n" ::"n"(ID), "n"(THREADS) : "memory");
}

// Shared memory written through the generic proxy (cp.async, st.shared) that wgmma reads next
// must be fenced against the async proxy. The kernels fence in the reading threads, after the
// mbarrier wait that made the writes visible to them.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Register reallocation between warpgroups (needs the kernel's register cap at entry, from
// __launch_bounds__(threads, 1)): producers give theirs to the consumers.
template <int N> __device__ __forceinline__ void release_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void claim_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace sm90
}  // namespace cuflash
