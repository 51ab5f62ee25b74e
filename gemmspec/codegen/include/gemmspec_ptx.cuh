// gemmspec_ptx.cuh: gemmspec's own device header for Hopper (sm_90a).
//
// The kernel ABI's leaf table, plus thin wrappers over the PTX that the emitted
// kernels use: wgmma (warpgroup MMA reading both operands from shared memory
// through 64-bit matrix descriptors), its fences, and the async-proxy fence.
// Includes only CUDA toolkit headers so it compiles under NVRTC and nvcc alike.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

// ---------------------------------------------------------------------------
// Leaf table (docs/kernel-abi.md). Layout is fixed: 4 ints, then 15 long longs,
// 136 bytes, no padding. The host builds the same layout (numpy structured dtype).
// ---------------------------------------------------------------------------
struct GsLeaf {
  int m, n, k;                     // extents of this leaf's GEMM; any may be 0
  int tile_begin;                  // exclusive prefix sum of output tiles over leaves
  long long a_off, a_sm, a_sk;     // A(m, k) = A[a_off + m*a_sm + k*a_sk]      (elements)
  long long b_off, b_sn, b_sk;     // B(n, k) = B[b_off + n*b_sn + k*b_sk]
  long long d_off, d_sm, d_sn;     // D(m, n) = D[d_off + m*d_sm + n*d_sn]
  long long sa_off, sa_sm, sa_sk;  // SA[sa_off + (m/SA_BM)*sa_sm + (k/SA_BK)*sa_sk]
  long long sb_off, sb_sn, sb_sk;  // SB[sb_off + (n/SB_BN)*sb_sn + (k/SB_BK)*sb_sk]
};
static_assert(sizeof(GsLeaf) == 136, "GsLeaf layout must match the kernel ABI");

// ---------------------------------------------------------------------------
// Shared-memory addresses and wgmma matrix descriptors.
// ---------------------------------------------------------------------------
__device__ __forceinline__ unsigned gs_smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Swizzle modes of a wgmma descriptor (bits 62-63).
enum GsSwizzle : unsigned { GS_SWIZZLE_NONE = 0, GS_SWIZZLE_128B = 1, GS_SWIZZLE_64B = 2,
                            GS_SWIZZLE_32B = 3 };

// Fields: [0,14) start address >> 4, [16,30) leading-dim byte offset >> 4,
// [32,46) stride-dim byte offset >> 4, [49,52) base offset (0: atoms 1024B-aligned),
// [62,64) swizzle mode.
__device__ __forceinline__ unsigned long long gs_make_desc(unsigned smem_addr, unsigned lbo_bytes,
                                                           unsigned sbo_bytes, unsigned swizzle) {
  unsigned long long d = 0;
  d |= static_cast<unsigned long long>((smem_addr & 0x3FFFFu) >> 4);
  d |= static_cast<unsigned long long>((lbo_bytes >> 4) & 0x3FFFu) << 16;
  d |= static_cast<unsigned long long>((sbo_bytes >> 4) & 0x3FFFu) << 32;
  d |= static_cast<unsigned long long>(swizzle & 3u) << 62;
  return d;
}

// K-major operand in 128B-swizzled atoms: each row (M or N index) holds 128 bytes of K,
// 8 consecutive rows form one 1024-byte atom, atoms of the next 8 rows follow at +1024.
// LBO is unused in this mode (the instruction's K extent stays inside one 128B row).
__device__ __forceinline__ unsigned long long gs_desc_kmajor_sw128(unsigned smem_addr) {
  return gs_make_desc(smem_addr, 16u, 1024u, GS_SWIZZLE_128B);
}

// Byte offset (within a 128B swizzled row) where 16-byte chunk `chunk` of row `row` lives.
// The hardware applies the same XOR on address bits [4,7) ^= [7,10), so atoms must be
// 1024-byte aligned.
__device__ __forceinline__ unsigned gs_sw128_offset(unsigned row, unsigned chunk) {
  return row * 128u + ((chunk ^ (row & 7u)) << 4);
}

// ---------------------------------------------------------------------------
// Fences and wgmma group control.
// ---------------------------------------------------------------------------
// Orders this thread's generic-proxy shared-memory writes before later async-proxy
// reads (wgmma operands, TMA stores). Each writing thread issues it before the barrier.
__device__ __forceinline__ void gs_fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Must precede the first wgmma that reads registers or shared memory written before it.
__device__ __forceinline__ void gs_wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void gs_wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N committed wgmma groups are still in flight.
template <int N>
__device__ __forceinline__ void gs_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins a register so the compiler neither moves reads of an accumulator above the
// wgmma wait nor writes below the wgmma issue.
__device__ __forceinline__ void gs_fence_operand(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}

template <int N>
__device__ __forceinline__ void gs_fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) gs_fence_operand(r[i]);
}

// ---------------------------------------------------------------------------
// Element conversions for the epilogue.
// ---------------------------------------------------------------------------
template <typename T> struct GsCvt;
template <> struct GsCvt<float> {
  static __device__ __forceinline__ float to(float x) { return x; }
  static __device__ __forceinline__ float from(float x) { return x; }
};
template <> struct GsCvt<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 to(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ float from(__nv_bfloat16 x) { return __bfloat162float(x); }
};
template <> struct GsCvt<__half> {
  static __device__ __forceinline__ __half to(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float from(__half x) { return __half2float(x); }
};

// Two consecutive D elements, stored together when the address allows it.
template <typename T> struct GsPair;
template <> struct GsPair<float> { typedef float2 type; };
template <> struct GsPair<__nv_bfloat16> { typedef __nv_bfloat162 type; };
template <> struct GsPair<__half> { typedef __half2 type; };

// ---------------------------------------------------------------------------
// wgmma.mma_async, both operands from shared memory (descriptors), f32 accumulators.
// GsWgmma<N, A, B>::mma(d, desc_a, desc_b, scale_d) issues m64nNkK; scale_d == 0 makes
// D = A*B (fresh accumulator), otherwise D += A*B. 16-bit types use K-major A and B
// (transpose flags 0); FP8 has no transpose flags (K-major only).
// Thread t of the warpgroup holds rows 16*(t/32) + (t%32)/4 (+8) and columns
// 8j + 2*(t%4) (+1): d[4j] = (r, c), d[4j+1] = (r, c+1), d[4j+2] = (r+8, c), d[4j+3] = (r+8, c+1).
// ---------------------------------------------------------------------------
template <int N, typename TA, typename TB> struct GsWgmma;

#define GS_WGMMA_SS_N16(KDIM, ATY, BTY, CTA, CTB, IMM) \
  template <> struct GsWgmma<16, CTA, CTB> { \
    static constexpr int kK = KDIM; \
    static constexpr int kRegs = 8; \
    static __device__ __forceinline__ void mma(float (&d)[8], unsigned long long da, \
                                               unsigned long long db, int scale_d) { \
      asm volatile( \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n" \
          "wgmma.mma_async.sync.aligned.m64n16k" #KDIM ".f32." ATY "." BTY " {" \
          "%0, %1, %2, %3, %4, %5, %6, %7" \
          "}, %8, %9, p" IMM ";\n}\n" \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
          : "l"(da), "l"(db), "r"(scale_d) \
          : "memory"); \
    } \
  };

#define GS_WGMMA_SS_N32(KDIM, ATY, BTY, CTA, CTB, IMM) \
  template <> struct GsWgmma<32, CTA, CTB> { \
    static constexpr int kK = KDIM; \
    static constexpr int kRegs = 16; \
    static __device__ __forceinline__ void mma(float (&d)[16], unsigned long long da, \
                                               unsigned long long db, int scale_d) { \
      asm volatile( \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
          "wgmma.mma_async.sync.aligned.m64n32k" #KDIM ".f32." ATY "." BTY " {" \
          "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
          "}, %16, %17, p" IMM ";\n}\n" \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
          : "l"(da), "l"(db), "r"(scale_d) \
          : "memory"); \
    } \
  };

#define GS_WGMMA_SS_N64(KDIM, ATY, BTY, CTA, CTB, IMM) \
  template <> struct GsWgmma<64, CTA, CTB> { \
    static constexpr int kK = KDIM; \
    static constexpr int kRegs = 32; \
    static __device__ __forceinline__ void mma(float (&d)[32], unsigned long long da, \
                                               unsigned long long db, int scale_d) { \
      asm volatile( \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
          "wgmma.mma_async.sync.aligned.m64n64k" #KDIM ".f32." ATY "." BTY " {" \
          "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
          "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
          "}, %32, %33, p" IMM ";\n}\n" \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
            "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
            "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
          : "l"(da), "l"(db), "r"(scale_d) \
          : "memory"); \
    } \
  };

#define GS_WGMMA_SS_N128(KDIM, ATY, BTY, CTA, CTB, IMM) \
  template <> struct GsWgmma<128, CTA, CTB> { \
    static constexpr int kK = KDIM; \
    static constexpr int kRegs = 64; \
    static __device__ __forceinline__ void mma(float (&d)[64], unsigned long long da, \
                                               unsigned long long db, int scale_d) { \
      asm volatile( \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
          "wgmma.mma_async.sync.aligned.m64n128k" #KDIM ".f32." ATY "." BTY " {" \
          "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
          "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
          "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
          "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
          "}, %64, %65, p" IMM ";\n}\n" \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
            "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
            "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
            "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
            "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
            "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
            "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
          : "l"(da), "l"(db), "r"(scale_d) \
          : "memory"); \
    } \
  };

#define GS_WGMMA_SS_N256(KDIM, ATY, BTY, CTA, CTB, IMM) \
  template <> struct GsWgmma<256, CTA, CTB> { \
    static constexpr int kK = KDIM; \
    static constexpr int kRegs = 128; \
    static __device__ __forceinline__ void mma(float (&d)[128], unsigned long long da, \
                                               unsigned long long db, int scale_d) { \
      asm volatile( \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
          "wgmma.mma_async.sync.aligned.m64n256k" #KDIM ".f32." ATY "." BTY " {" \
          "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
          "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
          "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
          "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
          "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
          "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
          "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
          "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
          "}, %128, %129, p" IMM ";\n}\n" \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
            "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
            "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
            "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
            "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
            "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
            "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
            "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
            "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
            "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
            "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
            "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
            "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
            "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
            "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
          : "l"(da), "l"(db), "r"(scale_d) \
          : "memory"); \
    } \
  };

#define GS_WGMMA_SS_ALL_N(KDIM, ATY, BTY, CTA, CTB, IMM) \
  GS_WGMMA_SS_N16(KDIM, ATY, BTY, CTA, CTB, IMM)         \
  GS_WGMMA_SS_N32(KDIM, ATY, BTY, CTA, CTB, IMM)         \
  GS_WGMMA_SS_N64(KDIM, ATY, BTY, CTA, CTB, IMM)         \
  GS_WGMMA_SS_N128(KDIM, ATY, BTY, CTA, CTB, IMM)        \
  GS_WGMMA_SS_N256(KDIM, ATY, BTY, CTA, CTB, IMM)

// FP8: trailing immediates are imm-scale-a, imm-scale-b (1 = no negation).
GS_WGMMA_SS_ALL_N(32, "e4m3", "e4m3", __nv_fp8_e4m3, __nv_fp8_e4m3, ", 1, 1")
GS_WGMMA_SS_ALL_N(32, "e4m3", "e5m2", __nv_fp8_e4m3, __nv_fp8_e5m2, ", 1, 1")
GS_WGMMA_SS_ALL_N(32, "e5m2", "e4m3", __nv_fp8_e5m2, __nv_fp8_e4m3, ", 1, 1")
GS_WGMMA_SS_ALL_N(32, "e5m2", "e5m2", __nv_fp8_e5m2, __nv_fp8_e5m2, ", 1, 1")
// 16-bit: imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b (0 = K-major).
GS_WGMMA_SS_ALL_N(16, "bf16", "bf16", __nv_bfloat16, __nv_bfloat16, ", 1, 1, 0, 0")
GS_WGMMA_SS_ALL_N(16, "f16", "f16", __half, __half, ", 1, 1, 0, 0")

#undef GS_WGMMA_SS_ALL_N
#undef GS_WGMMA_SS_N16
#undef GS_WGMMA_SS_N32
#undef GS_WGMMA_SS_N64
#undef GS_WGMMA_SS_N128
#undef GS_WGMMA_SS_N256
