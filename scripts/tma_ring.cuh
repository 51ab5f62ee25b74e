// What the TMA streaming microbenchmarks (tma_stream_floor.cu, decode_stream_floor.cu)
// share: a CUDA error check, mbarrier and 2-D TMA load wrappers, the driver's tensor map
// encoder fetched through the runtime (no link against libcuda), and the back-to-back
// timing of a launch. Loads with an L2 eviction policy are the kernels' own
// (gs_tma_load_2d_hint, gs_policy_* in gemmspec's device header).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include "../gemmspec/codegen/include/gemmspec_ptx.cuh"
#include <cstdio>
#include <cstdlib>

#define CK(x) do { auto e = (x); if (e != 0) { printf("err %d line %d\n", (int)e, __LINE__); exit(1); } } while (0)

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned b, unsigned n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(n)); }
__device__ __forceinline__ void mbar_expect(unsigned b, unsigned bytes) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory"); }
__device__ __forceinline__ void mbar_arrive(unsigned b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory"); }
__device__ __forceinline__ void mbar_wait(unsigned b, unsigned ph) {
  unsigned done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0,1,0,p;\n}\n" : "=r"(done) : "r"(b), "r"(ph) : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma2d(unsigned dst, const CUtensorMap* m, unsigned bar, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               ::"r"(dst), "l"((unsigned long long)m), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

typedef CUresult (*EncodeFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                             const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                             CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled, from the driver the runtime has loaded.
inline EncodeFn tensor_map_encoder() {
  EncodeFn encode; cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", (void**)&encode, cudaEnableDefault, &q));
  return encode;
}

// Mean time in ms of 20 back-to-back launches after 3 warm-ups; launch(i) launches the i-th.
template <class Launch>
float mean_ms(Launch launch, cudaEvent_t e0, cudaEvent_t e1) {
  for (int w = 0; w < 3; ++w) launch(w);
  CK(cudaGetLastError());
  const int reps = 20;
  cudaEventRecord(e0);
  for (int r = 0; r < reps; ++r) launch(r);
  cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  return ms / reps;
}
