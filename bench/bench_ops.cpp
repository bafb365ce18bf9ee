// Benchmarks of the CPU reference ops. Each case validates its result once (per size) against an
// independent double-precision computation before it is timed; a wrong result skips the case
// with an error instead of reporting a time. Run with OPENBLAS_NUM_THREADS set as wanted.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstddef>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ops/attention.h"
#include "ops/gemm.h"
#include "ops/rmsnorm.h"

namespace {

using Vec = std::vector<double>;

std::vector<double> random_vec(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  Vec v(n);
  for (auto& x : v) x = static_cast<float>(d(rng));  // float-exact: both precisions see the same
  return v;
}

template <typename To, typename From>
std::vector<To> cast(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

template <typename A, typename B>
double rel_err(const A& got, const B& want) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    if (!std::isfinite(g)) return INFINITY;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return std::sqrt(num / den);
}

double dot(const Vec& a, const Vec& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// True once per key: validation runs before the first timing of each size only.
bool first_time(const std::string& key) {
  static std::set<std::string> seen;
  return seen.insert(key).second;
}

// Fails the benchmark (and returns false) when err is not below tol.
bool validate(benchmark::State& state, const char* what, double err, double tol) {
  if (err < tol) return true;
  state.SkipWithError((std::string(what) + ": relative error " + std::to_string(err)).c_str());
  return false;
}

// --- gemm: C[n, n] = A B, float. Validated on 64 sampled entries against double dot products.
void BM_Gemm(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const auto A = cast<float>(random_vec(std::size_t(n) * n, 1));
  const auto B = cast<float>(random_vec(std::size_t(n) * n, 2));
  std::vector<float> C(std::size_t(n) * n);
  qt::cpu::gemm<float>(false, false, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
  if (first_time("gemm" + std::to_string(n))) {
    std::mt19937_64 rng(3);
    std::uniform_int_distribution<int> pick(0, n - 1);
    Vec got, want;
    for (int s = 0; s < 64; ++s) {
      const int i = pick(rng), j = pick(rng);
      double acc = 0.0;
      for (int k = 0; k < n; ++k) acc += double(A[i * n + k]) * B[k * n + j];
      got.push_back(C[i * n + j]);
      want.push_back(acc);
    }
    if (!validate(state, "gemm", rel_err(got, want), 1e-5)) return;
  }
  for (auto _ : state) {
    qt::cpu::gemm<float>(false, false, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
    benchmark::DoNotOptimize(C.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Gemm)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);

// --- attention forward + backward, Qwen3-0.6B heads (nh 16, nkv 8, hd 128), B = 1.
struct Attn {
  int B = 1, Tn, nh = 16, nkv = 8, hd = 128;
  std::size_t nq() const { return std::size_t(B) * Tn * nh * hd; }
  std::size_t nkv_() const { return std::size_t(B) * Tn * nkv * hd; }
  std::size_t nlse() const { return std::size_t(B) * nh * Tn; }
};

template <typename T>
struct AttnRun {
  std::vector<T> out, lse, dq, dk, dv;
  void forward(const Attn& s, const std::vector<T>& q, const std::vector<T>& k,
               const std::vector<T>& v) {
    out.resize(s.nq());
    lse.resize(s.nlse());
    qt::cpu::attention_forward<T>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn,
                                  s.nh, s.nkv, s.hd);
  }
  void backward(const Attn& s, const std::vector<T>& dout, const std::vector<T>& q,
                const std::vector<T>& k, const std::vector<T>& v) {
    dq.resize(s.nq());
    dk.resize(s.nkv_());
    dv.resize(s.nkv_());
    qt::cpu::attention_backward<T>(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                                   v.data(), out.data(), lse.data(), s.B, s.Tn, s.nh, s.nkv, s.hd);
  }
};

// Double forward: sampled rows against an explicit softmax. Double backward: the directional
// derivative of L = <dout, out> along a random direction, by central differences. Float: against
// double.
bool validate_attention(benchmark::State& state, const Attn& s, const Vec& q, const Vec& k,
                        const Vec& v, const Vec& dout) {
  AttnRun<double> d;
  d.forward(s, q, k, v);
  d.backward(s, dout, q, k, v);
  Vec got, want;
  const double scale = 1.0 / std::sqrt(double(s.hd));
  for (int h : {0, s.nh - 1}) {
    const int g = h / (s.nh / s.nkv);
    for (int i : {0, s.Tn / 3, s.Tn - 1}) {
      Vec p(i + 1);
      double m = -INFINITY, z = 0.0;
      for (int j = 0; j <= i; ++j) {
        double acc = 0.0;
        for (int c = 0; c < s.hd; ++c)
          acc += q[(std::size_t(i) * s.nh + h) * s.hd + c] *
                 k[(std::size_t(j) * s.nkv + g) * s.hd + c];
        p[j] = acc * scale;
        m = std::max(m, p[j]);
      }
      for (auto& x : p) z += (x = std::exp(x - m));
      for (int c = 0; c < s.hd; ++c) {
        double o = 0.0;
        for (int j = 0; j <= i; ++j) o += p[j] / z * v[(std::size_t(j) * s.nkv + g) * s.hd + c];
        want.push_back(o);
        got.push_back(d.out[(std::size_t(i) * s.nh + h) * s.hd + c]);
      }
    }
  }
  if (!validate(state, "attention forward (double)", rel_err(got, want), 1e-10)) return false;

  const Vec dir_q = random_vec(s.nq(), 11), dir_k = random_vec(s.nkv_(), 12),
            dir_v = random_vec(s.nkv_(), 13);
  auto loss_at = [&](double h) {
    Vec qh = q, kh = k, vh = v;
    for (std::size_t i = 0; i < qh.size(); ++i) qh[i] += h * dir_q[i];
    for (std::size_t i = 0; i < kh.size(); ++i) kh[i] += h * dir_k[i];
    for (std::size_t i = 0; i < vh.size(); ++i) vh[i] += h * dir_v[i];
    AttnRun<double> r;
    r.forward(s, qh, kh, vh);
    return dot(dout, r.out);
  };
  const double h = 1e-5;
  const Vec fd = {(loss_at(h) - loss_at(-h)) / (2 * h)};
  const Vec an = {dot(d.dq, dir_q) + dot(d.dk, dir_k) + dot(d.dv, dir_v)};
  if (!validate(state, "attention backward (double)", rel_err(an, fd), 1e-6)) return false;

  AttnRun<float> f;
  f.forward(s, cast<float>(q), cast<float>(k), cast<float>(v));
  f.backward(s, cast<float>(dout), cast<float>(q), cast<float>(k), cast<float>(v));
  return validate(state, "attention out (float)", rel_err(f.out, d.out), 1e-4) &&
         validate(state, "attention dq (float)", rel_err(f.dq, d.dq), 1e-4) &&
         validate(state, "attention dk (float)", rel_err(f.dk, d.dk), 1e-4) &&
         validate(state, "attention dv (float)", rel_err(f.dv, d.dv), 1e-4);
}

void BM_AttentionForwardBackward(benchmark::State& state) {
  Attn s;
  s.Tn = static_cast<int>(state.range(0));
  const Vec q = random_vec(s.nq(), 4), k = random_vec(s.nkv_(), 5), v = random_vec(s.nkv_(), 6),
            dout = random_vec(s.nq(), 7);
  if (first_time("attention" + std::to_string(s.Tn)) &&
      !validate_attention(state, s, q, k, v, dout))
    return;
  const auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), df = cast<float>(dout);
  AttnRun<float> f;
  for (auto _ : state) {
    f.forward(s, qf, kf, vf);
    f.backward(s, df, qf, kf, vf);
    benchmark::ClobberMemory();
  }
  // FLOPs as executed: 7 GEMMs of 2 T^2 hd per head (full squares; the mask is applied after).
  state.counters["FLOP/s"] = benchmark::Counter(14.0 * s.B * s.nh * double(s.Tn) * s.Tn * s.hd,
                                                benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AttentionForwardBackward)
    ->Arg(128)
    ->Arg(512)
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond);

// --- rmsnorm forward and backward, float, N = 4096 rows of C. Validated against double.
void BM_RmsNorm(benchmark::State& state) {
  const int N = 4096, C = static_cast<int>(state.range(0));
  const double eps = 1e-6;
  const Vec x = random_vec(std::size_t(N) * C, 8), w = random_vec(C, 9),
            dy = random_vec(std::size_t(N) * C, 10);
  const auto xf = cast<float>(x), wf = cast<float>(w), dyf = cast<float>(dy);
  std::vector<float> y(x.size()), rstd(N), dx(x.size()), dw(C);
  if (first_time("rmsnorm" + std::to_string(C))) {
    Vec want(x.size());
    for (int n = 0; n < N; ++n) {
      double ss = 0.0;
      for (int c = 0; c < C; ++c) ss += x[std::size_t(n) * C + c] * x[std::size_t(n) * C + c];
      const double r = 1.0 / std::sqrt(ss / C + eps);
      for (int c = 0; c < C; ++c)
        want[std::size_t(n) * C + c] = w[c] * x[std::size_t(n) * C + c] * r;
    }
    qt::cpu::rmsnorm_forward<float>(y.data(), rstd.data(), xf.data(), wf.data(), N, C, eps);
    qt::cpu::rmsnorm_backward<float>(dx.data(), dw.data(), dyf.data(), xf.data(), wf.data(),
                                     rstd.data(), N, C);
    Vec yd(x.size()), rd(N), dxd(x.size()), dwd(C, 0.0);
    qt::cpu::rmsnorm_forward<double>(yd.data(), rd.data(), x.data(), w.data(), N, C, eps);
    qt::cpu::rmsnorm_backward<double>(dxd.data(), dwd.data(), dy.data(), x.data(), w.data(),
                                      rd.data(), N, C);
    if (!validate(state, "rmsnorm forward", rel_err(y, want), 1e-5) ||
        !validate(state, "rmsnorm dx (float vs double)", rel_err(dx, dxd), 1e-5) ||
        !validate(state, "rmsnorm dw (float vs double)", rel_err(dw, dwd), 1e-5))
      return;
  }
  for (auto _ : state) {
    qt::cpu::rmsnorm_forward<float>(y.data(), rstd.data(), xf.data(), wf.data(), N, C, eps);
    qt::cpu::rmsnorm_backward<float>(dx.data(), dw.data(), dyf.data(), xf.data(), wf.data(),
                                     rstd.data(), N, C);
    benchmark::ClobberMemory();
  }
  // forward reads x, writes y; backward reads dy and x, writes dx.
  state.counters["bytes/s"] =
      benchmark::Counter(5.0 * N * C * sizeof(float), benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1024);
}
BENCHMARK(BM_RmsNorm)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
