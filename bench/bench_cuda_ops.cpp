// Achieved memory bandwidth of the memory-bound CUDA ops (everything but GEMM and attention) at
// Qwen3-0.6B, Qwen3-1.7B and Qwen3-8B sizes: 8192 tokens, H = 1024 / 2048 / 4096, I = 3072 / 6144 /
// 12288, 16 q heads of 128, V = 151936, and the whole parameter count (for the 8B: the 8 layers
// of the training benchmark) for AdamW, the gradient norm and the conversions.
// Bytes are the fewest the op must move (each input read once, each output written once); GB/s
// is that over the median time per call (CUDA events around batches of calls that rotate over
// enough buffer sets to defeat L2; UseManualTime), printed against the measured
// device-to-device copy ceiling and the datasheet peak. Every case
// checks once that its outputs are finite before it is timed (the tests check the values).
//
//   qtrain_bench_cuda_ops [--benchmark_filter=...] [--benchmark_out=ops.json]
#include <benchmark/benchmark.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "ops/cuda/adamw.cuh"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/cross_entropy.cuh"
#include "ops/cuda/embedding.cuh"
#include "ops/cuda/qk_norm_rope.cuh"
#include "ops/cuda/rmsnorm.cuh"
#include "ops/cuda/swiglu.cuh"

namespace {

using qt::cuda::bf16;
using qt::cuda::DeviceBuffer;

constexpr int kTokens = 8192;
constexpr int kVocab = 151936;
constexpr int kHeads = 16, kHeadDim = 128;
constexpr int kIters = 30;
constexpr std::size_t kPeriod = std::size_t{1} << 20;  // elements of the random input pattern

// One unit-normal pattern of kPeriod values, drawn once.
const std::vector<double>& unit_pattern() {
  static const std::vector<double> pat = [] {
    std::mt19937_64 rng(42);
    std::normal_distribution<double> d(0.0, 1.0);
    std::vector<double> p(kPeriod);
    for (auto& v : p) v = d(rng);
    return p;
  }();
  return pat;
}

// Fills n elements by tiling the pattern (scaled, rotated by `seed` so that buffers differ):
// one upload, then doubling device copies.
template <typename T>
void fill_tiled(T* dst, std::size_t n, double scale, bool positive, std::uint64_t seed) {
  const std::vector<double>& unit = unit_pattern();
  const std::size_t first = std::min(n, kPeriod);
  std::vector<T> pat(first);
  for (std::size_t i = 0; i < first; ++i) {
    double x = scale * unit[(i + seed * 7919) % kPeriod];
    if (positive) x = std::abs(x);
    if constexpr (std::is_same_v<T, bf16>)
      pat[i] = __float2bfloat16_rn(static_cast<float>(x));
    else
      pat[i] = static_cast<T>(x);
  }
  QT_CHECK_CUDA(cudaMemcpy(dst, pat.data(), first * sizeof(T), cudaMemcpyHostToDevice));
  for (std::size_t done = first; done < n;) {
    const std::size_t chunk = std::min(done, n - done);
    QT_CHECK_CUDA(cudaMemcpy(dst + done, dst, chunk * sizeof(T), cudaMemcpyDeviceToDevice));
    done += chunk;
  }
}

std::uint64_t g_seed = 0;

// The buffers of one case, freed with it.
class Buffers {
 public:
  template <typename T>
  T* make(std::size_t n, double scale = 1.0, bool positive = false) {
    bufs_.emplace_back(std::max<std::size_t>(n * sizeof(T), 256), "bench buffer");
    T* p = static_cast<T*>(bufs_.back().get());
    fill_tiled(p, n, scale, positive, ++g_seed);
    return p;
  }
  // Uninitialised scratch (workspaces).
  char* raw(std::size_t bytes) {
    bufs_.emplace_back(std::max<std::size_t>(bytes, 256), "bench scratch");
    return static_cast<char*>(bufs_.back().get());
  }
  std::int32_t* ids(int n, int v) {
    bufs_.emplace_back(n * sizeof(std::int32_t), "bench ids");
    std::mt19937_64 rng(7);
    std::uniform_int_distribution<int> pick(0, v - 1);
    std::vector<std::int32_t> h(n);
    for (auto& x : h) x = pick(rng);
    QT_CHECK_CUDA(cudaMemcpy(bufs_.back().get(), h.data(), n * 4, cudaMemcpyHostToDevice));
    return static_cast<std::int32_t*>(bufs_.back().get());
  }

 private:
  std::vector<DeviceBuffer> bufs_;
};

// One prepared case: `run` launches the op once; `finite` names an output to check.
struct Prepared {
  std::unique_ptr<Buffers> mem = std::make_unique<Buffers>();
  double bytes = 0;
  std::function<void(cudaStream_t)> run;
  std::function<bool()> finite;
};

template <typename T>
bool all_finite(const T* d, std::size_t n) {
  n = std::min<std::size_t>(n, 1 << 20);
  std::vector<T> h(n);
  QT_CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  for (const T& x : h) {
    double v;
    if constexpr (std::is_same_v<T, bf16>)
      v = __bfloat162float(x);
    else
      v = static_cast<double>(x);
    if (!std::isfinite(v)) return false;
  }
  return true;
}

struct Model {
  const char* name;
  int H, I;
  std::size_t params;  // parameter count (spec table)
};
// qwen3-8b-L8: the 8 Qwen3-8B-shaped layers of the training benchmark (untied embedding and lm
// head, 2 x 151936 x 4096, plus 8 layers of 192946432 and the final norm); its AdamW case needs
// about 50 GB of device memory.
const Model kModels[] = {{"qwen3-0.6b", 1024, 3072, 596049920},
                         {"qwen3-1.7b", 2048, 6144, 1720574976},
                         {"qwen3-8b-L8", 4096, 12288, 2788235264}};

struct Result {
  double bytes, us, gbs;
};
std::map<std::string, Result> g_results;
std::vector<std::string> g_order;
double g_copy_gbs = 0;

// Inputs and outputs of one call: `sets` copies so that the working set of a timed batch is at
// least 256 MB (several times L2), used round robin by back-to-back calls; a batch is at least 8
// calls. So each call finds its inputs in HBM, and the write-back of its outputs is paid inside
// the batch, as in a training step.
void BM_Op(benchmark::State& state, const std::string& name,
           const std::function<Prepared()>& prepare) {
  std::vector<Prepared> inst;
  inst.push_back(prepare());
  const double bytes = inst[0].bytes;
  const int sets = static_cast<int>(std::clamp(std::ceil(256e6 / bytes), 1.0, 16.0));
  while (static_cast<int>(inst.size()) < sets) inst.push_back(prepare());
  const int reps = sets * std::max(1, (8 + sets - 1) / sets);
  qt::cuda::Stream stream;
  for (Prepared& p : inst) p.run(stream.get());
  stream.synchronize();
  if (!inst[0].finite()) {
    state.SkipWithError("output not finite");
    return;
  }
  qt::cuda::Event start(true), stop(true);
  std::vector<double> t;
  for (auto _ : state) {
    start.record(stream.get());
    for (int r = 0; r < reps; ++r) inst[r % sets].run(stream.get());
    stop.record(stream.get());
    stop.synchronize();
    const double s = stop.elapsed_ms_since(start) * 1e-3 / reps;
    t.push_back(s);
    state.SetIterationTime(s);
  }
  QT_CHECK_LAUNCH();
  std::sort(t.begin(), t.end());
  const double median = t[t.size() / 2];
  state.counters["GB/s"] = bytes / median * 1e-9;
  state.counters["MB"] = bytes * 1e-6;
  state.counters["sets"] = sets;
  if (!g_results.count(name)) g_order.push_back(name);
  g_results[name] = Result{bytes, median * 1e6, bytes / median * 1e-9};
  if (name == "copy/d2d-1GiB") g_copy_gbs = bytes / median * 1e-9;
}

void add(const std::string& name, std::function<Prepared()> prepare) {
  benchmark::RegisterBenchmark(("BM_CudaOp/" + name).c_str(),
                               [name, prepare](benchmark::State& s) { BM_Op(s, name, prepare); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->Iterations(kIters);
}

void register_cases() {
  add("copy/d2d-1GiB", [] {
    Prepared p;
    const std::size_t n = std::size_t{1} << 28;  // floats
    float* a = p.mem->make<float>(n);
    float* b = p.mem->make<float>(n);
    p.bytes = 2.0 * n * 4;
    p.run = [=](cudaStream_t s) {
      QT_CHECK_CUDA(cudaMemcpyAsync(b, a, n * 4, cudaMemcpyDeviceToDevice, s));
    };
    p.finite = [=] { return all_finite(b, n); };
    return p;
  });
  const int N = kTokens;
  for (const Model& m : kModels) {
    const std::string base = std::string(m.name) + "/";
    const int H = m.H, I = m.I;
    const std::size_t nh = std::size_t(N) * H, ni = std::size_t(N) * I;
    add(base + "rmsnorm_fwd", [=] {
      Prepared p;
      bf16 *x = p.mem->make<bf16>(nh), *w = p.mem->make<bf16>(H), *y = p.mem->make<bf16>(nh);
      float* r = p.mem->make<float>(N);
      p.bytes = 2.0 * nh * 2 + N * 4.0 + H * 2.0;
      p.run = [=](cudaStream_t s) { qt::cuda::rmsnorm_forward(y, r, x, w, N, H, 1e-6, s); };
      p.finite = [=] { return all_finite(y, nh) && all_finite(r, N); };
      return p;
    });
    add(base + "residual_rmsnorm_fwd", [=] {
      Prepared p;
      bf16 *res = p.mem->make<bf16>(nh), *x = p.mem->make<bf16>(nh), *w = p.mem->make<bf16>(H);
      bf16* y = p.mem->make<bf16>(nh);
      float* r = p.mem->make<float>(N);
      p.bytes = 4.0 * nh * 2 + N * 4.0 + H * 2.0;  // residual in place: read, written
      p.run = [=](cudaStream_t s) {
        qt::cuda::residual_rmsnorm_forward(res, y, r, res, x, w, N, H, 1e-6, s);
      };
      p.finite = [=] { return all_finite(y, nh); };
      return p;
    });
    // The plain backward, and the residual one training runs for both norms of a layer (which
    // also reads and writes the residual gradient).
    for (const bool residual : {false, true})
      add(base + (residual ? "residual_rmsnorm_bwd" : "rmsnorm_bwd"), [=] {
        Prepared p;
        bf16 *x = p.mem->make<bf16>(nh), *w = p.mem->make<bf16>(H), *dy = p.mem->make<bf16>(nh);
        bf16* dx = p.mem->make<bf16>(nh);
        float *r = p.mem->make<float>(N, 1.0, true), *dw = p.mem->make<float>(H);
        char* ws = p.mem->raw(qt::cuda::rmsnorm_backward_workspace_bytes(N, H));
        p.bytes = (residual ? 4.0 : 3.0) * nh * 2 + N * 4.0;
        p.run = [=](cudaStream_t s) {
          if (residual)
            qt::cuda::residual_rmsnorm_backward(dx, dw, dy, x, w, r, N, H, ws, s);
          else
            qt::cuda::rmsnorm_backward(dx, dw, dy, x, w, r, N, H, ws, s);
        };
        p.finite = [=] { return all_finite(dx, nh) && all_finite(dw, H); };
        return p;
      });
    const std::size_t nq = std::size_t(N) * kHeads * kHeadDim;
    auto tables = [](Buffers& mem) {
      const int half = kHeadDim / 2;
      float* cs = mem.make<float>(std::size_t(kTokens) * half * 2);
      return cs;  // cos then sin, [kTokens, hd/2] each
    };
    add(base + "qk_norm_rope_fwd(q)", [=] {
      Prepared p;
      bf16 *x = p.mem->make<bf16>(nq), *w = p.mem->make<bf16>(kHeadDim);
      bf16* out = p.mem->make<bf16>(nq);
      float* r = p.mem->make<float>(std::size_t(N) * kHeads);
      float* cs = tables(*p.mem);
      const float* sn = cs + std::size_t(kTokens) * kHeadDim / 2;
      p.bytes = 2.0 * nq * 2 + N * kHeads * 4.0;
      p.run = [=](cudaStream_t s) {
        qt::cuda::qk_norm_rope_forward(out, r, x, w, cs, sn, nullptr, 1, N, kHeads, kHeadDim, 1e-6,
                                       s);
      };
      p.finite = [=] { return all_finite(out, nq); };
      return p;
    });
    add(base + "qk_norm_rope_bwd(q)", [=] {
      Prepared p;
      bf16 *x = p.mem->make<bf16>(nq), *w = p.mem->make<bf16>(kHeadDim);
      bf16 *dout = p.mem->make<bf16>(nq), *dx = p.mem->make<bf16>(nq);
      float* r = p.mem->make<float>(std::size_t(N) * kHeads, 1.0, true);
      float* dw = p.mem->make<float>(kHeadDim);
      float* cs = tables(*p.mem);
      const float* sn = cs + std::size_t(kTokens) * kHeadDim / 2;
      char* ws =
          p.mem->raw(qt::cuda::qk_norm_rope_backward_workspace_bytes(1, N, kHeads, kHeadDim));
      p.bytes = 3.0 * nq * 2 + N * kHeads * 4.0;
      p.run = [=](cudaStream_t s) {
        qt::cuda::qk_norm_rope_backward(dx, dw, dout, x, w, r, cs, sn, nullptr, 1, N, kHeads,
                                        kHeadDim, ws, s);
      };
      p.finite = [=] { return all_finite(dx, nq) && all_finite(dw, kHeadDim); };
      return p;
    });
    add(base + "swiglu_fwd", [=] {
      Prepared p;
      bf16 *g = p.mem->make<bf16>(ni, 2.0), *u = p.mem->make<bf16>(ni), *h = p.mem->make<bf16>(ni);
      p.bytes = 3.0 * ni * 2;
      p.run = [=](cudaStream_t s) { qt::cuda::swiglu_forward(h, g, u, N, I, s); };
      p.finite = [=] { return all_finite(h, ni); };
      return p;
    });
    add(base + "swiglu_bwd", [=] {
      Prepared p;
      bf16 *g = p.mem->make<bf16>(ni, 2.0), *u = p.mem->make<bf16>(ni), *dh = p.mem->make<bf16>(ni);
      bf16 *dg = p.mem->make<bf16>(ni), *du = p.mem->make<bf16>(ni);
      p.bytes = 5.0 * ni * 2;
      p.run = [=](cudaStream_t s) { qt::cuda::swiglu_backward(dg, du, dh, g, u, N, I, s); };
      p.finite = [=] { return all_finite(dg, ni) && all_finite(du, ni); };
      return p;
    });
    add(base + "embedding_fwd", [=] {
      Prepared p;
      bf16 *wte = p.mem->make<bf16>(std::size_t(kVocab) * H), *x = p.mem->make<bf16>(nh);
      std::int32_t* ids = p.mem->ids(N, kVocab);
      p.bytes = 2.0 * nh * 2 + N * 4.0;
      p.run = [=](cudaStream_t s) { qt::cuda::embedding_forward(x, ids, wte, N, H, s); };
      p.finite = [=] { return all_finite(x, nh); };
      return p;
    });
    add(base + "embedding_bwd", [=] {
      Prepared p;
      float* dwte = p.mem->make<float>(std::size_t(kVocab) * H);
      bf16* dx = p.mem->make<bf16>(nh);
      std::int32_t* ids = p.mem->ids(N, kVocab);
      const std::size_t wsb = qt::cuda::embedding_backward_workspace_bytes(N);
      char* ws = p.mem->raw(wsb);
      p.bytes = nh * 2.0 + 2.0 * nh * 4 + N * 4.0;  // dx read; one dwte row per token r+w
      p.run = [=](cudaStream_t s) {
        qt::cuda::embedding_backward(dwte, dx, ids, N, H, ws, wsb, s);
      };
      p.finite = [=] { return all_finite(dwte, std::size_t(kVocab) * H); };
      return p;
    });
    add(base + "adamw_step", [=] {
      Prepared p;
      const std::size_t n = m.params;
      float *w = p.mem->make<float>(n, 0.02), *g = p.mem->make<float>(n, 1e-3);
      float *mm = p.mem->make<float>(n, 1e-3), *v = p.mem->make<float>(n, 1e-6, true);
      bf16* wb = p.mem->make<bf16>(n);
      auto* seg =
          reinterpret_cast<qt::cuda::AdamWSegment*>(p.mem->raw(sizeof(qt::cuda::AdamWSegment)));
      const qt::cuda::AdamWSegment hs{0, n / 2, 1};
      QT_CHECK_CUDA(cudaMemcpy(seg, &hs, sizeof(hs), cudaMemcpyHostToDevice));
      p.bytes = n * (16.0 + 14.0);  // p, g, m, v read; p, m, v, bf16 p written
      p.run = [=](cudaStream_t s) {
        qt::cuda::AdamWStepArgs a;
        a.lr = 1e-4;
        a.weight_decay = 0.1;
        a.step = 10;
        qt::cuda::adamw_step(w, wb, mm, v, g, n, 0, seg, 1, a, s);
      };
      p.finite = [=] { return all_finite(w, n) && all_finite(wb, n); };
      return p;
    });
    add(base + "grad_norm_squared", [=] {
      Prepared p;
      const std::size_t n = m.params;
      float* g = p.mem->make<float>(n, 1e-3);
      char* ws = p.mem->raw(qt::cuda::grad_norm_workspace_bytes());
      double* out = p.mem->make<double>(1);
      p.bytes = n * 4.0;
      p.run = [=](cudaStream_t s) { qt::cuda::grad_norm_squared(out, g, n, ws, s); };
      p.finite = [=] { return all_finite(out, 1); };
      return p;
    });
    add(base + "convert_f32_to_bf16", [=] {
      Prepared p;
      const std::size_t n = m.params;
      float* a = p.mem->make<float>(n);
      bf16* b = p.mem->make<bf16>(n);
      p.bytes = n * 6.0;
      p.run = [=](cudaStream_t s) { qt::cuda::convert_f32_to_bf16(b, a, n, s); };
      p.finite = [=] { return all_finite(b, n); };
      return p;
    });
    add(base + "convert_bf16_to_f32", [=] {
      Prepared p;
      const std::size_t n = m.params;
      bf16* a = p.mem->make<bf16>(n);
      float* b = p.mem->make<float>(n);
      p.bytes = n * 6.0;
      p.run = [=](cudaStream_t s) { qt::cuda::convert_bf16_to_f32(b, a, n, s); };
      p.finite = [=] { return all_finite(b, n); };
      return p;
    });
  }
  // Cross-entropy does not depend on the model below the lm-head: one size, V = 151936.
  const std::size_t nv = std::size_t(N) * kVocab;
  // The buffers of one cross-entropy case: logits [N, V] bf16, targets, losses, lse, loss sum.
  struct Ce {
    bf16* logits;
    std::int32_t* t;
    float *loss, *lse;
    double* sum;
  };
  auto ce_buffers = [=](Prepared& p) {
    return Ce{p.mem->make<bf16>(nv, 2.0), p.mem->ids(N, kVocab), p.mem->make<float>(N),
              p.mem->make<float>(N), p.mem->make<double>(1)};
  };
  add("cross_entropy_fwd(V=151936)", [=] {
    Prepared p;
    const Ce c = ce_buffers(p);
    p.bytes = nv * 2.0 + N * 12.0;
    p.run = [=](cudaStream_t s) {
      qt::cuda::cross_entropy_forward(c.loss, c.lse, c.logits, c.t, N, kVocab, c.sum, s);
    };
    p.finite = [=] { return all_finite(c.loss, N) && all_finite(c.lse, N); };
    return p;
  });
  add("cross_entropy_bwd(V=151936,in place)", [=] {
    Prepared p;
    const Ce c = ce_buffers(p);
    qt::cuda::cross_entropy_forward(c.loss, c.lse, c.logits, c.t, N, kVocab, nullptr, nullptr);
    p.bytes = 2.0 * nv * 2 + N * 8.0;
    // In place, as the fused lm-head will call it; after the first call the logits hold
    // gradients, which only changes the values, not the work.
    p.run = [=](cudaStream_t s) {
      qt::cuda::cross_entropy_backward(c.logits, c.logits, c.lse, c.t, 1.0f / N, N, kVocab, s);
    };
    p.finite = [=] { return all_finite(c.logits, nv); };
    return p;
  });
  add("cross_entropy_fwd_bwd(V=151936,in place)", [=] {
    Prepared p;
    const Ce c = ce_buffers(p);
    p.bytes = 2.0 * nv * 2 + N * 12.0;  // what memory must move: the logits in, the gradient out
    p.run = [=](cudaStream_t s) {
      qt::cuda::cross_entropy_forward_backward(c.loss, c.lse, c.logits, c.t, 1.0f / N, N, kVocab,
                                               c.sum, s);
    };
    p.finite = [=] { return all_finite(c.loss, N) && all_finite(c.logits, nv); };
    return p;
  });
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("qtrain_bench_cuda_ops: no CUDA GPU present; nothing to measure\n");
    return 0;
  }
  qt::cuda::select_device(0);
  const qt::cuda::DeviceInfo info = qt::cuda::device_info();
  // Datasheet HBM bandwidth: H100 SXM 3.35 TB/s, H200 4.8 TB/s.
  const double peak = info.name.find("H200") != std::string::npos ? 4800.0 : 3350.0;
  benchmark::AddCustomContext("device", info.name);
  register_cases();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf(
      "\nMemory-bound CUDA ops on %s (%d SMs), %d tokens; median of %d batches, inputs "
      "rotated past L2\n",
      info.name.c_str(), info.sm_count, kTokens, kIters);
  std::printf("device-to-device copy ceiling: %.0f GB/s; datasheet peak %.0f GB/s\n", g_copy_gbs,
              peak);
  std::printf("%-42s %10s %10s %8s %7s %7s\n", "op", "MB moved", "us", "GB/s", "%copy", "%peak");
  for (const std::string& name : g_order) {
    const Result& r = g_results[name];
    std::printf("%-42s %10.1f %10.1f %8.0f %6.0f%% %6.0f%%\n", name.c_str(), r.bytes * 1e-6, r.us,
                r.gbs, g_copy_gbs > 0 ? 100.0 * r.gbs / g_copy_gbs : 0.0, 100.0 * r.gbs / peak);
  }
  return 0;
}
