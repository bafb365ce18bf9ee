// bf16 GEMM throughput through cuBLASLt (qt::cuda::gemm): the measured ceiling (8192^3) that the
// model benchmark prints beside MFU, and the Qwen3-0.6B / 1.7B / 8B linear layers at 8192 tokens,
// forward (y = x W^T, bf16 out) and the two backward GEMMs (dx = dy W, bf16 out; dw += dy^T x,
// fp32 out). FLOPs = 2 M N K. Times come from CUDA events (UseManualTime) around batches of
// GEMMs, after a warm-up; inputs rotate over several buffer sets when one set would sit in L2.
// Every case validates sampled outputs against double dot products once before it is timed.
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
  double ms, tflops;
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

void BM_Gemm(benchmark::State& state, const Case& c) {
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
  qt::cuda::Stream stream;
  run_gemm(c, As[0], Bs[0], Cs[0], stream.get());
  stream.synchronize();
  const double err = validate(c, static_cast<const bf16*>(Cs[0]), pa, pb);
  const double tol = c.f32_out ? 1e-4 : 1e-2;
  if (!(err <= tol)) {
    state.SkipWithError(("validation failed: relative error " + std::to_string(err)).c_str());
    return;
  }
  const double flop = 2.0 * c.M * c.N * c.K;
  // A batch of launches per timed iteration: at least ~2 ms of work at ~600 TFLOP/s.
  const int reps = static_cast<int>(std::clamp(std::ceil(2e-3 / (flop / 600e12)), 1.0, 64.0));
  for (int w = 0; w < 3 * reps; ++w) run_gemm(c, As[w % sets], Bs[w % sets], Cs[w % sets], stream.get());
  stream.synchronize();

  qt::cuda::Event start(true), stop(true);
  std::vector<double> per_gemm_s;
  int next = 0;
  for (auto _ : state) {
    start.record(stream.get());
    for (int r = 0; r < reps; ++r, next = (next + 1) % sets)
      run_gemm(c, As[next], Bs[next], Cs[next], stream.get());
    stop.record(stream.get());
    stop.synchronize();
    const double s = stop.elapsed_ms_since(start) * 1e-3 / reps;
    per_gemm_s.push_back(s);
    state.SetIterationTime(s);
  }
  QT_CHECK_LAUNCH();
  std::sort(per_gemm_s.begin(), per_gemm_s.end());
  const double median = per_gemm_s[per_gemm_s.size() / 2];
  state.counters["TFLOPS"] = flop / median * 1e-12;
  state.counters["GFLOP"] = flop * 1e-9;
  state.counters["rel_err"] = err;
  state.counters["sets"] = sets;
  g_results[c.name] = Result{c.M, c.N, c.K, median * 1e3, flop / median * 1e-12};
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

  std::printf("\nbf16 GEMM through cuBLASLt on %s (%d SMs); median per GEMM, FLOPs = 2MNK\n",
              info.name.c_str(), info.sm_count);
  std::printf("%-32s %7s %7s %7s %10s %9s\n", "case", "M", "N", "K", "ms", "TFLOP/s");
  for (const Case& c : all) {
    auto it = g_results.find(c.name);
    if (it == g_results.end()) continue;
    const Result& r = it->second;
    std::printf("%-32s %7d %7d %7d %10.4f %9.1f\n", c.name.c_str(), r.M, r.N, r.K, r.ms, r.tflops);
  }
  auto ceiling = g_results.find("ceiling/8192^3/TN");
  if (ceiling != g_results.end())
    std::printf("measured cuBLAS ceiling (8192^3, bf16 in/out, fp32 accumulate): %.1f TFLOP/s\n",
                ceiling->second.tflops);
  return 0;
}
