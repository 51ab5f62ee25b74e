// The streaming floor of the decode rows' access pattern (needs a Hopper GPU): by default
// the ragged E = 8 case's five active experts, N = 4096 weight rows each of K = 7168 FP8
// bytes (147 MB), read by TMA through a ring of mbarrier-guarded stages, a tile of TILE_N
// weight rows at a time with its 64-row A box beside each B box as the GEMM loads them, no
// math: the consumer reads one word of a stage, optionally spins SPIN cycles (a stand-in
// for its wgmma and promotion), and releases it. Sweeps the tile width (how many blocks
// stream), the ring's depth (the bytes in flight per block) and parts of K per tile;
// where the tiles outnumber the blocks that fit, blocks loop over them (persistent).
// Times are CUDA events around 20 back-to-back launches over two rotating weight buffers
// (L2 holds little of the next), around one launch after a 256 MB memset (a dirty L2, as
// the bench's zero-filling cache flush leaves it: its lines are written back to HBM while
// the weights stream in), and around one launch after a kernel has read 256 MB (an L2 of
// clean lines: the same cold weights, no write-back).
// `hints=W,A` gives the weights' and A's loads an L2 eviction policy (first, last or
// none, the default): weights read once and evicted first leave the lines already in L2
// in place, the flush's dirty ones among them.
//
//   nvcc -O2 -arch=sm_90a -std=c++17 -o decode_stream_floor scripts/decode_stream_floor.cu && ./decode_stream_floor
//   ./decode_stream_floor [E,N,K] [rows=R0,R1,...] [hints=W,A] [TILE_N STAGES PARTS SPIN ...]
//     (other weights, each expert's row tiles, L2 policies, only these configurations)
#include "tma_ring.cuh"
#include <algorithm>
#include <cstring>
#include <vector>

constexpr int A_ROWS = 64, BOX_K = 128;

// Work unit u is part (u % parts) of K for tile (u / parts): rows [n0, n0 + tile_n) of its
// expert's weights, beside the expert's 64 rows of A. Blocks take units u = block, block +
// grid, ... (persistent where the units outnumber the blocks that fit), the ring running on
// across them. Thread 0 produces, thread 32 consumes.
__global__ void __launch_bounds__(64) stream(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                             int n, int k, int units, int tile_n, int parts,
                                             int stages, int spin, const int2* tile_list, unsigned long long policy_b,
                                             unsigned long long policy_a, unsigned* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int a_bytes = A_ROWS * BOX_K, b_bytes = tile_n * BOX_K, stage_bytes = a_bytes + b_bytes;
  const unsigned full0 = gs_smem_addr(smem + stages * stage_bytes), empty0 = full0 + 8 * stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { gs_mbar_init(full0 + 8 * s, 1); gs_mbar_init(empty0 + 8 * s, 1); }
    gs_fence_mbar_init();
  }
  __syncthreads();
  const int nk = k / BOX_K;
  // Box rows past the weights' last row arrive as zeros and count as the box's bytes.
  const unsigned tx = stage_bytes;
  int stage = 0; unsigned phase = 0, acc = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int tile = u / parts, part = u % parts;
    const int2 et = tile_list[tile];  // (expert, first weight row)
    const int expert = et.x, n0 = et.y;
    const int kb0 = nk * part / parts, kb1 = nk * (part + 1) / parts;
    if (threadIdx.x == 0) {
      for (int kb = kb0; kb < kb1; ++kb) {
        gs_mbar_wait(empty0 + 8 * stage, phase ^ 1);
        gs_mbar_arrive_expect_tx(full0 + 8 * stage, tx);
        const unsigned dst = gs_smem_addr(smem + stage * stage_bytes);
        const GsTensorMap* mb = gs_map(&map_b);
        const GsTensorMap* ma = gs_map(&map_a);
        if (policy_b) gs_tma_load_2d_hint(dst + a_bytes, mb, full0 + 8 * stage, kb * BOX_K, expert * n + n0, policy_b);
        else gs_tma_load_2d(dst + a_bytes, mb, full0 + 8 * stage, kb * BOX_K, expert * n + n0);
        if (policy_a) gs_tma_load_2d_hint(dst, ma, full0 + 8 * stage, kb * BOX_K, expert * A_ROWS, policy_a);
        else gs_tma_load_2d(dst, ma, full0 + 8 * stage, kb * BOX_K, expert * A_ROWS);
        if (++stage == stages) { stage = 0; phase ^= 1; }
      }
    } else if (threadIdx.x == 32) {
      for (int kb = kb0; kb < kb1; ++kb) {
        gs_mbar_wait(full0 + 8 * stage, phase);
        acc += *reinterpret_cast<volatile unsigned*>(smem + stage * stage_bytes + a_bytes);
        if (spin) { const long long t0 = clock64(); while (clock64() - t0 < spin) {} }
        gs_mbar_arrive(empty0 + 8 * stage);
        if (++stage == stages) { stage = 0; phase ^= 1; }
      }
    }
  }
  if (threadIdx.x == 32) sink[blockIdx.x] = acc;
}

// The policies a kernel's loads take: 0 (none), 1 (evict first), 2 (evict last).
__global__ void make_policies(int b, int a, unsigned long long* out) {
  out[0] = b == 1 ? gs_policy_evict_first() : b == 2 ? gs_policy_evict_last() : 0;
  out[1] = a == 1 ? gs_policy_evict_first() : a == 2 ? gs_policy_evict_last() : 0;
}

// Reads `words` 16-byte words (an L2 left full of clean lines); the sum goes nowhere unless
// it is the impossible value, so the loads stay.
__global__ void read_flush(const uint4* p, size_t words, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = p[i];
    acc += v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

static int policy_code(const char* word) {
  if (strncmp(word, "first", 5) == 0) return 1;
  if (strncmp(word, "last", 4) == 0) return 2;
  return 0;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // The weights: EXPERTS active experts of N rows x K bytes (by default the ragged E = 8
  // case's five); `E,N,K` as the first argument sets them.
  int EXPERTS = 5, N = 4096, K = 7168;
  if (argc > 1 && sscanf(argv[1], "%d,%d,%d", &EXPERTS, &N, &K) == 3) { --argc; ++argv; }
  // rows=R0,R1,...: each expert's 64-row tiles of tokens (one per expert by default), as a
  // ragged case has them; an expert's row tiles of one column tile run one after the
  // other, so that they read its weights together (the second from L2).
  std::vector<int> row_tiles(EXPERTS, 1);
  if (argc > 1 && strncmp(argv[1], "rows=", 5) == 0) {
    const char* c = argv[1] + 5;
    for (int e = 0; e < EXPERTS && *c; ++e) { row_tiles[e] = atoi(c); while (*c && *c != ',') ++c; if (*c) ++c; }
    --argc; ++argv;
  }
  // hints=W,A: the weights' and A's L2 policies (first, last, none).
  int hint_b = 0, hint_a = 0;
  if (argc > 1 && strncmp(argv[1], "hints=", 6) == 0) {
    const char* c = argv[1] + 6;
    hint_b = policy_code(c);
    const char* comma = strchr(c, ',');
    if (comma) hint_a = policy_code(comma + 1);
    --argc; ++argv;
  }
  static const char* const policy_names[] = {"none", "first", "last"};
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t w_bytes = (size_t)EXPERTS * N * K, a_alloc = (size_t)EXPERTS * A_ROWS * K;
  const int nbuf = 2;
  std::vector<void*> w(nbuf), a(nbuf);
  for (int i = 0; i < nbuf; ++i) {
    CK(cudaMalloc(&w[i], w_bytes)); CK(cudaMemset(w[i], 1, w_bytes));
    CK(cudaMalloc(&a[i], a_alloc)); CK(cudaMemset(a[i], 1, a_alloc));
  }
  void* flush; CK(cudaMalloc(&flush, 256 << 20));
  unsigned* sink; CK(cudaMalloc(&sink, 65536 * 4));
  unsigned long long* policies; CK(cudaMalloc(&policies, 2 * sizeof(unsigned long long)));
  make_policies<<<1, 1>>>(hint_b, hint_a, policies);
  unsigned long long policy[2]; CK(cudaMemcpy(policy, policies, sizeof(policy), cudaMemcpyDeviceToHost));
  const EncodeFn encode = tensor_map_encoder();
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto encode2d = [&](CUtensorMap* m, void* base, cuuint64_t rows, cuuint32_t box_rows) {
    cuuint64_t dims[2] = {(cuuint64_t)K, rows};
    cuuint64_t strides[1] = {(cuuint64_t)K};
    cuuint32_t box[2] = {BOX_K, box_rows};
    cuuint32_t es[2] = {1, 1};
    CK(encode(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  };
  printf("%d experts x %d rows x %d bytes = %.1f MB of weights per call; L2 policy: weights %s, A %s\n", EXPERTS, N,
         K, w_bytes / 1e6, policy_names[hint_b], policy_names[hint_a]);
  auto run = [&](int tile_n, int stages, int parts, int spin) {
    std::vector<CUtensorMap> ma(nbuf), mb(nbuf);
    for (int i = 0; i < nbuf; ++i) {
      encode2d(&ma[i], a[i], (cuuint64_t)EXPERTS * A_ROWS, A_ROWS);
      encode2d(&mb[i], w[i], (cuuint64_t)EXPERTS * N, tile_n);
    }
    const int tpe = (N + tile_n - 1) / tile_n;
    std::vector<int2> list;
    for (int e = 0; e < EXPERTS; ++e)
      for (int t = 0; t < tpe; ++t)
        for (int r = 0; r < row_tiles[e]; ++r) list.push_back(make_int2(e, t * tile_n));
    int2* tile_list = nullptr;
    CK(cudaMalloc(&tile_list, list.size() * sizeof(int2)));
    CK(cudaMemcpy(tile_list, list.data(), list.size() * sizeof(int2), cudaMemcpyHostToDevice));
    const int units = (int)list.size() * parts;
    const size_t stage_bytes = (size_t)(A_ROWS + tile_n) * BOX_K, smem = stages * stage_bytes + 16 * stages;
    if (smem > 227 * 1024) { CK(cudaFree(tile_list)); return; }
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream, 64, smem));
    const int grid = std::min(units, sms * per_sm);
    auto launch = [&](int i) {
      stream<<<grid, 64, smem>>>(ma[i % nbuf], mb[i % nbuf], N, K, units, tile_n, parts, stages, spin, tile_list,
                                 policy[0], policy[1], sink);
    };
    const float ms = mean_ms(launch, e0, e1);
    // One launch after a flush, median of 9: a dirtying memset, or a read of as many bytes.
    auto after = [&](bool dirtying) {
      std::vector<float> d;
      for (int r = 0; r < 9; ++r) {
        if (dirtying) CK(cudaMemsetAsync(flush, r, 256 << 20));
        else read_flush<<<4 * sms, 512>>>(static_cast<const uint4*>(flush), (256 << 20) / 16, sink);
        cudaEventRecord(e0); launch(r); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float t; cudaEventElapsedTime(&t, e0, e1); d.push_back(t);
      }
      std::sort(d.begin(), d.end());
      return d[4];
    };
    const float dirty = after(true), clean = after(false);
    CK(cudaFree(tile_list));
    printf("tile_n %3d parts %d stages %d (%3zu KB in flight, %d per SM) spin %4d units %4d grid %3d: back to back %6.1f us %5.2f TB/s | after memset %6.1f us %5.2f TB/s | after a read %6.1f us %5.2f TB/s\n",
           tile_n, parts, stages, stages * stage_bytes / 1024, per_sm, spin, units, grid, ms * 1e3,
           w_bytes / ms / 1e9, dirty * 1e3, w_bytes / dirty / 1e9, clean * 1e3, w_bytes / clean / 1e9);
  };
  if (argc > 1) {  // one configuration per four arguments: TILE_N STAGES PARTS SPIN ...
    for (int i = 1; i + 3 < argc; i += 4) run(atoi(argv[i]), atoi(argv[i + 1]), atoi(argv[i + 2]), atoi(argv[i + 3]));
    return 0;
  }
  for (int st : {2, 3, 4, 5}) run(256, st, 1, 0);          // the decode variant: 80 blocks of 64 x 256
  for (int sp : {600, 1200}) run(256, 4, 1, sp);            // with a consumer's time per K block
  for (int st : {3, 4, 5, 6}) run(192, st, 1, 0);           // 110 blocks
  for (int st : {4, 5, 7}) run(160, st, 1, 0);              // 130 blocks (DeepGEMM's count)
  run(160, 7, 1, 900);
  for (int st : {4, 6, 8}) run(128, st, 1, 0);              // 160 blocks: two waves at one per SM
  run(256, 2, 2, 0); run(256, 3, 2, 0); run(256, 4, 2, 0);  // two parts of K: 160 blocks
  run(128, 4, 1, 0);
  return 0;
}
