// gemmspec_ptx.cuh: gemmspec's own device header for Hopper (sm_90a).
//
// The kernel ABI's leaf table and tensor-map slots, plus thin wrappers over the PTX the
// emitted kernels use, one section per concern: shared-memory addresses and wgmma
// matrix descriptors, wgmma fences, mbarriers, TMA loads, tensor-map patching,
// register reallocation, programmatic dependent launch, element conversions and FP8 block
// scales. The wgmma instructions themselves are emitted per kernel (their operand count
// depends on the tile width).
// Includes only CUDA toolkit headers so it compiles under NVRTC and nvcc alike.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

// ---------------------------------------------------------------------------
// Leaf table (docs/kernel-abi.md). Layout is fixed: 6 ints, then 15 long longs,
// 144 bytes, no padding. The host reads the same layout (numpy structured dtype).
// ---------------------------------------------------------------------------
struct GsLeaf {
  int m, n, k;                     // extents of this leaf's GEMM; any may be 0
  int tile_begin;                  // exclusive prefix sum of output tiles over leaves
  int loads;                       // GS_LOAD_* bits: which operands the copy engine loads
  int reserved;                    // zero
  long long a_off, a_sm, a_sk;     // A(m, k) = A[a_off + m*a_sm + k*a_sk]      (elements)
  long long b_off, b_sn, b_sk;     // B(n, k) = B[b_off + n*b_sn + k*b_sk]
  long long d_off, d_sm, d_sn;     // D(m, n) = D[d_off + m*d_sm + n*d_sn]
  long long sa_off, sa_sm, sa_sk;  // SA[sa_off + (m/SA_BM)*sa_sm + (k/SA_BK)*sa_sk]
  long long sb_off, sb_sn, sb_sk;  // SB[sb_off + (n/SB_BN)*sb_sn + (k/SB_BK)*sb_sk]
};
static_assert(sizeof(GsLeaf) == 144, "GsLeaf layout must match the kernel ABI");

// Per-leaf addresses of a launch's fused epilogue operands (launches with an epilogue
// only). The builder writes them right after the leaf table's sentinel, so the GEMM
// kernel finds them from `leaves` and takes no extra parameter; each pointer already
// points at the leaf's first element (null when the launch has no such operand).
struct GsEpilogue {
  const void* alpha;               // per-leaf scalar: alpha[0]
  const void* row;                 // per-row weight of row m: row[m*row_sm]
  const void* bias;                // bias of column n: bias[n*bias_sn]
  long long row_sm, bias_sn;       // strides in elements
  long long reserved;              // zero
};
static_assert(sizeof(GsEpilogue) == 48, "GsEpilogue layout must match the kernel ABI");

// GsLeaf::loads: set when the leaf's operand is loaded by TMA through its tensor map
// (16-byte aligned base and row stride, K contiguous); clear means the producer
// warpgroup copies it with masked vector loads. GS_STORE_D_TMA: the leaf's output is
// stored by TMA through its map (kernels that stage their epilogue in shared memory);
// clear means the consumers store from registers. GS_LOAD_WHOLE (set with both load bits, by
// kernels that build their table and load through maps of whole buffers): the leaf's A and
// B are loaded through the block's maps of their whole buffers, its first rows coordinates
// there, and have no maps of their own.
enum GsLoad : int { GS_LOAD_A_TMA = 1, GS_LOAD_B_TMA = 2, GS_STORE_D_TMA = 4, GS_LOAD_WHOLE = 8 };

// A CUtensorMap's 128 opaque bytes (cuda.h is not needed to hold one). Encoded on the
// host as a template, patched per leaf on the device (tensormap.replace).
struct __align__(64) GsTensorMap {
  unsigned long long bits[16];
};
static_assert(sizeof(GsTensorMap) == 128, "a tensor map is 128 bytes");

// ---------------------------------------------------------------------------
// Shared-memory addresses and wgmma matrix descriptors.
// ---------------------------------------------------------------------------
// blockIdx.x, read where it is used: a volatile read is never kept in a register across a
// loop (ptxas spilled a hoisted copy in the tightest consumers).
__device__ __forceinline__ int gs_block_index() {
  int x;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
  return x;
}

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

// `desc` moved on by `units` of 16 bytes: only the start-address field changes, and it
// cannot carry out while every shared address stays below 256 KiB.
__device__ __forceinline__ unsigned long long gs_desc_advance(unsigned long long desc, unsigned units) {
  const unsigned lo = static_cast<unsigned>(desc) + units;
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// `v` as a value the compiler cannot recompute: it stays in a register instead of being
// rebuilt (e.g. from the CTA's shared window, a slow special register) inside hot loops.
__device__ __forceinline__ unsigned gs_opaque(unsigned v) {
  asm volatile("" : "+r"(v));
  return v;
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
// mbarriers: the full/empty pairs of the shared-memory ring.
// ---------------------------------------------------------------------------
__device__ __forceinline__ void gs_mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes initialized barriers visible to the async proxy (TMA complete_tx).
__device__ __forceinline__ void gs_fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void gs_mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Announces `bytes` more bytes that copies will complete on this phase, without arriving.
__device__ __forceinline__ void gs_mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Arrives and announces `bytes` more bytes that copies will complete on this phase.
__device__ __forceinline__ void gs_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Arrives once this thread's earlier cp.async copies have landed; the arrival counts
// towards the barrier's expected count (noinc) and never blocks the thread.
__device__ __forceinline__ void gs_cp_async_arrive(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// 4-byte global -> shared copy that completes asynchronously (tracked by gs_cp_async_arrive).
__device__ __forceinline__ void gs_cp_async_4(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// 16-byte global -> shared copy of which the first `src_bytes` (0..16) are read and the
// rest written as zeros; `src` 16-byte aligned. Tracked by commit/wait groups.
__device__ __forceinline__ void gs_cp_async_16(unsigned dst, const void* src, unsigned src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void gs_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void gs_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Blocks until the phase with parity `parity` has completed (acquire, CTA scope).
__device__ __forceinline__ void gs_mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ---------------------------------------------------------------------------
// TMA: 2-D tiled loads into shared memory, completing on an mbarrier.
// ---------------------------------------------------------------------------
// Box {c0 (innermost, elements), c1 (rows)}; elements outside the map's bounds land as zeros
// and still count towards the barrier's transaction bytes.
__device__ __forceinline__ void gs_tma_load_2d(unsigned dst, const GsTensorMap* map, unsigned bar,
                                               int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The same load with an L2 eviction policy (gs_policy_*): memory-bound kernels stream A once
// (evict first) and read B from many blocks (evict last).
__device__ __forceinline__ void gs_tma_load_2d_hint(unsigned dst, const GsTensorMap* map, unsigned bar, int c0,
                                                    int c1, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
      : "memory");
}

__device__ __forceinline__ unsigned long long gs_policy_evict_first() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ unsigned long long gs_policy_evict_last() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// The same box, written to the same shared-memory offset (and signalled on the same
// mbarrier offset) in every CTA of the cluster named by `cta_mask`.
__device__ __forceinline__ void gs_tma_load_2d_multicast(unsigned dst, const GsTensorMap* map, unsigned bar,
                                                         int c0, int c1, unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
      : "memory");
}

// ---------------------------------------------------------------------------
// TMA stores: a shared-memory box to global memory through a tensor map. Elements outside
// the map's bounds are not written, so the leaf's edges mask themselves.
// ---------------------------------------------------------------------------
__device__ __forceinline__ void gs_tma_store_2d(const GsTensorMap* map, unsigned src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<unsigned long long>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}

// The same box added element-wise into global memory (D += box; f32 adds).
__device__ __forceinline__ void gs_tma_reduce_add_2d(const GsTensorMap* map, unsigned src, int c0, int c1) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<unsigned long long>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void gs_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until this thread's committed bulk stores have finished reading shared memory
// (the buffer may be rewritten); their global writes may still be in flight.
__device__ __forceinline__ void gs_bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Waits until this thread's committed bulk stores are complete.
__device__ __forceinline__ void gs_bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (whole warps).
__device__ __forceinline__ void gs_named_barrier(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A global counter read with acquire and written with release semantics at GPU scope (one
// block hands data in global memory to another).
__device__ __forceinline__ int gs_load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void gs_store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// A named barrier that also returns, to every thread, whether any thread's `pred` held.
__device__ __forceinline__ bool gs_named_barrier_or(unsigned id, unsigned threads, bool pred) {
  unsigned any;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, %3, p;\nselp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<unsigned>(pred)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

// ---------------------------------------------------------------------------
// Tensor maps patched on the device. The writer edits a copy in shared memory, stores
// it to global memory and releases; the kernel that uses it acquires before its first
// TMA through that map (a stale descriptor may sit in the TMA unit's cache).
// ---------------------------------------------------------------------------
__device__ __forceinline__ void gs_tensormap_set_address(unsigned smem_map, const void* address) {
  asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;\n" ::"r"(smem_map),
               "l"(reinterpret_cast<unsigned long long>(address))
               : "memory");
}

// Sizes in elements, innermost dimension first; `row_bytes` is the stride of dimension 1.
__device__ __forceinline__ void gs_tensormap_set_extent(unsigned smem_map, unsigned inner, unsigned rows,
                                                        unsigned long long row_bytes) {
  asm volatile("tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 0, %1;\n" ::"r"(smem_map),
               "r"(inner)
               : "memory");
  asm volatile("tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 1, %1;\n" ::"r"(smem_map),
               "r"(rows)
               : "memory");
  asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 0, %1;\n" ::"r"(smem_map),
               "l"(row_bytes)
               : "memory");
}

__device__ __forceinline__ void gs_tensormap_release() {
  asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
}

__device__ __forceinline__ void gs_tensormap_acquire(const GsTensorMap* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(
                   reinterpret_cast<unsigned long long>(map))
               : "memory");
}

// Asks L2 to fetch `bytes` (a multiple of 16) from global memory at `p` (16-byte
// aligned), asynchronously and with nothing to wait for: a hint, no value depends on it.
__device__ __forceinline__ void gs_prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(reinterpret_cast<unsigned long long>(p)),
               "r"(bytes) : "memory");
}

// Fetches a tensor map's descriptor ahead of its first use (after its acquire).
__device__ __forceinline__ void gs_tensormap_prefetch(const GsTensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// A leaf's operand: base + off elements, `rows` rows of `k` elements, rows `row_stride`
// elements apart, `k_stride` between elements of a row. TMA describes it when its rows are
// contiguous and its base and row stride are multiples of 16 bytes.
__device__ __forceinline__ bool gs_tma_describable(const void* base, long long off, long long row_stride,
                                                   long long k_stride, int rows, int k, int element_bytes) {
  const unsigned long long addr = reinterpret_cast<unsigned long long>(base) + off * element_bytes;
  const long long stride_bytes = row_stride * element_bytes;
  return k_stride == 1 && (addr & 15ull) == 0 && rows > 0 && k > 0 &&
         (rows == 1 || (stride_bytes > 0 && stride_bytes % 16 == 0 && stride_bytes < (1ll << 40)));
}

// A leaf's output for TMA stores (and a staged add's TMA load of the old tile): describable,
// and each row's end on a 16-byte boundary. A TMA store bounded by the map's width still
// writes the whole 16-byte chunk that holds a row's last element, so a row whose end is not
// aligned would have its chunk's tail written over the next row's first elements (packed
// rows) or the padding between rows. Such leaves are stored from registers, masked per
// element.
__device__ __forceinline__ bool gs_tma_store_describable(const void* base, long long off, long long row_stride,
                                                         long long n_stride, int rows, int n, int element_bytes) {
  return gs_tma_describable(base, off, row_stride, n_stride, rows, n, element_bytes) &&
         (static_cast<long long>(n) * element_bytes) % 16 == 0;
}

// Copies the template into the thread's shared `slot`, patches the leaf's base address,
// extents and row stride into it and publishes it to `out` (the writer then releases it
// with gs_tensormap_release, and each thread that loads or stores through it acquires it).
__device__ __forceinline__ void gs_write_map(GsTensorMap* out, GsTensorMap* slot, const GsTensorMap* tmpl,
                                             const void* base, long long off, long long row_stride, int rows,
                                             int k, int element_bytes) {
  *slot = *tmpl;
  const unsigned s = gs_smem_addr(slot);
  const unsigned char* address = static_cast<const unsigned char*>(base) + off * element_bytes;
  // A single-row leaf never steps to row 1 (it is out of bounds): any legal stride will do.
  const long long row_bytes = rows > 1 ? row_stride * element_bytes : ((k * element_bytes + 15) / 16) * 16;
  gs_tensormap_set_address(s, address);
  gs_tensormap_set_extent(s, static_cast<unsigned>(k), static_cast<unsigned>(rows),
                          static_cast<unsigned long long>(row_bytes));
  *out = *slot;
}

// ---------------------------------------------------------------------------
// Thread-block clusters.
// ---------------------------------------------------------------------------
__device__ __forceinline__ unsigned gs_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster arrives and waits (release / acquire).
__device__ __forceinline__ void gs_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Arrives on the mbarrier at the same shared-memory offset in CTA `rank` of the cluster.
// CTA-scope release: the arrival carries no data, it only says "this stage was read"
// (the reads were wgmma's, complete before the arrival), so no cluster-wide fence.
__device__ __forceinline__ void gs_mbar_arrive_cluster(unsigned bar, unsigned rank) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

// ---------------------------------------------------------------------------
// Register reallocation between warpgroups (needs a register cap at kernel entry:
// __launch_bounds__(threads, 1)).
// ---------------------------------------------------------------------------
template <int R>
__device__ __forceinline__ void gs_setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

template <int R>
__device__ __forceinline__ void gs_setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

// ---------------------------------------------------------------------------
// Programmatic dependent launch. A kernel launched with the programmatic stream
// serialization attribute may start while the kernel before it on the stream still runs.
// ---------------------------------------------------------------------------
// Blocks the calling thread until the grids this one depends on have completed and their
// memory operations are visible to it. Each thread that reads what they wrote, or writes
// anything, waits first. A no-op in a kernel launched without the attribute.
__device__ __forceinline__ void gs_grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Lets the dependent grid be scheduled before this one ends (once every block of this
// grid has issued it or exited). It makes nothing visible: the dependent's
// gs_grid_dependency_wait still waits for this whole grid to complete and flush.
__device__ __forceinline__ void gs_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
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
// FP8 block scales: the quantize rule (docs/language.md, quantize), held once for the
// quantize and requantize passes and an FP8 D's epilogue. Float32 throughout, so a numpy
// float32 reference reproduces it bit for bit.
// ---------------------------------------------------------------------------
// amax / fp8_max by IEEE division, or 1 where that is 0: an all-zero block, or one whose
// amax underflows the quotient (its zeros would become 0 / 0).
__device__ __forceinline__ float gs_fp8_scale(float amax, float fp8_max) {
  const float q = __fdiv_rn(amax, fp8_max);
  return q > 0.0f ? q : 1.0f;
}

// The least power of two 2^e with e >= -127 and amax <= fp8_max * 2^e, for
// fp8_max = 1.75 * 2^max_exp (e4m3: 448, max_exp 8; e5m2: 57344, max_exp 15); 1 where amax
// is 0, amax where it is +inf (no power of two holds it). For amax = 1.f * 2^E (E unbiased),
// the bound holds from e = E - max_exp when 1.f <= 1.75 (fraction bits at most 0x600000),
// else from one more; e stops at -127 (UE8M0's smallest, a float32 subnormal), which every
// subnormal amax gets. Integer work on the bits, exact: no pow or log function.
__device__ __forceinline__ float gs_fp8_scale_pow2(float amax, int max_exp) {
  if (!(amax > 0.0f)) return 1.0f;                 // an all-zero block
  const unsigned bits = __float_as_uint(amax);
  if (bits >= 0x7f800000u) return amax;            // +inf
  int e = static_cast<int>(bits >> 23) - 127 - max_exp + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0);
  e = max(e, -127);
  return e > -127 ? __uint_as_float(static_cast<unsigned>(e + 127) << 23) : __uint_as_float(0x00400000u);
}

// ---------------------------------------------------------------------------
// The offsets check's scan of an index tensor.
// ---------------------------------------------------------------------------
// Whether any of the n row numbers at p (4-byte aligned) lies outside [0, bound), for the
// block's threads together (each returns its own share's verdict). 16-byte loads after a
// head that aligns them, eight in flight per thread: one block reads a routing's tens of
// thousands of indices in a few memory latencies, not one latency per four bytes.
__device__ __forceinline__ bool gs_row_outside(int v, long long bound) {
  return static_cast<unsigned long long>(static_cast<long long>(v)) >= static_cast<unsigned long long>(bound);
}
__device__ __forceinline__ int gs_rows_outside(const int* __restrict__ p, long long n, long long bound) {
  int outside = 0;
  long long head = static_cast<long long>(((16u - static_cast<unsigned>(reinterpret_cast<unsigned long long>(p) & 15u)) & 15u) >> 2);
  if (head > n) head = n;
  for (long long s = threadIdx.x; s < head; s += blockDim.x) outside |= gs_row_outside(p[s], bound);
  const int4* q = reinterpret_cast<const int4*>(p + head);
  const long long vectors = (n - head) >> 2;
#pragma unroll 8
  for (long long s = threadIdx.x; s < vectors; s += blockDim.x) {
    const int4 v = __ldg(q + s);
    outside |= gs_row_outside(v.x, bound) | gs_row_outside(v.y, bound) | gs_row_outside(v.z, bound) |
               gs_row_outside(v.w, bound);
  }
  for (long long s = head + (vectors << 2) + threadIdx.x; s < n; s += blockDim.x) outside |= gs_row_outside(p[s], bound);
  return outside;
}
