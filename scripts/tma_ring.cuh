// What the TMA streaming microbenchmarks (tma_stream_floor.cu, decode_stream_floor.cu)
// share: a CUDA error check, the driver's tensor map encoder fetched through the runtime
// (no link against libcuda), and the back-to-back timing of a launch. Their mbarrier and
// TMA code is the kernels' own (gs_mbar_*, gs_tma_load_2d*, gs_policy_* in gemmspec's
// device header), so they stream through the same PTX.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include "../gemmspec/codegen/include/gemmspec_ptx.cuh"
#include <cstdio>
#include <cstdlib>

#define CK(x) do { auto e = (x); if (e != 0) { printf("err %d line %d\n", (int)e, __LINE__); exit(1); } } while (0)

// A tensor map the driver encoded, as the kernels' TMA wrappers take it (the same 128 bytes).
__device__ __forceinline__ const GsTensorMap* gs_map(const CUtensorMap* m) {
  return reinterpret_cast<const GsTensorMap*>(m);
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
