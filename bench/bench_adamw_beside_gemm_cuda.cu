// Experiment behind docs/performance.md, "AdamW on reserved SMs beside the GEMMs": can the optimizer
// update run on a few reserved SMs while cuBLASLt GEMMs use the rest? Prints, on one GPU:
//   - the device-to-device copy rate, and AdamW (the engine's element update, adamw_math.cuh) over
//     n parameters, once as the engine launches it (all SMs) and once as a persistent kernel whose
//     blocks each take a whole SM (512 threads, 120 KB of shared memory), on `res` SMs;
//   - GEMMs of Qwen3 training shapes alone, with and without CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET;
//   - both at once (AdamW on `res` SMs of a high-priority stream, as many GEMMs as fit its time on
//     another stream) against the two run one after the other on all SMs (ratio > 1: slower).
// The timed buffers are zero-filled (as in the measurement the docs report); before timing, the
// persistent kernel is checked bit for bit against the engine's launch on random data.
//   usage: qtrain_bench_adamw_beside_gemm_cuda [n in Mi parameters, default 512]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "cuda/cublas_check.h"
#include "ops/cuda/adamw_math.cuh"

namespace {

using bf16 = __nv_bfloat16;
using qt::cuda::AdamWConsts;

constexpr int kPersistThreads = 512;
constexpr int kPersistSmem = 120 * 1024;  // two blocks never share an SM

__device__ __forceinline__ void update4(float4& p, float4& m, float4& v, const float4& g,
                                        const AdamWConsts& k) {
  qt::cuda::adamw_element(p.x, m.x, v.x, g.x, true, k);
  qt::cuda::adamw_element(p.y, m.y, v.y, g.y, true, k);
  qt::cuda::adamw_element(p.z, m.z, v.z, g.z, true, k);
  qt::cuda::adamw_element(p.w, m.w, v.w, g.w, true, k);
}
__device__ __forceinline__ void store_bf16x4(bf16* w, size_t i, const float4& a) {
  uint2 u;
  reinterpret_cast<__nv_bfloat162*>(&u)[0] = __floats2bfloat162_rn(a.x, a.y);
  reinterpret_cast<__nv_bfloat162*>(&u)[1] = __floats2bfloat162_rn(a.z, a.w);
  reinterpret_cast<uint2*>(w)[i] = u;
}

struct State {  // n parameters: master, moments, gradient (fp32) and the bf16 copy
  float *p, *m, *v, *g;
  bf16* w;
  size_t n4;
};

// As the engine launches it: one float4 group per thread, the grid covers n.
__global__ void adamw_plain(State s, AdamWConsts k) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= s.n4) return;
  float4 p = reinterpret_cast<float4*>(s.p)[i], m = reinterpret_cast<float4*>(s.m)[i],
         v = reinterpret_cast<float4*>(s.v)[i];
  update4(p, m, v, __ldg(reinterpret_cast<const float4*>(s.g) + i), k);
  reinterpret_cast<float4*>(s.p)[i] = p;
  reinterpret_cast<float4*>(s.m)[i] = m;
  reinterpret_cast<float4*>(s.v)[i] = v;
  store_bf16x4(s.w, i, p);
}

// Persistent: gridDim.x blocks, one per SM, 4 groups in flight per thread.
__global__ void __launch_bounds__(kPersistThreads, 1) adamw_persistent(State s, AdamWConsts k) {
  constexpr int U = 4;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i0 = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i0 < s.n4;
       i0 += stride * U) {
    float4 p[U], m[U], v[U], g[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = i0 + u * stride;
      if (i < s.n4) {
        p[u] = reinterpret_cast<float4*>(s.p)[i];
        m[u] = reinterpret_cast<float4*>(s.m)[i];
        v[u] = reinterpret_cast<float4*>(s.v)[i];
        g[u] = __ldg(reinterpret_cast<const float4*>(s.g) + i);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = i0 + u * stride;
      if (i < s.n4) {
        update4(p[u], m[u], v[u], g[u], k);
        reinterpret_cast<float4*>(s.p)[i] = p[u];
        reinterpret_cast<float4*>(s.m)[i] = m[u];
        reinterpret_cast<float4*>(s.v)[i] = v[u];
        store_bf16x4(s.w, i, p[u]);
      }
    }
  }
}

void run_plain(const State& s, const AdamWConsts& k, cudaStream_t st) {
  adamw_plain<<<static_cast<unsigned>((s.n4 + 255) / 256), 256, 0, st>>>(s, k);
  QT_CHECK_LAUNCH();
}
void run_persistent(const State& s, const AdamWConsts& k, int sms, cudaStream_t st) {
  adamw_persistent<<<sms, kPersistThreads, kPersistSmem, st>>>(s, k);
  QT_CHECK_LAUNCH();
}

State alloc_state(size_t n) {
  State s{};
  QT_CHECK_CUDA(cudaMalloc(&s.p, n * 4));
  QT_CHECK_CUDA(cudaMalloc(&s.m, n * 4));
  QT_CHECK_CUDA(cudaMalloc(&s.v, n * 4));
  QT_CHECK_CUDA(cudaMalloc(&s.g, n * 4));
  QT_CHECK_CUDA(cudaMalloc(&s.w, n * 2));
  s.n4 = n / 4;
  return s;
}
void free_state(State& s) {
  for (void* q : {static_cast<void*>(s.p), static_cast<void*>(s.m), static_cast<void*>(s.v),
                  static_cast<void*>(s.g), static_cast<void*>(s.w)})
    QT_CHECK_CUDA(cudaFree(q));
}

// The persistent kernel on 8 SMs must give the engine's bits on random data (n not a multiple of
// the grid's stride, so the tail is covered too).
bool persistent_matches_plain(const AdamWConsts& k) {
  const size_t n = (1u << 20) + 4 * 1000;
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> host[4];
  for (auto& h : host) {
    h.resize(n);
    for (float& x : h) x = nd(rng);
  }
  for (float& x : host[2]) x = std::abs(x);  // v >= 0
  State a = alloc_state(n), b = alloc_state(n);
  for (State* s : {&a, &b}) {
    float* dst[4] = {s->p, s->m, s->v, s->g};
    for (int i = 0; i < 4; ++i)
      QT_CHECK_CUDA(cudaMemcpy(dst[i], host[i].data(), n * 4, cudaMemcpyHostToDevice));
  }
  run_plain(a, k, nullptr);
  run_persistent(b, k, 8, nullptr);
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  bool same = true;
  std::vector<float> x(n), y(n);
  for (auto [pa, pb] : {std::pair{a.p, b.p}, std::pair{a.m, b.m}, std::pair{a.v, b.v}}) {
    QT_CHECK_CUDA(cudaMemcpy(x.data(), pa, n * 4, cudaMemcpyDeviceToHost));
    QT_CHECK_CUDA(cudaMemcpy(y.data(), pb, n * 4, cudaMemcpyDeviceToHost));
    same = same && std::memcmp(x.data(), y.data(), n * 4) == 0;
  }
  free_state(a);
  free_state(b);
  return same;
}

struct Gemm {  // C [m, n] = A^T B, bf16, fp32 accumulation; sm_target 0: no SM-count target
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
  void* ws;
  size_t ws_bytes;
  int m, n, k;
  bf16 *A, *B, *C;
  Gemm(cublasLtHandle_t h_, int m_, int n_, int k_, int sm_target, bf16* A_, bf16* B_, bf16* C_,
       void* ws_, size_t ws_bytes_)
      : h(h_), ws(ws_), ws_bytes(ws_bytes_), m(m_), n(n_), k(k_), A(A_), B(B_), C(C_) {
    QT_CHECK_CUBLAS(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    QT_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    QT_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
    if (sm_target > 0)
      QT_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                                                     &sm_target, sizeof sm_target));
    QT_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k));
    QT_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k));
    QT_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, n, m));
    cublasLtMatmulPreference_t pref;
    QT_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    QT_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t r;
    int found = 0;
    QT_CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 1, &r, &found));
    if (found == 0) {
      std::fprintf(stderr, "no cuBLASLt algorithm for %d x %d x %d\n", m, n, k);
      std::exit(1);
    }
    algo = r.algo;
    QT_CHECK_CUBLAS(cublasLtMatmulPreferenceDestroy(pref));
  }
  ~Gemm() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
  }
  void run(cudaStream_t s) const {
    const float one = 1, zero = 0;
    QT_CHECK_CUBLAS(cublasLtMatmul(h, op, &one, A, la, B, lb, &zero, C, lc, C, lc, &algo, ws,
                                   ws_bytes, s));
  }
  double flops() const { return 2.0 * m * n * k; }
};

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  QT_CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = static_cast<size_t>(argc > 1 ? std::atoll(argv[1]) : 512) << 20;
  int sms = 0, lo = 0, hi = 0;
  QT_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  QT_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t sa, sb;  // AdamW at the greatest priority, the GEMMs at the least
  QT_CHECK_CUDA(cudaStreamCreateWithPriority(&sa, cudaStreamNonBlocking, hi));
  QT_CHECK_CUDA(cudaStreamCreateWithPriority(&sb, cudaStreamNonBlocking, lo));
  QT_CHECK_CUDA(cudaFuncSetAttribute(adamw_persistent, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     kPersistSmem));
  // step 1 of lr 1e-4: step_size = lr / 0.1, inv_sqrt_bc2 = 1 / sqrt(0.05)
  const AdamWConsts k{0.9, 0.95, 0.1, 0.05, 1e-8, 1.0, 1e-3, 4.47213595499958, 1e-5f};
  if (!persistent_matches_plain(k)) {
    std::printf("FAILED: the persistent kernel differs from the engine's launch\n");
    return 1;
  }
  std::printf("persistent AdamW kernel checked bit for bit against the engine's launch\n");

  State s = alloc_state(n);
  for (void* q : {static_cast<void*>(s.p), static_cast<void*>(s.m), static_cast<void*>(s.v),
                  static_cast<void*>(s.g)})
    QT_CHECK_CUDA(cudaMemset(q, 0, n * 4));
  const double bytes = 30.0 * n;  // per parameter: p, m, v in and out, g in, the bf16 copy out
  cudaEvent_t e0, e1, e2;
  QT_CHECK_CUDA(cudaEventCreate(&e0));
  QT_CHECK_CUDA(cudaEventCreate(&e1));
  QT_CHECK_CUDA(cudaEventCreate(&e2));
  auto time_ms = [&](auto&& f, int reps) {  // mean of reps after one warm-up, on stream sa
    f();
    QT_CHECK_CUDA(cudaEventRecord(e0, sa));
    for (int r = 0; r < reps; ++r) f();
    QT_CHECK_CUDA(cudaEventRecord(e1, sa));
    QT_CHECK_CUDA(cudaEventSynchronize(e1));
    return elapsed_ms(e0, e1) / reps;
  };
  {
    const float ms = time_ms(
        [&] { QT_CHECK_CUDA(cudaMemcpyAsync(s.m, s.p, n * 4, cudaMemcpyDeviceToDevice, sa)); }, 5);
    std::printf("copy: %.3f ms, %.0f GB/s\n", ms, 2.0 * n * 4 / ms / 1e6);
  }
  const float t_adam_full = time_ms([&] { run_plain(s, k, sa); }, 5);
  std::printf("AdamW as the engine launches it (all SMs): %.3f ms, %.0f GB/s\n", t_adam_full,
              bytes / t_adam_full / 1e6);
  for (int res : {8, 12, 16, 20, 24, 32, 48, sms}) {
    const float ms = time_ms([&] { run_persistent(s, k, res, sa); }, 3);
    std::printf("AdamW persistent on %3d SMs: %.3f ms, %.0f GB/s, %.1f GB/s per SM\n", res, ms,
                bytes / ms / 1e6, bytes / ms / 1e6 / res);
  }

  cublasLtHandle_t h;
  QT_CHECK_CUBLAS(cublasLtCreate(&h));
  const size_t ws_bytes = 32u << 20;
  void* ws;
  QT_CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  struct Shape {
    const char* name;
    int m, n, k;
  };
  const Shape shapes[] = {{"gate_up 8B", 24576, 8192, 4096},
                          {"o 8B", 4096, 8192, 4096},
                          {"gate_up 1.7B", 12288, 8192, 2048}};
  bf16 *A, *B, *C;
  QT_CHECK_CUDA(cudaMalloc(&A, size_t(24576) * 4096 * 2));
  QT_CHECK_CUDA(cudaMalloc(&B, size_t(8192) * 4096 * 2));
  QT_CHECK_CUDA(cudaMalloc(&C, size_t(24576) * 8192 * 2));
  QT_CHECK_CUDA(cudaMemset(A, 0, size_t(24576) * 4096 * 2));
  QT_CHECK_CUDA(cudaMemset(B, 0, size_t(8192) * 4096 * 2));
  for (const Shape& sh : shapes)
    for (int res : {0, 8, 12, 16, 24, 32}) {
      const Gemm gm(h, sh.m, sh.n, sh.k, res == 0 ? 0 : sms - res, A, B, C, ws, ws_bytes);
      const float ms = time_ms([&] { gm.run(sa); }, 20);
      std::printf("%-12s SM-count target %3d: %.3f ms, %.0f TFLOP/s\n", sh.name, sms - res, ms,
                  gm.flops() / ms / 1e9);
    }
  for (const Shape& sh : shapes) {
    const Gemm full(h, sh.m, sh.n, sh.k, 0, A, B, C, ws, ws_bytes);
    const float t_gemm = time_ms([&] { full.run(sa); }, 20);
    for (int res : {8, 12, 16, 24, 32})
      for (const bool target : {false, true}) {
        const Gemm gm(h, sh.m, sh.n, sh.k, target ? sms - res : 0, A, B, C, ws, ws_bytes);
        const float t_alone = time_ms([&] { run_persistent(s, k, res, sa); }, 2);
        const int R = std::max(1, static_cast<int>(t_alone / t_gemm));  // GEMMs in that time
        gm.run(sb);
        QT_CHECK_CUDA(cudaDeviceSynchronize());
        QT_CHECK_CUDA(cudaEventRecord(e0, sa));
        QT_CHECK_CUDA(cudaStreamWaitEvent(sb, e0));
        run_persistent(s, k, res, sa);
        QT_CHECK_CUDA(cudaEventRecord(e1, sa));
        for (int r = 0; r < R; ++r) gm.run(sb);
        QT_CHECK_CUDA(cudaEventRecord(e2, sb));
        QT_CHECK_CUDA(cudaDeviceSynchronize());
        const float ta = elapsed_ms(e0, e1), tg = elapsed_ms(e0, e2);
        const float both = std::max(ta, tg), seq = t_adam_full + R * t_gemm;
        std::printf(
            "%-12s res %2d %s: AdamW %.2f ms (alone on res %.2f), %d GEMMs %.2f ms (%.0f "
            "TFLOP/s; alone on all SMs %.2f), both %.2f vs one after the other %.2f: %.3f\n",
            sh.name, res, target ? "target" : "no-tgt", ta, t_alone, R, tg,
            R * gm.flops() / tg / 1e9, R * t_gemm, both, seq, both / seq);
      }
  }
  free_state(s);
  return 0;
}
