// bf16 GEMM throughput through cuBLASLt (qt::cuda::gemm): the measured ceiling (8192^3) that the
// model benchmark prints beside MFU, and the Qwen3-0.6B / 1.7B / 8B linear layers at 8192 tokens,
// forward (y = x W^T, bf16 out) and the two backward GEMMs (dx = dy W, bf16 out; dw += dy^T x,
// fp32 out). FLOPs = 2 M N K. Times come from CUDA events (UseManualTime) around batches of
// GEMMs, after a warm-up; inputs rotate over several buffer sets when one set would sit in L2.
// Every case validates sampled outputs against double dot products before it is timed. Each case
// is timed twice: with cuBLASLt's first heuristic choice (what an untuned plan runs; a short burst
// of 9 batches) and after GemmContext::tune picked the fastest of the heuristic's first 8
// algorithms (sustained: 25 or 100 batches). On the H200 the sustained clocks sit lower under the
// 700 W cap, so differences of ~10% between the two columns are power state, not algorithm.
//
//   qtrain_bench_gemm_cuda [--benchmark_filter=...] [--benchmark_out=gemm.json]
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/gemm.h"
#include "ops/cuda/gemm.cuh"

namespace {

using qt::cuda::bf16;

struct Case {
  std::string name;
  bool ta, tb;
  int M, N, K;
  bool f32_out;  // fp32 C with beta = 1 (weight-gradient accumulation), else bf16 C, beta = 0
};

struct Result {
  int M, N, K;
  double ms, tflops;     // tuned plan (the fastest of the heuristic's first 8 algorithms)
  double tflops_heur;    // the heuristic's first choice, what an untuned plan runs
};
std::map<std::string, Result> g_results;  // by case name, the latest run of each

// Inputs are one random bf16 pattern of kPeriod elements per operand, tiled over the buffer, so
// that element i of a buffer is pattern[i % kPeriod] and validation knows every value.
constexpr std::size_t kPeriod = std::size_t{1} << 22;

std::uint16_t bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
float bf16_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<std::uint16_t> pattern(std::uint64_t seed, double scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, static_cast<float>(scale));
  std::vector<std::uint16_t> p(kPeriod);
  for (auto& v : p) v = bf16_bits(d(rng));
  return p;
}

// Fills `dst` (n bf16) by tiling the pattern: one upload, then device-to-device doubling copies.
void fill_tiled(bf16* dst, std::size_t n, const std::vector<std::uint16_t>& pat) {
  const std::size_t first = std::min(n, kPeriod);
  QT_CHECK_CUDA(cudaMemcpy(dst, pat.data(), first * 2, cudaMemcpyHostToDevice));
  for (std::size_t done = first; done < n;) {
    const std::size_t chunk = std::min(done, n - done);  // done is a multiple of kPeriod
    QT_CHECK_CUDA(cudaMemcpy(dst + done, dst, chunk * 2, cudaMemcpyDeviceToDevice));
    done += chunk;
  }
}

void run_gemm(const Case& c, const bf16* A, const bf16* B, void* C, cudaStream_t s) {
  const int lda = c.ta ? c.M : c.K, ldb = c.tb ? c.K : c.N, ldc = c.N;
  if (c.f32_out) {
    qt::cuda::gemm(c.ta, c.tb, c.M, c.N, c.K, 1.f, A, lda, B, ldb, 1.f, static_cast<float*>(C), ldc, s);
  } else {
    qt::cuda::gemm(c.ta, c.tb, c.M, c.N, c.K, 1.f, A, lda, B, ldb, 0.f, static_cast<bf16*>(C), ldc, s);
  }
}

// Sampled entries of C (first run: C was zero, so beta does not matter) against double dot
// products of the patterns. Returns the relative error over the samples.
double validate(const Case& c, const bf16* dC, const std::vector<std::uint16_t>& pa,
                const std::vector<std::uint16_t>& pb) {
  const std::size_t lda = c.ta ? c.M : c.K, ldb = c.tb ? c.K : c.N;
  std::mt19937_64 rng(12345);
  double num = 0, den = 0;
  for (int s = 0; s < 64; ++s) {
    const std::size_t i = rng() % c.M, j = rng() % c.N;
    double ref = 0;
    for (std::size_t k = 0; k < static_cast<std::size_t>(c.K); ++k) {
      const std::size_t ia = c.ta ? k * lda + i : i * lda + k;
      const std::size_t ib = c.tb ? j * ldb + k : k * ldb + j;
      ref += double(bf16_float(pa[ia % kPeriod])) * double(bf16_float(pb[ib % kPeriod]));
    }
    double got;
    const std::size_t off = i * c.N + j;
    if (c.f32_out) {
      float v;
      QT_CHECK_CUDA(cudaMemcpy(&v, reinterpret_cast<const float*>(dC) + off, 4, cudaMemcpyDeviceToHost));
      got = v;
    } else {
      std::uint16_t v;
      QT_CHECK_CUDA(cudaMemcpy(&v, dC + off, 2, cudaMemcpyDeviceToHost));
      got = bf16_float(v);
    }
    if (!std::isfinite(got)) return NAN;
    num += (got - ref) * (got - ref);
    den += ref * ref;
  }
  return std::sqrt(num / den);
}

qt::cuda::GemmArgs args_of(const Case& c, const bf16* A, const bf16* B, void* C) {
  qt::cuda::GemmArgs g;
  g.trans_a = c.ta, g.trans_b = c.tb;
  g.M = c.M, g.N = c.N, g.K = c.K;
  g.A = A, g.lda = c.ta ? c.M : c.K;
  g.B = B, g.ldb = c.tb ? c.K : c.N;
  g.C = C, g.ldc = c.N;
  g.beta = c.f32_out ? 1.f : 0.f;
  g.c_is_f32 = c.f32_out;
  return g;
}

void BM_Gemm(benchmark::State& state, const Case& c) {
  // A fresh cuBLASLt context (empty plan cache), so that an earlier case of the same shape has not
  // already tuned this one's plan.
  qt::cuda::gemm_init(nullptr, qt::cuda::kGemmWorkspaceBytes);
  const std::size_t a_elems = std::size_t(c.M) * c.K, b_elems = std::size_t(c.K) * c.N;
  const std::size_t c_bytes = std::size_t(c.M) * c.N * (c.f32_out ? 4 : 2);
  const std::size_t set_bytes = (a_elems + b_elems) * 2 + c_bytes + 3 * 256;
  // Enough sets that the working set (>= 256 MiB) cannot stay in L2 between launches.
  const int sets = static_cast<int>(std::clamp<std::size_t>((std::size_t{256} << 20) / set_bytes + 1, 1, 8));
  qt::cuda::DeviceArena arena(sets * set_bytes, "bench " + c.name);
  static const std::vector<std::uint16_t> pa = pattern(1, 1.0), pb = pattern(2, 1.0);
  std::vector<const bf16*> As, Bs;
  std::vector<void*> Cs;
  for (int s = 0; s < sets; ++s) {
    bf16* a = arena.allocate<bf16>(a_elems);
    bf16* b = arena.allocate<bf16>(b_elems);
    void* cc = arena.allocate(c_bytes);
    fill_tiled(a, a_elems, pa);
    fill_tiled(b, b_elems, pb);
    QT_CHECK_CUDA(cudaMemset(cc, 0, c_bytes));
    As.push_back(a);
    Bs.push_back(b);
    Cs.push_back(cc);
  }
  // The fills ran on the legacy default stream, which the (non-blocking) stream below does not
  // wait for.
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  qt::cuda::Stream stream;
  const double flop = 2.0 * c.M * c.N * c.K;
  const double tol = c.f32_out ? 1e-4 : 1e-2;
  // A batch of launches per timed iteration: at least ~2 ms of work at ~600 TFLOP/s.
  const int reps = static_cast<int>(std::clamp(std::ceil(2e-3 / (flop / 600e12)), 1.0, 64.0));
  qt::cuda::Event start(true), stop(true);
  int next = 0;
  auto time_batch = [&] {  // seconds per GEMM over one batch
    start.record(stream.get());
    for (int r = 0; r < reps; ++r, next = (next + 1) % sets)
      run_gemm(c, As[next], Bs[next], Cs[next], stream.get());
    stop.record(stream.get());
    stop.synchronize();
    return stop.elapsed_ms_since(start) * 1e-3 / reps;
  };
  auto validate_once = [&]() -> double {  // C = 0, one GEMM, sampled check
    QT_CHECK_CUDA(cudaMemsetAsync(Cs[0], 0, c_bytes, stream.get()));
    run_gemm(c, As[0], Bs[0], Cs[0], stream.get());
    stream.synchronize();
    return validate(c, static_cast<const bf16*>(Cs[0]), pa, pb);
  };

  // 1. The heuristic's first choice: validated, warmed up, median of 9 batches.
  double err = validate_once();
  if (!(err <= tol)) {
    state.SkipWithError(("validation failed (heuristic algorithm): relative error " + std::to_string(err)).c_str());
    return;
  }
  for (int w = 0; w < 3; ++w) time_batch();
  std::vector<double> heur;
  for (int b = 0; b < 9; ++b) heur.push_back(time_batch());
  std::sort(heur.begin(), heur.end());
  const double heur_s = heur[heur.size() / 2];

  // 2. The fastest of the heuristic's first 8 algorithms (GemmContext::tune), validated again.
  const std::vector<float> algo_ms = qt::cuda::GemmContext::current().tune(
      args_of(c, As[0], Bs[0], Cs[0]), stream.get(), 8, std::max(2, reps));
  err = validate_once();
  if (!(err <= tol)) {
    state.SkipWithError(("validation failed (tuned algorithm): relative error " + std::to_string(err)).c_str());
    return;
  }
  for (int w = 0; w < 3; ++w) time_batch();
  std::vector<double> per_gemm_s;
  for (auto _ : state) {
    const double s = time_batch();
    per_gemm_s.push_back(s);
    state.SetIterationTime(s);
  }
  QT_CHECK_LAUNCH();
  std::sort(per_gemm_s.begin(), per_gemm_s.end());
  const double median = per_gemm_s[per_gemm_s.size() / 2];
  state.counters["TFLOPS"] = flop / median * 1e-12;
  state.counters["TFLOPS_heuristic"] = flop / heur_s * 1e-12;
  state.counters["GFLOP"] = flop * 1e-9;
  state.counters["rel_err"] = err;
  state.counters["algos"] = static_cast<double>(algo_ms.size());
  g_results[c.name] = Result{c.M, c.N, c.K, median * 1e3, flop / median * 1e-12, flop / heur_s * 1e-12};
}

struct Model {
  const char* name;
  int hidden, q_out, kv_out, inter;
};

std::vector<Case> cases() {
  std::vector<Case> v;
  // The ceiling: the forward layout (x W^T) and plain NN, bf16 out.
  v.push_back({"ceiling/8192^3/TN", false, true, 8192, 8192, 8192, false});
  v.push_back({"ceiling/8192^3/NN", false, false, 8192, 8192, 8192, false});
  const int T = 8192;  // tokens per step
  const int V = 151936;
  const Model models[] = {{"qwen3-0.6b", 1024, 2048, 1024, 3072},
                          {"qwen3-1.7b", 2048, 2048, 1024, 6144},
                          {"qwen3-8b", 4096, 4096, 1024, 12288}};
  for (const Model& m : models) {
    struct Linear {
      const char* name;
      int in, out;
    };
    const Linear layers[] = {{"q_proj", m.hidden, m.q_out},       {"kv_proj", m.hidden, m.kv_out},
                             {"o_proj", m.q_out, m.hidden},       {"gate_up_proj", m.hidden, m.inter},
                             {"down_proj", m.inter, m.hidden},    {"lm_head", m.hidden, V}};
    for (const Linear& l : layers) {
      const std::string base = std::string(m.name) + "/" + l.name + "/";
      v.push_back({base + "fwd", false, true, T, l.out, l.in, false});     // y[T,out] = x W^T
      v.push_back({base + "bwd_dx", false, false, T, l.in, l.out, false}); // dx[T,in] = dy W
      v.push_back({base + "bwd_dw", true, false, l.out, l.in, T, true});   // dw[out,in] += dy^T x
    }
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("qtrain_bench_gemm_cuda: no CUDA GPU present; nothing to measure\n");
    return 0;
  }
  qt::cuda::select_device(0);
  const qt::cuda::DeviceInfo info = qt::cuda::device_info();
  benchmark::AddCustomContext("device", info.name);
  benchmark::AddCustomContext("sm_count", std::to_string(info.sm_count));
  static const std::vector<Case> all = cases();
  for (const Case& c : all) {
    benchmark::RegisterBenchmark(("BM_Gemm/" + c.name).c_str(), BM_Gemm, c)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(c.M == 8192 && c.N == 8192 && c.K == 8192 ? 100 : 25);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf("\nbf16 GEMM through cuBLASLt on %s (%d SMs); median per GEMM, FLOPs = 2MNK;\n"
              "heuristic = cuBLASLt's first choice, tuned = fastest of its first 8 (ms is tuned)\n",
              info.name.c_str(), info.sm_count);
  std::printf("%-32s %7s %7s %7s %9s %10s %9s\n", "case", "M", "N", "K", "ms", "heuristic", "tuned");
  for (const Case& c : all) {
    auto it = g_results.find(c.name);
    if (it == g_results.end()) continue;
    const Result& r = it->second;
    std::printf("%-32s %7d %7d %7d %9.4f %10.1f %9.1f\n", c.name.c_str(), r.M, r.N, r.K, r.ms,
                r.tflops_heur, r.tflops);
  }
  auto ceiling = g_results.find("ceiling/8192^3/TN");
  if (ceiling != g_results.end())
    std::printf("measured cuBLAS ceiling (8192^3 TN, bf16 in/out, fp32 accumulate): %.1f TFLOP/s "
                "tuned, %.1f heuristic\n",
                ceiling->second.tflops, ceiling->second.tflops_heur);
  return 0;
}
