// Fused causal GQA flash attention on the GPU (src/ops/cuda/attention_*.cu): forward, backward and
// forward+backward TFLOP/s at Qwen3 shapes, B * T = 8192 tokens, hd 128. Causal FLOPs:
//   forward  = 4 * B * nh * T^2 * hd / 2      (QK^T and PV, lower triangle)
//   backward = 2.5 * forward                  (FA2 convention: 5 products of the same size)
//   fwd+bwd  = 3.5 * forward
// These are the FLOPs of the math, not of the kernels: the deterministic backward recomputes
// QK^T and dO V^T in its dQ pass (7 products, not 5), which the formula does not count.
// Packed shapes (".../T4096_B2_doc1024"): every row holds T / doc documents of doc tokens (pos
// passed to the kernels); their FLOPs count each document's triangle only (T^2 above becomes
// T * doc), so the TFLOP/s compare with the causal ones and the ms show the time saved by the
// skipped tiles.
// Both kernel paths are timed: "mma" (mma.sync, any GPU; wN / kvXqY block shapes) and "wgmma"
// (sm_90a, where the build and the device have it).
// Each shape and block configuration is validated once before it is timed: out, lse and dq on
// sampled rows against a per-row double reference, and every output finite. Timed with CUDA
// events (UseManualTime); each iteration runs the op `kReps` times back to back.
// bench/baselines/sdpa_attention.py measures PyTorch SDPA on the same shapes.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "ops/cuda/attention.cuh"

namespace {

using qt::cuda::AttentionConfig;
using qt::cuda::AttentionPath;
using qt::cuda::bf16;

// One iteration runs the op kReps times between two events and reports the time per run, so the
// wall time of a case is about kReps * kMinTime plus its validation.
constexpr int kReps = 5;
constexpr double kMinTime = 0.05;

std::uint16_t bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
double bf16_value(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Unit-variance noise (Irwin-Hall of 4 uniforms from splitmix64), rounded to bf16.
std::vector<std::uint16_t> noise(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint16_t> v(n);
  std::uint64_t s = seed;
  for (auto& x : v) {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    double sum = 0.0;
    for (int i = 0; i < 4; ++i) sum += static_cast<double>((z >> (16 * i)) & 0xFFFF) / 65535.0;
    x = bf16_bits(static_cast<float>((sum - 2.0) * 1.7320508075688772));
  }
  return v;
}

struct Shape {
  int B, T, nh, nkv, hd;
  int doc = 0;  // packed: documents of `doc` tokens (T a multiple); 0: one causal row (no pos)
  std::string name() const {
    return "nh" + std::to_string(nh) + "_nkv" + std::to_string(nkv) + "/T" + std::to_string(T) +
           "_B" + std::to_string(B) + (doc ? "_doc" + std::to_string(doc) : "");
  }
  double fwd_flops() const {
    return 4.0 * B * nh * static_cast<double>(T) * (doc ? doc : T) * hd / 2.0;
  }
  int doc_start(int t) const { return doc ? t - t % doc : 0; }  // first key of query t
};

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t bytes) { QT_CHECK_CUDA(cudaMalloc(&p, bytes)); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  bf16* b() { return static_cast<bf16*>(p); }
  float* f() { return static_cast<float*>(p); }
};

// Device tensors of one shape, with host copies of the inputs for validation.
struct Problem {
  Shape s;
  std::size_t nq, nkv, nl;
  std::vector<std::uint16_t> hq, hk, hv, hdo;
  DevBuf q, k, v, dout, out, dq, dk, dv, lse, pos;
  explicit Problem(const Shape& sh)
      : s(sh),
        nq(static_cast<std::size_t>(sh.B) * sh.T * sh.nh * sh.hd),
        nkv(static_cast<std::size_t>(sh.B) * sh.T * sh.nkv * sh.hd),
        nl(static_cast<std::size_t>(sh.B) * sh.nh * sh.T),
        hq(noise(nq, 11)),
        hk(noise(nkv, 22)),
        hv(noise(nkv, 33)),
        hdo(noise(nq, 44)),
        q(nq * 2),
        k(nkv * 2),
        v(nkv * 2),
        dout(nq * 2),
        out(nq * 2),
        dq(nq * 2),
        dk(nkv * 2),
        dv(nkv * 2),
        lse(nl * 4),
        pos(static_cast<std::size_t>(sh.B) * sh.T * 4) {
    std::vector<std::int32_t> hpos(static_cast<std::size_t>(sh.B) * sh.T);
    for (std::size_t i = 0; i < hpos.size(); ++i) {
      const int t = static_cast<int>(i % sh.T);
      hpos[i] = t - sh.doc_start(t);
    }
    QT_CHECK_CUDA(cudaMemcpy(pos.p, hpos.data(), hpos.size() * 4, cudaMemcpyHostToDevice));
    QT_CHECK_CUDA(cudaMemcpy(q.p, hq.data(), nq * 2, cudaMemcpyHostToDevice));
    QT_CHECK_CUDA(cudaMemcpy(k.p, hk.data(), nkv * 2, cudaMemcpyHostToDevice));
    QT_CHECK_CUDA(cudaMemcpy(v.p, hv.data(), nkv * 2, cudaMemcpyHostToDevice));
    QT_CHECK_CUDA(cudaMemcpy(dout.p, hdo.data(), nq * 2, cudaMemcpyHostToDevice));
  }
  const std::int32_t* dpos() const {
    return s.doc ? static_cast<const std::int32_t*>(pos.p) : nullptr;
  }
  void forward(const AttentionConfig& c, cudaStream_t st) {
    qt::cuda::attention_forward(out.b(), lse.f(), q.b(), k.b(), v.b(), s.B, s.T, s.nh, s.nkv, s.hd,
                                c, st, dpos());
  }
  void backward(const AttentionConfig& c, cudaStream_t st) {
    qt::cuda::attention_backward(dq.b(), dk.b(), dv.b(), dout.b(), q.b(), k.b(), v.b(), out.b(),
                                 lse.f(), s.B, s.T, s.nh, s.nkv, s.hd, c, st, dpos());
  }
};

// Reference of one query row (b, t, head h) in double: out, lse and dq.
struct RowRef {
  int b, t, h;
  std::vector<double> out, dq;
  double lse = 0.0;
};
RowRef row_reference(const Problem& p, int b, int t, int h) {
  const Shape& s = p.s;
  const int g = h / (s.nh / s.nkv), hd = s.hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  auto at_q = [&](const std::vector<std::uint16_t>& x, int tt, int d) {
    return bf16_value(x[((static_cast<std::size_t>(b) * s.T + tt) * s.nh + h) * hd + d]);
  };
  auto at_kv = [&](const std::vector<std::uint16_t>& x, int tt, int d) {
    return bf16_value(x[((static_cast<std::size_t>(b) * s.T + tt) * s.nkv + g) * hd + d]);
  };
  RowRef r{b, t, h, std::vector<double>(hd, 0.0), std::vector<double>(hd, 0.0)};
  const int j0 = s.doc_start(t);  // keys j0 .. t; sc[j] stays 0 (unused) below j0
  std::vector<double> sc(t + 1);
  double m = -1e300;
  for (int j = j0; j <= t; ++j) {
    double a = 0.0;
    for (int d = 0; d < hd; ++d) a += at_q(p.hq, t, d) * at_kv(p.hk, j, d);
    sc[j] = a * scale;
    m = std::max(m, sc[j]);
  }
  double sum = 0.0;
  for (int j = j0; j <= t; ++j) sum += std::exp(sc[j] - m);
  r.lse = m + std::log(sum);
  for (int j = j0; j <= t; ++j) {
    sc[j] = std::exp(sc[j] - r.lse);
    for (int d = 0; d < hd; ++d) r.out[d] += sc[j] * at_kv(p.hv, j, d);
  }
  double D = 0.0;
  for (int d = 0; d < hd; ++d) D += at_q(p.hdo, t, d) * r.out[d];
  for (int j = j0; j <= t; ++j) {
    double dp = 0.0;
    for (int d = 0; d < hd; ++d) dp += at_q(p.hdo, t, d) * at_kv(p.hv, j, d);
    const double ds = sc[j] * (dp - D);
    for (int d = 0; d < hd; ++d) r.dq[d] += scale * ds * at_kv(p.hk, j, d);
  }
  return r;
}

// Sampled rows (first and last batch, 4 rows spread over T, 4 heads), computed once per shape.
const std::vector<RowRef>& references(const Problem& p) {
  static std::map<std::string, std::vector<RowRef>> cache;
  auto it = cache.find(p.s.name());
  if (it != cache.end()) return it->second;
  std::vector<std::array<int, 3>> want;
  for (int b : {0, p.s.B - 1})
    for (int t : {0, p.s.T / 3, (2 * p.s.T) / 3, p.s.T - 1})
      for (int h : {0, 1, p.s.nh / 2, p.s.nh - 1}) want.push_back({b, t, h});
  std::vector<RowRef> refs(want.size());
  std::vector<std::thread> pool;
  const int workers = 16;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (std::size_t i = w; i < want.size(); i += workers)
        refs[i] = row_reference(p, want[i][0], want[i][1], want[i][2]);
    });
  for (auto& th : pool) th.join();
  return cache.emplace(p.s.name(), std::move(refs)).first->second;
}

template <typename T>
std::vector<T> download(const void* d, std::size_t n) {
  std::vector<T> h(n);
  QT_CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Runs forward and backward once with `c` and checks them; empty string when right.
std::string validate(Problem& p, const AttentionConfig& c, cudaStream_t st) {
  const Shape& s = p.s;
  QT_CHECK_CUDA(cudaMemsetAsync(p.out.p, 0xFF, p.nq * 2, st));  // NaN poison
  QT_CHECK_CUDA(cudaMemsetAsync(p.dq.p, 0xFF, p.nq * 2, st));
  QT_CHECK_CUDA(cudaMemsetAsync(p.dk.p, 0xFF, p.nkv * 2, st));
  QT_CHECK_CUDA(cudaMemsetAsync(p.dv.p, 0xFF, p.nkv * 2, st));
  p.forward(c, st);
  p.backward(c, st);
  QT_CHECK_CUDA(cudaStreamSynchronize(st));
  const auto out = download<std::uint16_t>(p.out.p, p.nq);
  const auto lse = download<float>(p.lse.p, p.nl);
  const auto dq = download<std::uint16_t>(p.dq.p, p.nq);
  for (const auto* buf : {&out, &dq})
    for (std::uint16_t x : *buf)
      if (!std::isfinite(bf16_value(x))) return "non-finite out or dq";
  for (const auto& x : download<std::uint16_t>(p.dk.p, p.nkv))
    if (!std::isfinite(bf16_value(x))) return "non-finite dk";
  for (const auto& x : download<std::uint16_t>(p.dv.p, p.nkv))
    if (!std::isfinite(bf16_value(x))) return "non-finite dv";
  double no = 0, do_ = 0, nq = 0, dq_ = 0, el = 0;
  for (const RowRef& r : references(p)) {
    const std::size_t base = ((static_cast<std::size_t>(r.b) * s.T + r.t) * s.nh + r.h) * s.hd;
    for (int d = 0; d < s.hd; ++d) {
      no += std::pow(bf16_value(out[base + d]) - r.out[d], 2);
      do_ += r.out[d] * r.out[d];
      nq += std::pow(bf16_value(dq[base + d]) - r.dq[d], 2);
      dq_ += r.dq[d] * r.dq[d];
    }
    const double l = lse[(static_cast<std::size_t>(r.b) * s.nh + r.h) * s.T + r.t];
    el = std::max(el, std::abs(l - r.lse) / std::max(1.0, std::abs(r.lse)));
  }
  const double eo = std::sqrt(no / do_), eq = std::sqrt(nq / dq_);
  if (!(eo < 1e-2) || !(eq < 1e-2) || !(el < 1e-3)) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "validation failed: rel err out %.3e dq %.3e lse %.3e", eo, eq,
                  el);
    return msg;
  }
  return "";
}

enum class Kind { kFwd, kBwd, kFwdBwd };

void run_case(benchmark::State& state, const Shape& shape, Kind kind, AttentionConfig cfg) {
  static std::map<std::string, std::unique_ptr<Problem>> problems;  // one set of buffers at a time
  auto it = problems.find(shape.name());
  if (it == problems.end()) {
    problems.clear();
    it = problems.emplace(shape.name(), std::make_unique<Problem>(shape)).first;
  }
  Problem& p = *it->second;
  cudaStream_t st;
  QT_CHECK_CUDA(cudaStreamCreate(&st));
  const std::string err = validate(p, cfg, st);  // also the warm-up
  if (!err.empty()) {
    state.SkipWithError(err.c_str());
    QT_CHECK_CUDA(cudaStreamDestroy(st));
    return;
  }
  cudaEvent_t e0, e1;
  QT_CHECK_CUDA(cudaEventCreate(&e0));
  QT_CHECK_CUDA(cudaEventCreate(&e1));
  double total_s = 0.0;
  long long runs = 0;
  for (auto _ : state) {
    QT_CHECK_CUDA(cudaEventRecord(e0, st));
    for (int r = 0; r < kReps; ++r) {
      if (kind != Kind::kBwd) p.forward(cfg, st);
      if (kind != Kind::kFwd) p.backward(cfg, st);
    }
    QT_CHECK_CUDA(cudaEventRecord(e1, st));
    QT_CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0.f;
    QT_CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    state.SetIterationTime(ms / 1e3 / kReps);
    total_s += ms / 1e3;
    runs += kReps;
  }
  const double mult = kind == Kind::kFwd ? 1.0 : kind == Kind::kBwd ? 2.5 : 3.5;
  state.counters["TFLOP/s"] = mult * shape.fwd_flops() * runs / total_s / 1e12;
  state.counters["ms"] = total_s / runs * 1e3;
  QT_CHECK_CUDA(cudaEventDestroy(e0));
  QT_CHECK_CUDA(cudaEventDestroy(e1));
  QT_CHECK_CUDA(cudaStreamDestroy(st));
}

}  // namespace

int main(int argc, char** argv) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("no CUDA device: nothing to benchmark\n");
    return 0;
  }
  std::printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  std::printf("causal FLOPs: fwd = 4*B*nh*T^2*hd/2; bwd = 2.5*fwd; fwd+bwd = 3.5*fwd\n");
  std::printf("packed (_docN, documents of N tokens): T^2 becomes T*N in the FLOPs\n");
  const bool wgmma = qt::cuda::attention_wgmma_available();
  std::printf(
      "variants: mma_wN = mma.sync, N warps per forward block; mma_kvXqY = X warps (dK/dV),"
      " Y warps (dQ); wgmma = sm_90a kernels (%s here)\n",
      wgmma ? "available" : "not available");

  // --all: also the non-default block shapes (removed from argv before Google Benchmark sees it).
  bool all = false;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--all") == 0) {
      all = true;
      for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      break;
    }
  const int tokens = 8192, hd = 128;
  // T, doc: causal rows, then rows packed with documents of 1024 tokens.
  const std::pair<int, int> rows[] = {{1024, 0}, {4096, 0}, {8192, 0}, {4096, 1024}, {8192, 1024}};
  for (auto [nh, nkv] : {std::pair{16, 8}, std::pair{32, 8}})
    for (auto [T, doc] : rows) {
      const Shape s{tokens / T, T, nh, nkv, hd, doc};
      auto reg = [&](const std::string& name, Kind kind, AttentionConfig cfg) {
        benchmark::RegisterBenchmark(name.c_str(),
                                     [=](benchmark::State& st) { run_case(st, s, kind, cfg); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->MinTime(kMinTime);
      };
      const AttentionPath kM = AttentionPath::kMma, kW = AttentionPath::kWgmma;
      reg("fwd/" + s.name() + "/mma_w4", Kind::kFwd, {4, 4, 4, kM});
      reg("bwd/" + s.name() + "/mma_kv4q4", Kind::kBwd, {4, 4, 4, kM});
      reg("fwdbwd/" + s.name() + "/mma", Kind::kFwdBwd, {4, 4, 4, kM});
      if (!wgmma) continue;
      // wgmma, default block shapes; with --all also the others (wN: N / 4 warpgroups per block).
      reg("fwd/" + s.name() + "/wgmma", Kind::kFwd, {0, 0, 0, kW});
      reg("bwd/" + s.name() + "/wgmma", Kind::kBwd, {0, 0, 0, kW});
      reg("fwdbwd/" + s.name() + "/wgmma", Kind::kFwdBwd, {0, 0, 0, kW});
      // The forward with two warpgroups per block and warp-specialised (fwd_warps 8, 12).
      reg("fwd/" + s.name() + "/wgmma_w8", Kind::kFwd, {8, 0, 0, kW});
      reg("fwd/" + s.name() + "/wgmma_w12", Kind::kFwd, {12, 0, 0, kW});
      // The backward without warp specialisation (two warpgroups per block, dkdv_warps and
      // dq_warps 8), and with it in the dK/dV kernel only.
      reg("bwd/" + s.name() + "/wgmma_kv8q8", Kind::kBwd, {0, 8, 8, kW});
      reg("bwd/" + s.name() + "/wgmma_kv12q8", Kind::kBwd, {0, 12, 8, kW});
      if (!all) continue;
      reg("fwd/" + s.name() + "/mma_w8", Kind::kFwd, {8, 4, 4, kM});
      reg("fwd/" + s.name() + "/wgmma_w4", Kind::kFwd, {4, 0, 0, kW});
      for (int wkv : {4, 8, 12})
        for (int wq : {4, 8, 12})
          if (!(wkv == 8 && wq == 8) && !(wkv == 12 && wq == 8))
            reg("bwd/" + s.name() + "/wgmma_kv" + std::to_string(wkv) + "q" + std::to_string(wq),
                Kind::kBwd, {0, wkv, wq, kW});
      reg("fwdbwd/" + s.name() + "/wgmma_all4", Kind::kFwdBwd, {4, 4, 4, kW});
    }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
