// The experts' grouped GEMMs (cuda/grouped_gemm.h: one launch a product, counts on the device)
// against the per-expert cuBLASLt loop they replace (one linear_* GEMM per expert with rows,
// counts on the host), at Qwen3-30B-A3B's shapes: 128 experts, H = 2048, Im = 768, 65,536 rows
// (8,192 tokens x 8) spread log-normally over the experts (sigma 1.2: a few experts get
// thousands of rows, many a few dozen, some none). Prints TFLOP/s of both for the forward, the
// input gradient and the weight gradient of gate_up (H -> 2 Im) and down (Im -> H), for the
// mma.sync kernel and (on sm_90a) the wgmma kernel, after checking each against the loop
// (relative error of the whole output).
//   usage: qtrain_bench_grouped_gemm_cuda [rows, default 65536] [sigma, default 1.2] [seed]
// A plain program (CUDA events, warm-up, median of the timed repetitions).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/check.h"
#include "cuda/grouped_gemm.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/grouped_gemm.cuh"

namespace {

using bf16 = __nv_bfloat16;

// n values uniform in [-scale, scale) (a xorshift stream seeded from rng: fast for 400 M values).
template <typename T>
T* device_random(std::size_t n, std::mt19937_64& rng, float scale) {
  std::vector<T> h(n);
  std::uint64_t s = rng() | 1;
  for (auto& v : h) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    v = static_cast<T>(scale * (static_cast<float>(s >> 40) * (2.f / 16777216.f) - 1.f));
  }
  T* p = nullptr;
  QT_CHECK_CUDA(cudaMalloc(&p, n * sizeof(T)));
  QT_CHECK_CUDA(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

template <typename T>
T* device_zeros(std::size_t n) {
  T* p = nullptr;
  QT_CHECK_CUDA(cudaMalloc(&p, n * sizeof(T)));
  QT_CHECK_CUDA(cudaMemset(p, 0, n * sizeof(T)));
  return p;
}

template <typename T>
double rel_diff(const T* a, const T* b, std::size_t n) {
  std::vector<T> ha(n), hb(n);
  QT_CHECK_CUDA(cudaMemcpy(ha.data(), a, n * sizeof(T), cudaMemcpyDeviceToHost));
  QT_CHECK_CUDA(cudaMemcpy(hb.data(), b, n * sizeof(T), cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = static_cast<float>(ha[i]), y = static_cast<float>(hb[i]);
    if (!std::isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

template <typename T>
double ref_norm(const T* a, std::size_t n) {
  std::vector<T> h(n);
  QT_CHECK_CUDA(cudaMemcpy(h.data(), a, n * sizeof(T), cudaMemcpyDeviceToHost));
  double s = 0;
  for (const T& v : h) s += static_cast<double>(static_cast<float>(v)) * static_cast<float>(v);
  return std::sqrt(s);
}

// Median milliseconds of f over `reps` runs after 3 warm-ups.
double time_ms(const std::function<void()>& f, int reps = 10) {
  cudaEvent_t a, b;
  QT_CHECK_CUDA(cudaEventCreate(&a));
  QT_CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    QT_CHECK_CUDA(cudaEventRecord(a));
    f();
    QT_CHECK_CUDA(cudaEventRecord(b));
    QT_CHECK_CUDA(cudaEventSynchronize(b));
    QT_CHECK_CUDA(cudaEventElapsedTime(&ms[i], a, b));
  }
  QT_CHECK_CUDA(cudaEventDestroy(a));
  QT_CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace qt::cuda;
  const int rows = argc > 1 ? std::atoi(argv[1]) : 65536;
  const double sigma = argc > 2 ? std::atof(argv[2]) : 1.2;
  const unsigned long long seed = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1234;
  const int E = 128, H = 2048, Im = 768;
  std::mt19937_64 rng(seed);

  // Log-normal weights, rounded to counts that sum to rows.
  std::lognormal_distribution<double> ln(0.0, sigma);
  std::vector<double> wts(E);
  for (auto& v : wts) v = ln(rng);
  const double tot = std::accumulate(wts.begin(), wts.end(), 0.0);
  std::vector<int> counts(E);
  int sum = 0;
  for (int e = 0; e < E; ++e) sum += counts[e] = static_cast<int>(std::floor(wts[e] / tot * rows));
  for (int e = 0; sum < rows; e = (e + 1) % E, ++sum) ++counts[e];
  std::vector<int> off(E + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), off.begin() + 1);
  std::vector<int> sorted = counts;
  std::sort(sorted.begin(), sorted.end());
  int small = 0;
  for (int c : counts) small += c < 128 ? 1 : 0;
  std::printf("grouped GEMM bench: %d experts, %d rows, log-normal sigma %.2f, seed %llu\n", E,
              rows, sigma, seed);
  std::printf("counts: min %d, median %d, max %d, %d experts under 128 rows\n", sorted[0],
              sorted[E / 2], sorted[E - 1], small);

  int* d_off = device_zeros<int>(E + 1);
  QT_CHECK_CUDA(cudaMemcpy(d_off, off.data(), sizeof(int) * (E + 1), cudaMemcpyHostToDevice));

  struct Proj {
    const char* name;
    int in, out;
  };
  for (const Proj p : {Proj{"gate_up", H, 2 * Im}, Proj{"down", Im, H}}) {
    const std::size_t R = rows, I = p.in, O = p.out;
    bf16* x = device_random<bf16>(R * I, rng, 1.f);
    bf16* w = device_random<bf16>(E * O * I, rng, 0.02f);
    bf16* dy = device_random<bf16>(R * O, rng, 1.f);
    bf16 *y1 = device_zeros<bf16>(R * O), *y2 = device_zeros<bf16>(R * O);
    bf16 *dx1 = device_zeros<bf16>(R * I), *dx2 = device_zeros<bf16>(R * I);
    float *dw1 = device_zeros<float>(E * O * I), *dw2 = device_zeros<float>(E * O * I);

    auto loop_fwd = [&] {
      for (int e = 0; e < E; ++e)
        if (counts[e] > 0)
          linear_forward(y2 + off[e] * O, x + off[e] * I, w + e * O * I, counts[e], p.in, p.out,
                         nullptr);
    };
    auto loop_bwd = [&](bool data) {
      for (int e = 0; e < E; ++e) {
        if (counts[e] > 0)
          linear_backward(data ? dx2 + off[e] * I : nullptr, data ? nullptr : dw2 + e * O * I,
                          dy + off[e] * O, x + off[e] * I, w + e * O * I, counts[e], p.in, p.out,
                          nullptr, false);
        else if (!data)
          QT_CHECK_CUDA(cudaMemsetAsync(dw2 + e * O * I, 0, O * I * sizeof(float)));
      }
    };
    auto grp_fwd = [&] { grouped_linear(y1, x, w, d_off, E, rows, p.in, p.out, nullptr); };
    auto grp_data = [&] {
      grouped_linear_backward(dx1, nullptr, dy, x, w, d_off, E, rows, p.in, p.out, nullptr, false);
    };
    auto grp_wgt = [&] {
      grouped_linear_backward(nullptr, dw1, dy, x, w, d_off, E, rows, p.in, p.out, nullptr, false);
    };
    loop_fwd();
    loop_bwd(true);
    loop_bwd(false);
    const double flop = 2.0 * R * I * O;
    const double t_loop[3] = {time_ms(loop_fwd), time_ms([&] { loop_bwd(true); }),
                              time_ms([&] { loop_bwd(false); })};
    // Each grouped kernel: checked against the loop, then timed.
    double t_grp[2][3] = {}, err[2][3] = {};
    const bool wgmma = attention_wgmma_available();
    for (int kern = 0; kern < (wgmma ? 2 : 1); ++kern) {
      set_grouped_gemm_kernel(kern == 0 ? GroupedGemmKernel::kMma : GroupedGemmKernel::kWgmma);
      grp_fwd();
      grp_data();
      grp_wgt();
      QT_CHECK_CUDA(cudaDeviceSynchronize());
      err[kern][0] = rel_diff(y1, y2, R * O);
      err[kern][1] = rel_diff(dx1, dx2, R * I);
      err[kern][2] = rel_diff(dw1, dw2, E * O * I);
      t_grp[kern][0] = time_ms(grp_fwd);
      t_grp[kern][1] = time_ms(grp_data);
      t_grp[kern][2] = time_ms(grp_wgt);
    }
    set_grouped_gemm_kernel(GroupedGemmKernel::kAuto);
    const char* what[3] = {"forward", "input grad", "weight grad"};
    for (int k = 0; k < 3; ++k) {
      std::printf("%-8s %-11s mma.sync %7.3f ms %6.1f TFLOP/s", p.name, what[k], t_grp[0][k],
                  flop / t_grp[0][k] * 1e-9);
      if (wgmma)
        std::printf(" | wgmma %7.3f ms %6.1f TFLOP/s", t_grp[1][k], flop / t_grp[1][k] * 1e-9);
      std::printf(" | cuBLAS loop %7.3f ms %6.1f TFLOP/s | rel diff %.2e", t_loop[k],
                  flop / t_loop[k] * 1e-9, err[0][k]);
      if (k == 0) std::printf(" (|ref| %.3e)", ref_norm(y2, R * O));
      if (wgmma) std::printf(" %.2e", err[1][k]);
      const bool bad = err[0][k] >= 1e-2 || (wgmma && err[1][k] >= 1e-2);
      std::printf("%s\n", bad ? "  MISMATCH" : "");
    }
    for (void* q : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(dy),
                    static_cast<void*>(y1), static_cast<void*>(y2), static_cast<void*>(dx1),
                    static_cast<void*>(dx2), static_cast<void*>(dw1), static_cast<void*>(dw2)})
      QT_CHECK_CUDA(cudaFree(q));
  }
  QT_CHECK_CUDA(cudaFree(d_off));
  return 0;
}
