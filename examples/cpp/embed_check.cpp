// A C++ program that uses gemmspec's emitted CUDA the way another build would: it
// includes the headers of two specs compiled into one folder, fills their arguments
// with data it makes itself, calls the host launchers and checks every output on
// sampled elements against a float64 CPU reference it computes itself.
//
//   moe_fp8_forward      y = x * w[expert]^T, FP8 with 1x128 / 128x128 scales, ragged experts;
//                        run at a T above the decode variant's threshold (the kernels as
//                        compiled) and at one below it (the decode variant's kernels)
//   linear_fp8_training  forward, DGRAD (through the transpose pre-pass) and WGRAD
//                        (through the two requantize pre-passes) of one FP8 layer
//
// It also reads the flags of the device check of the offsets, and runs a call with bad
// offsets, which must write nothing.
//
// Build and run: scripts/cpp_embed_check.sh (needs nvcc and a Hopper GPU). Prints one
// line per output with its error and PASS or FAIL, then PASS or FAIL overall.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "linear_fp8_training.h"
#include "moe_fp8_forward.h"

namespace {

#define CHECK_CUDA(call)                                                                     \
  do {                                                                                       \
    const cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                               \
      std::printf("FAIL: %s: %s (%s:%d)\n", #call, cudaGetErrorString(err_), __FILE__, __LINE__); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

constexpr int N = 4096, K = 7168, E = 8;  // fixed by the specs
constexpr int KB = K / 128, NB = N / 128;  // scale blocks along K and N
constexpr float FP8_MAX = 448.0f;

std::mt19937 rng(1234);

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

std::vector<__nv_fp8_e4m3> random_fp8(size_t n) {
  std::vector<__nv_fp8_e4m3> v(n);
  for (auto& x : v) x = __nv_fp8_e4m3(uniform(-2.0f, 2.0f));
  return v;
}

std::vector<float> random_scales(size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = uniform(0.25f, 2.0f);
  return v;
}

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, host.size() * sizeof(T) + 16));
  CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

template <typename T>
std::vector<T> to_host(const T* device, size_t n) {
  std::vector<T> v(n);
  CHECK_CUDA(cudaMemcpy(v.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

void* workspace(size_t bytes) {
  void* p = nullptr;
  if (bytes) CHECK_CUDA(cudaMalloc(&p, bytes));
  return p;
}

// Relative Frobenius error of sampled outputs; also fails on any non-finite value.
struct Error {
  double num = 0, den = 0;
  bool finite = true;
  void add(double got, double want) {
    if (!std::isfinite(got)) finite = false;
    num += (got - want) * (got - want);
    den += want * want;
  }
  double rel() const { return std::sqrt(num / (den > 0 ? den : 1)); }
};

bool report(const char* what, const Error& e, double tolerance) {
  const bool ok = e.finite && e.rel() <= tolerance;
  std::printf("%-38s rel error %.3e (limit %.0e)%s: %s\n", what, e.rel(), tolerance,
              e.finite ? "" : ", non-finite values", ok ? "PASS" : "FAIL");
  return ok;
}

std::vector<int> sample(int n, int count) {
  std::vector<int> out;
  for (int i = 0; i < count && n > 0; ++i) out.push_back(static_cast<int>((static_cast<long long>(i) * 7919) % n));
  out.push_back(n - 1);  // the last row or column: the ragged edge
  return out;
}

// ---- moe_fp8_forward ---------------------------------------------------------------------
// One call of `lengths` tokens per expert; `decode` says which side of the launcher's
// run-time choice T must fall on (T <= gemmspec_moe_fp8_forward_decode_max_rows: the
// decode variant's kernels), so both programs are checked.
bool check_moe(cudaStream_t stream, const int (&lengths)[E], bool decode) {
  std::vector<int> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + lengths[e];
  const int T = offsets[E];
  char label[64], what[96];
  std::snprintf(label, sizeof label, "moe_fp8_forward T=%d (%s)", T, decode ? "decode" : "compiled");
  const bool side = (T <= gemmspec_moe_fp8_forward_decode_max_rows) == decode;
  std::printf("%-38s threshold %d: %s\n", label, static_cast<int>(gemmspec_moe_fp8_forward_decode_max_rows),
              side ? "PASS" : "FAIL");

  const auto x = random_fp8(static_cast<size_t>(T) * K);
  const auto x_scale = random_scales(static_cast<size_t>(T) * KB);  // [T, K/128], T contiguous
  const auto w = random_fp8(static_cast<size_t>(E) * N * K);
  const auto w_scale = random_scales(static_cast<size_t>(E) * NB * KB);  // [E, N/128, K/128]
  std::vector<__nv_bfloat16> poison(static_cast<size_t>(T) * N, __float2bfloat16(NAN));

  gemmspec_moe_fp8_forward_args args = {};
  args.x = to_device(x);
  args.x_scale = to_device(x_scale);
  args.w = to_device(w);
  args.w_scale = to_device(w_scale);
  args.y = to_device(poison);
  args.expert_offsets = to_device(offsets);
  args.T = T;
  void* ws = workspace(gemmspec_moe_fp8_forward_workspace_bytes(T));

  CHECK_CUDA(gemmspec_moe_fp8_forward_run(&args, ws, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  auto y = to_host(args.y, poison.size());

  // The same call captured in a CUDA graph and replayed must give the same output.
  CHECK_CUDA(cudaMemcpy(args.y, poison.data(), poison.size() * 2, cudaMemcpyHostToDevice));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  CHECK_CUDA(gemmspec_moe_fp8_forward_run(&args, ws, stream));
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const auto replay = to_host(args.y, poison.size());
  size_t differ = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const float a = __bfloat162float(y[i]), b = __bfloat162float(replay[i]);
    differ += !(a == b);
  }

  Error err;
  std::vector<int> expert_of(T);
  for (int e = 0; e < E; ++e)
    for (int t = offsets[e]; t < offsets[e + 1]; ++t) expert_of[t] = e;
  for (int t : sample(T, 48)) {
    const int e = expert_of[t];
    for (int n : sample(N, 384)) {
      double acc = 0;
      for (int k = 0; k < K; ++k) {
        const double a = static_cast<float>(x[static_cast<size_t>(t) * K + k]) *
                         static_cast<double>(x_scale[static_cast<size_t>(k / 128) * T + t]);
        const double b = static_cast<float>(w[(static_cast<size_t>(e) * N + n) * K + k]) *
                         static_cast<double>(w_scale[(static_cast<size_t>(e) * NB + n / 128) * KB + k / 128]);
        acc += a * b;
      }
      err.add(__bfloat162float(y[static_cast<size_t>(t) * N + n]), acc);
    }
  }
  std::snprintf(what, sizeof what, "%s: y", label);
  bool ok = report(what, err, 1e-2);
  std::snprintf(what, sizeof what, "%s: graph replay", label);
  std::printf("%-38s %zu of %zu elements differ: %s\n", what, differ, y.size(), differ == 0 ? "PASS" : "FAIL");
  ok = ok && side && differ == 0;
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));

  // The device check of the offsets: its flags (the first int32s of the workspace) are
  // clear after the calls above; offsets that end past T set one, and that call writes
  // nothing (y keeps its poison).
  int set = 0;
  for (int f : to_host(static_cast<const int*>(ws), gemmspec_moe_fp8_forward_check_flags)) set += f != 0;
  std::vector<int> bad = offsets;
  bad[E] = T + 1;
  args.expert_offsets = to_device(bad);
  CHECK_CUDA(cudaMemcpy(args.y, poison.data(), poison.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(gemmspec_moe_fp8_forward_run(&args, ws, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  int raised = 0;
  for (int f : to_host(static_cast<const int*>(ws), gemmspec_moe_fp8_forward_check_flags)) raised += f != 0;
  size_t written = 0;
  for (const __nv_bfloat16 v : to_host(args.y, poison.size())) written += !std::isnan(__bfloat162float(v));
  const bool checked = set == 0 && raised == 1 && written == 0;
  std::snprintf(what, sizeof what, "%s: bad offsets", label);
  std::printf("%-38s flags %d then %d, %zu elements written: %s\n", what, set, raised, written,
              checked ? "PASS" : "FAIL");
  return ok && checked;
}

// ---- linear_fp8_training -----------------------------------------------------------------
// The requantize pre-pass, as the kernel computes it (float32, true division): blocks of
// 128 tokens from token 0, one scale per block and column.
void requantize(const std::vector<__nv_fp8_e4m3>& q, const std::vector<float>& s, int T, int C,
                std::vector<float>& values) {
  const int cb = C / 128;
  values.assign(static_cast<size_t>(T) * C, 0.0f);
  for (int t0 = 0; t0 < T; t0 += 128) {
    for (int c = 0; c < C; ++c) {
      float amax = 0.0f;
      const int rows = T - t0 < 128 ? T - t0 : 128;
      for (int r = 0; r < rows; ++r) {
        const size_t i = static_cast<size_t>(t0 + r) * C + c;
        amax = std::fmax(amax, std::fabs(static_cast<float>(q[i]) * s[static_cast<size_t>(t0 + r) * cb + c / 128]));
      }
      const float sy = amax > 0.0f ? amax / FP8_MAX : 1.0f;
      for (int r = 0; r < rows; ++r) {
        const size_t i = static_cast<size_t>(t0 + r) * C + c;
        const float v = static_cast<float>(q[i]) * s[static_cast<size_t>(t0 + r) * cb + c / 128] / sy;
        __nv_fp8_e4m3 out;
        out.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
        values[i] = static_cast<float>(out) * sy;  // what the GEMM sees after its scales
      }
    }
  }
}

bool check_linear(cudaStream_t stream) {
  const int T = 600;  // not a multiple of 128: a partial token block
  const auto x = random_fp8(static_cast<size_t>(T) * K);
  const auto x_scale = random_scales(static_cast<size_t>(T) * KB);  // [T, K/128] row-major
  const auto w = random_fp8(static_cast<size_t>(N) * K);
  const auto w_scale = random_scales(static_cast<size_t>(NB) * KB);  // [N/128, K/128]
  const auto dy = random_fp8(static_cast<size_t>(T) * N);
  const auto dy_scale = random_scales(static_cast<size_t>(T) * NB);  // [T, N/128]
  std::vector<__nv_bfloat16> y0(static_cast<size_t>(T) * N, __float2bfloat16(NAN));
  std::vector<__nv_bfloat16> dx0(static_cast<size_t>(T) * K, __float2bfloat16(NAN));
  std::vector<float> dw0(static_cast<size_t>(N) * K, 1.0f);  // dw += ...: starts at 1

  gemmspec_linear_fp8_training_args args = {};
  args.x = to_device(x);
  args.x_scale = to_device(x_scale);
  args.w = to_device(w);
  args.w_scale = to_device(w_scale);
  args.dy = to_device(dy);
  args.dy_scale = to_device(dy_scale);
  args.y = to_device(y0);
  args.dx = to_device(dx0);
  args.dw = to_device(dw0);
  args.T = T;
  void* ws = workspace(gemmspec_linear_fp8_training_workspace_bytes(T));
  CHECK_CUDA(gemmspec_linear_fp8_training_run(&args, ws, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const auto y = to_host(args.y, y0.size());
  const auto dx = to_host(args.dx, dx0.size());
  const auto dw = to_host(args.dw, dw0.size());

  auto xv = [&](int t, int k) {
    return static_cast<float>(x[static_cast<size_t>(t) * K + k]) * static_cast<double>(x_scale[static_cast<size_t>(t) * KB + k / 128]);
  };
  auto wv = [&](int n, int k) {
    return static_cast<float>(w[static_cast<size_t>(n) * K + k]) * static_cast<double>(w_scale[static_cast<size_t>(n / 128) * KB + k / 128]);
  };
  auto dyv = [&](int t, int n) {
    return static_cast<float>(dy[static_cast<size_t>(t) * N + n]) * static_cast<double>(dy_scale[static_cast<size_t>(t) * NB + n / 128]);
  };

  Error ey, edx, edw;
  for (int t : sample(T, 40)) {
    for (int n : sample(N, 384)) {
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += xv(t, k) * wv(n, k);
      ey.add(__bfloat162float(y[static_cast<size_t>(t) * N + n]), acc);
    }
    for (int k : sample(K, 384)) {
      double acc = 0;
      for (int n = 0; n < N; ++n) acc += dyv(t, n) * wv(n, k);
      edx.add(__bfloat162float(dx[static_cast<size_t>(t) * K + k]), acc);
    }
  }
  std::vector<float> xq, dyq;
  requantize(x, x_scale, T, K, xq);
  requantize(dy, dy_scale, T, N, dyq);
  for (int n : sample(N, 48)) {
    for (int k : sample(K, 256)) {
      double acc = 1.0;
      for (int t = 0; t < T; ++t) acc += static_cast<double>(dyq[static_cast<size_t>(t) * N + n]) * xq[static_cast<size_t>(t) * K + k];
      edw.add(dw[static_cast<size_t>(n) * K + k], acc);
    }
  }
  bool ok = report("linear_fp8_training: y (forward)", ey, 1e-2);
  ok = report("linear_fp8_training: dx (DGRAD)", edx, 1e-2) && ok;
  ok = report("linear_fp8_training: dw (WGRAD, +=)", edw, 1e-3) && ok;
  return ok;
}

}  // namespace

int main() {
  int device = 0, major = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major != 9) {
    std::printf("FAIL: needs a Hopper GPU (sm_90), found compute capability %d.x\n", major);
    return 1;
  }
  // Arguments the launchers refuse before touching the GPU.
  const bool refuses = gemmspec_moe_fp8_forward_run(nullptr, nullptr, nullptr) == cudaErrorInvalidValue;
  std::printf("%-38s %s\n", "null arguments refused", refuses ? "PASS" : "FAIL");
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bool ok = refuses;
  const int prefill[E] = {300, 0, 129, 128, 1, 0, 517, 64};  // ragged, empty experts included
  const int decode[E] = {3, 0, 130, 64, 1, 0, 200, 65};       // T = 463: the decode variant
  ok = check_moe(stream, prefill, false) && ok;
  ok = check_moe(stream, decode, true) && ok;
  ok = check_linear(stream) && ok;
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
