// The streaming floor of the LoRA shrink's access pattern on one GPU (needs a Hopper GPU):
// blocks stream 64-row x K BF16 slabs (K = 4096, 8192 + 1024 rows) through a ring of
// mbarrier-guarded stages by TMA, with no math, and a plain 16-byte-load read of the same
// bytes for comparison. Sweeps the ring depth, boxes per stage, L2 promotion, the grid,
// whole tiles round robin against equal runs of K blocks per block ("balanced"), a B box
// per stage, and tensor maps in kernel parameters or in global memory. Times are CUDA
// events around 20 back-to-back launches over four rotating buffers (L2 holds little of
// the next), and one line after a 256 MB memset per launch (a dirty L2, as a zero-filling
// cache flush leaves it).
//
//   nvcc -O2 -arch=sm_90a -std=c++17 -o tma_stream_floor scripts/tma_stream_floor.cu && ./tma_stream_floor
//   ./tma_stream_floor TILE_M BOX_K BOXES STAGES GRID   # one configuration (for a profiler)
#include "tma_ring.cuh"
#include <vector>

// A ring of `stages` full/empty mbarrier pairs after the stages' bytes; returns full0
// (empty0 is full0 + 8 * stages). The whole block waits until they are initialised.
__device__ __forceinline__ unsigned init_ring(unsigned char* smem, int stages, int stage_bytes) {
  const unsigned full0 = gs_smem_addr(smem + stages * stage_bytes);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { gs_mbar_init(full0 + 8 * s, 1); gs_mbar_init(full0 + 8 * (stages + s), 1); }
    gs_fence_mbar_init();
  }
  __syncthreads();
  return full0;
}

// block: warp 0 lane 0 produces, warp 1 lane 0 consumes (reads one word per box).
__global__ void __launch_bounds__(64) stream(const __grid_constant__ CUtensorMap map, int tiles, int tile_m, int k,
                                             int box_k, int boxes, int stages, unsigned* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int box_bytes = tile_m * box_k * 2, stage_bytes = box_bytes * boxes;
  const unsigned full0 = init_ring(smem, stages, stage_bytes), empty0 = full0 + 8 * stages;
  const int nk = k / (box_k * boxes);
  unsigned acc = 0;
  int stage = 0; unsigned phase = 0;
  if (threadIdx.x == 0) {
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      for (int kb = 0; kb < nk; ++kb) {
        gs_mbar_wait(empty0 + 8 * stage, phase ^ 1);
        gs_mbar_arrive_expect_tx(full0 + 8 * stage, stage_bytes);
        for (int b = 0; b < boxes; ++b)
          gs_tma_load_2d(gs_smem_addr(smem + stage * stage_bytes + b * box_bytes), gs_map(&map), full0 + 8 * stage, (kb * boxes + b) * box_k, t * tile_m);
        if (++stage == stages) { stage = 0; phase ^= 1; }
      }
    }
  } else if (threadIdx.x == 32) {
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      for (int kb = 0; kb < nk; ++kb) {
        gs_mbar_wait(full0 + 8 * stage, phase);
        acc += *reinterpret_cast<volatile unsigned*>(smem + stage * stage_bytes);
        gs_mbar_arrive(empty0 + 8 * stage);
        if (++stage == stages) { stage = 0; phase ^= 1; }
      }
    }
    sink[blockIdx.x] = acc;
  }
}

// LoRA-like: tiles of 64 rows x K; balanced: each block a contiguous run of the flattened
// (tile, kb) space; else round-robin whole tiles. with_b: a 16-row box of B per stage.
// Thread 0 produces, thread 32 consumes (one word read per stage).
__device__ __forceinline__ void lora_ring(const CUtensorMap* mapa, const CUtensorMap* mapb, unsigned char* smem,
                                          int tiles, int k, int stages, int balanced, int with_b, unsigned* sink) {
  const int a_bytes = 64 * 128, stage_bytes = a_bytes + 16 * 128;
  const unsigned full0 = init_ring(smem, stages, stage_bytes), empty0 = full0 + 8 * stages;
  const int nk = k / 64;
  const long long total = (long long)tiles * nk;
  const long long it0 = total * blockIdx.x / gridDim.x, it1 = total * (blockIdx.x + 1) / gridDim.x;
  unsigned acc = 0;
  int stage = 0; unsigned phase = 0;
  const bool prod = threadIdx.x == 0, cons = threadIdx.x == 32;
  if (!prod && !cons) return;
  auto body = [&](int t, int kb) {
    if (prod) {
      gs_mbar_wait(empty0 + 8 * stage, phase ^ 1);
      gs_mbar_arrive_expect_tx(full0 + 8 * stage, with_b ? stage_bytes : a_bytes);
      gs_tma_load_2d(gs_smem_addr(smem + stage * stage_bytes), gs_map(mapa), full0 + 8 * stage, kb * 64, t * 64);
      if (with_b) gs_tma_load_2d(gs_smem_addr(smem + stage * stage_bytes + a_bytes), gs_map(mapb), full0 + 8 * stage, kb * 64, (t * 32 / tiles) * 16);
    } else {
      gs_mbar_wait(full0 + 8 * stage, phase);
      acc += *reinterpret_cast<volatile unsigned*>(smem + stage * stage_bytes);
      gs_mbar_arrive(empty0 + 8 * stage);
    }
    if (++stage == stages) { stage = 0; phase ^= 1; }
  };
  if (balanced) {
    for (long long it = it0; it < it1; ++it) body((int)(it / nk), (int)(it % nk));
  } else {
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) for (int kb = 0; kb < nk; ++kb) body(t, kb);
  }
  if (cons) sink[blockIdx.x] = acc;
}

// The ring with its maps in kernel parameters.
__global__ void __launch_bounds__(64) stream2(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap mapb,
                                              int tiles, int k, int stages, int balanced, int with_b, unsigned* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  lora_ring(&map, &mapb, smem, tiles, k, stages, balanced, with_b, sink);
}

// The ring with its maps in global memory: block b uses copy (b % copies) of A's and B's map.
__global__ void __launch_bounds__(64) stream3(const CUtensorMap* gmaps, int copies,
                                              int tiles, int k, int stages, int balanced, unsigned* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const CUtensorMap* mapa = gmaps + 2 * (blockIdx.x % copies);
  if (threadIdx.x == 0) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(mapa) : "memory");
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(mapa + 1) : "memory");
  }
  lora_ring(mapa, mapa + 1, smem, tiles, k, stages, balanced, 1, sink);
}

// plain streaming read: each block reads its tile's rows with 16-byte loads
__global__ void __launch_bounds__(256) plain(const uint4* x, int tiles, int tile_m, int k, unsigned* sink) {
  unsigned acc = 0;
  const int row_vec = k * 2 / 16;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const uint4* base = x + (size_t)t * tile_m * row_vec;
    for (int i = threadIdx.x; i < tile_m * row_vec; i += 256 * 4) {
      uint4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = i + j * 256 < tile_m * row_vec ? __ldcs(base + i + j * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].w;
    }
  }
  if (acc == 0x12345) sink[0] = acc;
}

int main(int argc, char** argv) {
  const int T = 8192, K = 4096;
  const size_t bytes = (size_t)T * K * 2, alloc = (size_t)(T + 1024) * K * 2;
  const int nbuf = 4;  // rotate buffers so L2 (50 MB) holds little of the next one
  std::vector<void*> bufs(nbuf);
  for (auto& b : bufs) { CK(cudaMalloc(&b, alloc)); CK(cudaMemset(b, 1, alloc)); }
  unsigned* sink; CK(cudaMalloc(&sink, 4096 * 4));
  const EncodeFn encode = tensor_map_encoder();
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));

  auto run_plain = [&](int tile_m, int grid) {
    int tiles = T / tile_m;
    const float ms = mean_ms([&](int i) { plain<<<grid, 256>>>((const uint4*)bufs[i % nbuf], tiles, tile_m, K, sink); }, e0, e1);
    printf("plain ldcs    tile_m %3d grid %4d: %7.2f us %6.2f TB/s\n", tile_m, grid, ms * 1e3, bytes / ms / 1e9);
  };
  auto run = [&](int tile_m, int box_k, int boxes, int stages, int grid, int promo, int rows_total) {
    std::vector<CUtensorMap> maps(nbuf);
    for (int i = 0; i < nbuf; ++i) {
      cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows_total};
      cuuint64_t strides[1] = {(cuuint64_t)K * 2};
      cuuint32_t box[2] = {(cuuint32_t)box_k, (cuuint32_t)tile_m};
      cuuint32_t es[2] = {1, 1};
      CK(encode(&maps[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, bufs[i], dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                box_k * 2 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                promo == 256 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : promo == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    }
    int tiles = rows_total / tile_m;
    size_t sm = (size_t)stages * tile_m * box_k * 2 * boxes + 16 * stages;
    if (sm > 227 * 1024) { printf("skip smem\n"); return; }
    const float ms = mean_ms([&](int i) {
      stream<<<grid, 64, sm>>>(maps[i % nbuf], tiles, tile_m, K, box_k, boxes, stages, sink);
    }, e0, e1);
    double b = (double)rows_total * K * 2;
    printf("tma tile_m %3d box_k %3d x%d stages %2d (%3zu KB) grid %4d promo %3d rows %5d: %7.2f us %6.2f TB/s  %6.1f GB/s/block\n",
           tile_m, box_k, boxes, stages, sm / 1024, grid, promo, rows_total, ms * 1e3, b / ms / 1e9, b / ms / 1e6 / std::min(grid, tiles));
  };
  if (argc > 1) {  // one configuration (for a profiler): argv tile_m box_k boxes stages grid
    run(atoi(argv[1]), atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), 256, T);
    return 0;
  }
  // every launch after a 256 MB memset (dirty L2, as a zero_() flush leaves it)
  {
    void* fl; CK(cudaMalloc(&fl, 256 << 20));
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)T};
    cuuint64_t strides[1] = {(cuuint64_t)K * 2};
    cuuint32_t box[2] = {64, 64};
    cuuint32_t es[2] = {1, 1};
    CUtensorMap m;
    CK(encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, bufs[0], dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    size_t sm = 10 * 8192 + 160;
    float tot = 0, tot_plain = 0;
    for (int r = 0; r < 30; ++r) {
      CK(cudaMemsetAsync(fl, r, 256 << 20));
      cudaEventRecord(e0);
      stream<<<128, 64, sm>>>(m, 128, 64, K, 64, 1, 10, sink);
      cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1); if (r >= 5) tot += ms;
      CK(cudaMemsetAsync(fl, r, 256 << 20));
      cudaEventRecord(e0);
      plain<<<264, 256>>>((const uint4*)bufs[0], 128, 64, K, sink);
      cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
      cudaEventElapsedTime(&ms, e0, e1); if (r >= 5) tot_plain += ms;
    }
    printf("after a dirtying memset, events around one launch: tma 64x64 s10 grid 128 %.2f us, plain %.2f us\n",
           tot / 25 * 1e3, tot_plain / 25 * 1e3);
  }
  run_plain(64, 128); run_plain(64, 264); run_plain(64, 1056);
  {
    void* bb; CK(cudaMalloc(&bb, 32 * 16 * K * 2)); CK(cudaMemset(bb, 1, 32 * 16 * K * 2));
    auto run2 = [&](int tiles, int grid, int stages, int balanced, int with_b) {
      std::vector<CUtensorMap> maps(nbuf); CUtensorMap mb;
      cuuint32_t es[2] = {1, 1};
      cuuint64_t strides[1] = {(cuuint64_t)K * 2};
      for (int i = 0; i < nbuf; ++i) {
        cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)T + 1024};
        cuuint32_t box[2] = {64, 64};
        CK(encode(&maps[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, bufs[i], dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
      }
      cuuint64_t dimsb[2] = {(cuuint64_t)K, 512};
      cuuint32_t boxb[2] = {64, 16};
      CK(encode(&mb, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, bb, dimsb, strides, boxb, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
      size_t sm = (size_t)stages * 10240 + 16 * stages;
      CK(cudaFuncSetAttribute(stream2, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
      const float ms = mean_ms([&](int i) {
        stream2<<<grid, 64, sm>>>(maps[i % nbuf], mb, tiles, K, stages, balanced, with_b, sink);
      }, e0, e1);
      double b = (double)tiles * 64 * K * 2;
      printf("lora-like tiles %3d grid %3d stages %2d %s%s: %7.2f us %6.2f TB/s (A bytes)\n", tiles, grid, stages,
             balanced ? "balanced   " : "round robin", with_b ? " +B" : "   ", ms * 1e3, b / ms / 1e9);
    };
    {
      // maps in global memory: one copy shared by all blocks, or a copy per block
      CUtensorMap ma, mb;
      cuuint32_t es[2] = {1, 1};
      cuuint64_t strides[1] = {(cuuint64_t)K * 2};
      cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)T + 1024};
      cuuint32_t box[2] = {64, 64};
      CK(encode(&ma, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, bufs[0], dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
      cuuint64_t dimsb[2] = {(cuuint64_t)K, 512};
      cuuint32_t boxb[2] = {64, 16};
      CK(encode(&mb, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, bb, dimsb, strides, boxb, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
      std::vector<CUtensorMap> host(2 * 320);
      for (int i = 0; i < 320; ++i) { host[2 * i] = ma; host[2 * i + 1] = mb; }
      CUtensorMap* dm; CK(cudaMalloc(&dm, host.size() * sizeof(CUtensorMap)));
      CK(cudaMemcpy(dm, host.data(), host.size() * sizeof(CUtensorMap), cudaMemcpyHostToDevice));
      CK(cudaFuncSetAttribute(stream3, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
      for (int copies : {1, 320}) for (int bal : {0, 1}) for (int grid : {132, 264}) {
        int tiles = 144, stages = 10;
        size_t sm = (size_t)stages * 10240 + 16 * stages;
        for (int w = 0; w < 3; ++w) stream3<<<grid, 64, sm>>>(dm, copies, tiles, K, stages, bal, sink);
        CK(cudaGetLastError());
        cudaEventRecord(e0);
        for (int r = 0; r < 20; ++r) stream3<<<grid, 64, sm>>>(dm, copies, tiles, K, stages, bal, sink);
        cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= 20;
        printf("global maps, %3d copies, tiles 144 grid %3d %s +B: %7.2f us\n", copies, grid, bal ? "balanced   " : "round robin", ms * 1e3);
      }
    }
    for (int wb : {0, 1}) {
      run2(128, 128, 10, 0, wb);
      run2(128, 264, 10, 0, wb);
      run2(144, 264, 10, 0, wb);
      run2(144, 132, 10, 0, wb);
      run2(144, 132, 10, 1, wb);
      run2(144, 132, 20, 1, wb);
      run2(144, 264, 10, 1, wb);
      run2(128, 132, 10, 1, wb);
    }
  }
  // LoRA-like: 128 tiles of 64 rows, one per block
  for (int promo : {0, 128, 256}) run(64, 64, 1, 10, 128, promo, T);
  for (int st : {2, 4, 6, 10, 16}) run(64, 64, 1, st, 128, 256, T);
  for (int bx : {2, 4}) for (int st : {3, 5, 8}) run(64, 64, bx, st, 128, 256, T);
  run(64, 32, 1, 10, 128, 256, T);
  run(128, 64, 1, 10, 64, 256, T);
  run(128, 64, 1, 5, 64, 256, T);
  run(32, 64, 1, 10, 256, 256, T);
  run(64, 64, 1, 5, 256, 256, T);   // 2 blocks per SM via split? (here: 128 tiles only; 128 busy)
  // few blocks: per-block ingestion alone
  run(64, 64, 1, 10, 32, 256, 2048);
  run(64, 64, 2, 5, 32, 256, 2048);
  run(64, 64, 4, 5, 32, 256, 2048);
  run(64, 64, 1, 10, 8, 256, 512);
  run(64, 64, 4, 5, 8, 256, 512);
  // box without swizzle, 256-element inner (512 B rows)
  run(64, 256, 1, 4, 128, 256, T);
  run(64, 128, 1, 8, 128, 256, T);
  return 0;
}
