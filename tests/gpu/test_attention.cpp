// Fused causal GQA flash attention (src/ops/cuda/attention_*.cu) against the CPU op in double.
// Inputs are fresh random numbers rounded to bf16 first, so the GPU and the reference see the
// same values; only accumulation, the bf16 rounding of P and dS inside the kernels and the
// rounding of the outputs differ. Every case runs on every path: the mma.sync kernels with both
// block shapes (4 and 8 warps) and, where the build and device have them, the sm_90a wgmma kernels
// (1 and 2 warpgroups per block);
// each checks NaN/Inf, guard bytes, poisoned (NaN) outputs being fully written, and bitwise
// determinism.
// The long-context case (T = 32768) checks sampled rows against a per-row double reference.
// Packed cases (suite Packed): rows holding several documents (pos [B, T], query t attends keys
// t - pos[t] .. t) against the CPU op with the same pos; random document lengths (length 1
// included), one document spanning a whole row, documents starting at and beside tile borders.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test.h"
#include "ops/attention.h"
#include "ops/cuda/attention.cuh"
#include "support/random.h"

namespace qt::cuda {
namespace {

using qt::test::GuardedBuffer;

// Tolerances. bf16 outputs: ||got - want|| / ||want||; lse: max |got - want| / max(1, |want|).
struct Tol {
  static constexpr double kBf16 = 1e-2;
  static constexpr double kLse = 1e-3;
};

using qt::test::bf16_bits;
using qt::test::bf16_value;
constexpr std::uint16_t kBf16NaN = 0x7FC0;

bf16* as_bf16(GuardedBuffer<std::uint16_t>& b) { return reinterpret_cast<bf16*>(b.get()); }

// n random bf16 values, normal with standard deviation `scale`: bits and the same values as double.
void random_bf16(std::size_t n, std::mt19937_64& rng, double scale,
                 std::vector<std::uint16_t>& bits, std::vector<double>& vals) {
  std::normal_distribution<double> dist(0.0, scale);
  bits.resize(n);
  vals.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    bits[i] = bf16_bits(static_cast<float>(dist(rng)));
    vals[i] = bf16_value(bits[i]);
  }
}

template <typename V>
double rel_err(const V& got, const std::vector<double>& want) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  // Floor: an rms of 1e-3 per element, for outputs that are exactly zero (dq and dk at T = 1).
  return std::sqrt(num / std::max(den, 1e-6 * static_cast<double>(want.size())));
}
std::vector<double> bf16_to_double(const std::vector<std::uint16_t>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = bf16_value(v[i]);
  return out;
}
template <typename V>
std::size_t count_nonfinite(const V& v) {
  std::size_t n = 0;
  for (const auto& x : v) n += !std::isfinite(static_cast<double>(x));
  return n;
}
double lse_err(const std::vector<float>& got, const std::vector<double>& want) {
  double e = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i)
    e = std::max(e, std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i])));
  return e;
}

// The kernel configurations every case runs with.
struct PathConfig {
  std::string name;
  AttentionConfig cfg;
};
std::vector<PathConfig> path_configs() {
  std::vector<PathConfig> v = {{"mma w4", {4, 4, 4, AttentionPath::kMma}},
                               {"mma w8", {8, 8, 8, AttentionPath::kMma}}};
  if (attention_wgmma_available()) {
    v.push_back({"wgmma4", {4, 4, 4, AttentionPath::kWgmma}});  // 1 warpgroup per block
    v.push_back({"wgmma8", {8, 8, 8, AttentionPath::kWgmma}});  // 2 warpgroups per block
    v.push_back({"wgmma ws", {12, 12, 12, AttentionPath::kWgmma}});  // warp-specialised
  } else {
    static bool said = false;
    if (!said) std::printf("[attention] no sm_90a wgmma path here: testing the mma path only\n");
    said = true;
  }
  return v;
}

// On a Hopper GPU the default build (sm_90a) must offer the wgmma path: this catches a probe that
// wrongly says no (and a build for Hopper without sm_90a).
TEST(AttentionPath, WgmmaAvailableOnHopper) {
  QT_REQUIRE_GPU();
  cudaDeviceProp prop{};
  QT_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0)
    GTEST_SKIP() << "not a compute capability 9.0 device: " << prop.name;
  EXPECT_TRUE(attention_wgmma_available())
      << "no sm_90a attention kernels on " << prop.name << " (QTRAIN_CUDA_ARCH must include 90a)";
}

struct Case {
  int B, T, nh, nkv, hd;
  double score_std = 1.0;  // standard deviation of q and k entries: scores ~ N(0, score_std^2)
  // Packed documents, per batch row: the document lengths (summing to T), or empty for random
  // lengths (1 .. doc_max, some of length 1) drawn from the test's generator. No rows: causal.
  std::vector<std::vector<int>> docs = {};
  int doc_max = 0;
  const char* tag = "";  // distinguishes packed cases of the same shape
};
std::string case_name(const Case& c) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "B%d_T%d_nh%d_nkv%d_hd%d%s%s%s", c.B, c.T, c.nh, c.nkv, c.hd,
                c.score_std > 1.0 ? "_peaked" : "", c.docs.empty() ? "" : "_packed_", c.tag);
  return buf;
}

// pos [B, T] of a packed case: each row's documents, positions 0, 1, .. within each.
std::vector<std::int32_t> packed_positions(const Case& c, std::mt19937_64& rng) {
  std::vector<std::int32_t> pos;
  for (int b = 0; b < c.B; ++b) {
    std::vector<int> lens = c.docs[b];
    if (lens.empty()) {  // random lengths, about one in six of length 1
      std::uniform_int_distribution<int> len(1, c.doc_max), coin(0, 5);
      for (int left = c.T; left > 0;) {
        const int n = std::min(left, coin(rng) == 0 ? 1 : len(rng));
        lens.push_back(n);
        left -= n;
      }
    }
    int total = 0;
    for (int n : lens) {
      for (int p = 0; p < n; ++p) pos.push_back(p);
      total += n;
    }
    EXPECT_EQ(total, c.T) << "document lengths of row " << b;
  }
  return pos;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  const int kv_heads = 2;
  for (int ratio : {1, 2, 4})
    for (int hd : {64, 128})
      for (int T : {1, 7, 64, 127, 128, 1000})
        for (int B : {1, 2}) cases.push_back({B, T, kv_heads * ratio, kv_heads, hd});
  // Long rows, a few shapes (the CPU reference is O(T^2)).
  cases.push_back({1, 4096, 4, 2, 128});
  cases.push_back({2, 4096, 4, 1, 64});
  cases.push_back({1, 4096, 2, 2, 64});
  // Scores of order +-30: exercises the running-max rescaling.
  cases.push_back({1, 1000, 4, 2, 128, 3.0});
  cases.push_back({2, 333, 8, 2, 64, 3.0});
  return cases;
}

// Packed rows: B = 2 with a different layout per row, hd 64 and 128, GQA 1, 2 and 4.
std::vector<Case> packed_cases() {
  const std::vector<int> rnd = {};  // random lengths
  std::vector<Case> cases;
  // Random short documents beside one document spanning the whole row.
  cases.push_back({2, 1000, 4, 2, 64, 1.0, {rnd, {1000}}, 40, "rand40_whole"});
  cases.push_back({2, 1000, 8, 2, 128, 1.0, {{1000}, rnd}, 300, "whole_rand300"});
  // Borders of the 64-row tiles (and of the 128-row wgmma tiles): at, one before, one after.
  cases.push_back(
      {2, 512, 2, 2, 128, 1.0, {{64, 64, 1, 127, 128, 128}, {63, 65, 129, 255}}, 0, "borders"});
  cases.push_back({2, 512, 4, 1, 64, 1.0, {{1, 1, 1, 509}, {509, 1, 1, 1}}, 0, "ones"});
  // Every token its own document: only the diagonal is read.
  cases.push_back({1, 130, 4, 2, 64, 1.0, {std::vector<int>(130, 1)}, 0, "all_ones"});
  cases.push_back({2, 127, 4, 2, 128, 3.0, {rnd, rnd}, 20, "rand20"});  // peaked scores
  // Long rows: 4 x 1024 beside random documents; one long document among short ones.
  cases.push_back({2, 4096, 4, 1, 128, 1.0, {{1024, 1024, 1024, 1024}, rnd}, 700, "4x1024_rand"});
  cases.push_back({1, 4096, 4, 2, 64, 1.0, {{3000, 1, 1095}}, 0, "long_one_long"});
  cases.push_back({2, 4096, 4, 2, 64, 1.0, {rnd, rnd}, 2000, "rand2000"});
  // One document per row: also compared bitwise with pos == nullptr.
  cases.push_back({2, 1000, 4, 2, 64, 1.0, {{1000}, {1000}}, 0, "whole"});
  cases.push_back({2, 127, 8, 2, 128, 1.0, {{127}, {127}}, 0, "whole"});
  return cases;
}

class AttentionCase : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionCase, MatchesCpuInDouble) {
  QT_REQUIRE_GPU();
  const Case c = GetParam();
  const int B = c.B, T = c.T, nh = c.nh, nkv = c.nkv, hd = c.hd;
  const std::size_t nq = static_cast<std::size_t>(B) * T * nh * hd;
  const std::size_t nkvn = static_cast<std::size_t>(B) * T * nkv * hd;
  const std::size_t nl = static_cast<std::size_t>(B) * nh * T;

  std::mt19937_64 rng(qt::test::test_seed() ^
                      (static_cast<std::uint64_t>(T) * 1000003u + nh * 101u + hd + B) ^
                      (c.docs.empty() ? 0 : std::hash<std::string>{}(c.tag)));
  std::vector<std::uint16_t> q_b, k_b, v_b, do_b;
  std::vector<double> q, k, v, dout;
  random_bf16(nq, rng, c.score_std, q_b, q);
  random_bf16(nkvn, rng, c.score_std, k_b, k);
  random_bf16(nkvn, rng, 1.0, v_b, v);
  random_bf16(nq, rng, 1.0, do_b, dout);
  const bool packed = !c.docs.empty();
  const std::vector<std::int32_t> pos_h =
      packed ? packed_positions(c, rng) : std::vector<std::int32_t>{};
  const std::int32_t* pos_cpu = packed ? pos_h.data() : nullptr;

  // Reference in double: forward, then backward from the exact out and lse.
  std::vector<double> out_ref(nq), lse_ref(nl), dq_ref(nq), dk_ref(nkvn), dv_ref(nkvn);
  qt::cpu::attention_forward<double>(out_ref.data(), lse_ref.data(), q.data(), k.data(), v.data(),
                                     B, T, nh, nkv, hd, pos_cpu);
  qt::cpu::attention_backward<double>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(),
                                      q.data(), k.data(), v.data(), out_ref.data(), lse_ref.data(),
                                      B, T, nh, nkv, hd, pos_cpu);

  GuardedBuffer<std::int32_t> dpos(packed ? pos_h : std::vector<std::int32_t>(1, 0));
  const std::int32_t* pos = packed ? dpos.get() : nullptr;
  // Every row one whole document: the packed kernels must equal the causal ones bitwise.
  bool whole_rows = packed;
  for (int b = 0; b < B && packed; ++b)
    whole_rows = whole_rows && pos_h[static_cast<std::size_t>(b) * T + T - 1] == T - 1;
  GuardedBuffer<std::uint16_t> dq_(q_b), dk_(k_b), dv_(v_b), ddo(do_b);
  GuardedBuffer<std::uint16_t> dq(nq), dk(nkvn), dv(nkvn), out(nq);
  GuardedBuffer<float> lse(nl);
  const std::vector<std::uint16_t> nan_q(nq, kBf16NaN), nan_kv(nkvn, kBf16NaN);
  const std::vector<float> nan_l(nl, std::numeric_limits<float>::quiet_NaN());

  for (const PathConfig& pc : path_configs()) {
    SCOPED_TRACE("path " + pc.name);
    const AttentionConfig& cfg = pc.cfg;
    out.upload(nan_q);
    lse.upload(nan_l);
    attention_forward(as_bf16(out), lse.get(), as_bf16(dq_), as_bf16(dk_), as_bf16(dv_), B, T, nh,
                      nkv, hd, cfg, nullptr, pos);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    const std::vector<std::uint16_t> out_g = out.download();
    const std::vector<float> lse_g = lse.download();
    const std::vector<double> out_d = bf16_to_double(out_g);
    EXPECT_EQ(count_nonfinite(out_d), 0u) << "out has NaN/Inf (or unwritten entries)";
    EXPECT_EQ(count_nonfinite(lse_g), 0u) << "lse has NaN/Inf (or unwritten entries)";
    EXPECT_TRUE(out.guard_intact()) << "out: write past the end";
    EXPECT_TRUE(lse.guard_intact()) << "lse: write past the end";
    const double e_out = rel_err(out_d, out_ref), e_lse = lse_err(lse_g, lse_ref);
    EXPECT_LT(e_out, Tol::kBf16) << "out";
    EXPECT_LT(e_lse, Tol::kLse) << "lse";

    // Backward from the GPU's own out and lse, as in training.
    dq.upload(nan_q);
    dk.upload(nan_kv);
    dv.upload(nan_kv);
    attention_backward(as_bf16(dq), as_bf16(dk), as_bf16(dv), as_bf16(ddo), as_bf16(dq_),
                       as_bf16(dk_), as_bf16(dv_), as_bf16(out), lse.get(), B, T, nh, nkv, hd, cfg,
                       nullptr, pos);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    const std::vector<std::uint16_t> dq_g = dq.download(), dk_g = dk.download(),
                                     dv_g = dv.download();
    const std::vector<double> dq_d = bf16_to_double(dq_g), dk_d = bf16_to_double(dk_g),
                              dv_d = bf16_to_double(dv_g);
    EXPECT_EQ(count_nonfinite(dq_d), 0u) << "dq has NaN/Inf (or unwritten entries)";
    EXPECT_EQ(count_nonfinite(dk_d), 0u) << "dk has NaN/Inf (or unwritten entries)";
    EXPECT_EQ(count_nonfinite(dv_d), 0u) << "dv has NaN/Inf (or unwritten entries)";
    EXPECT_TRUE(dq.guard_intact()) << "dq: write past the end";
    EXPECT_TRUE(dk.guard_intact()) << "dk: write past the end";
    EXPECT_TRUE(dv.guard_intact()) << "dv: write past the end";
    const double e_dq = rel_err(dq_d, dq_ref), e_dk = rel_err(dk_d, dk_ref),
                 e_dv = rel_err(dv_d, dv_ref);
    EXPECT_LT(e_dq, Tol::kBf16) << "dq";
    EXPECT_LT(e_dk, Tol::kBf16) << "dk";
    EXPECT_LT(e_dv, Tol::kBf16) << "dv";

    // Determinism: a second backward (outputs poisoned again) is bitwise equal.
    dq.upload(nan_q);
    dk.upload(nan_kv);
    dv.upload(nan_kv);
    attention_backward(as_bf16(dq), as_bf16(dk), as_bf16(dv), as_bf16(ddo), as_bf16(dq_),
                       as_bf16(dk_), as_bf16(dv_), as_bf16(out), lse.get(), B, T, nh, nkv, hd, cfg,
                       nullptr, pos);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(dq.download() == dq_g) << "dq differs between two identical backward runs";
    EXPECT_TRUE(dk.download() == dk_g) << "dk differs between two identical backward runs";
    EXPECT_TRUE(dv.download() == dv_g) << "dv differs between two identical backward runs";

    if (whole_rows) {  // the same inputs without pos: bitwise the same outputs
      attention_forward(as_bf16(out), lse.get(), as_bf16(dq_), as_bf16(dk_), as_bf16(dv_), B, T, nh,
                        nkv, hd, cfg, nullptr);
      attention_backward(as_bf16(dq), as_bf16(dk), as_bf16(dv), as_bf16(ddo), as_bf16(dq_),
                         as_bf16(dk_), as_bf16(dv_), as_bf16(out), lse.get(), B, T, nh, nkv, hd,
                         cfg, nullptr);
      QT_CHECK_CUDA(cudaDeviceSynchronize());
      EXPECT_TRUE(out.download() == out_g && lse.download() == lse_g)
          << "one document per row: forward differs from pos == nullptr";
      EXPECT_TRUE(dq.download() == dq_g && dk.download() == dk_g && dv.download() == dv_g)
          << "one document per row: backward differs from pos == nullptr";
    }

    std::printf("[attention] %-32s %-6s  rel err: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n",
                case_name(c).c_str(), pc.name.c_str(), e_out, e_lse, e_dq, e_dk, e_dv);
  }
  // Inputs are read-only.
  EXPECT_TRUE(dq_.download() == q_b && dk_.download() == k_b && dv_.download() == v_b &&
              ddo.download() == do_b)
      << "an input was modified";
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionCase, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return case_name(i.param);
                         });
INSTANTIATE_TEST_SUITE_P(Packed, AttentionCase, ::testing::ValuesIn(packed_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return case_name(i.param);
                         });

// ---- Long context: T = 32768, B = 1, nh 16, nkv 8, hd 128, sampled rows ----

// Fast bf16 noise for 200M values: Irwin-Hall sum of 4 uniforms, scaled to unit variance.
struct Noise {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint16_t bf16() {
    const std::uint64_t r = next();
    double sum = 0.0;
    for (int i = 0; i < 4; ++i) sum += static_cast<double>((r >> (16 * i)) & 0xFFFF) / 65535.0;
    return bf16_bits(static_cast<float>((sum - 2.0) * 1.7320508075688772));
  }
};

void parallel_for(int n, const std::function<void(int)>& f) {
  const int workers = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int i = w; i < n; i += workers) f(i);
    });
  for (auto& t : pool) t.join();
}

// Largest relative error over rows of `len` elements (one sampled position, all heads), with the
// same floor as rel_err: a per-row check, so an exact row 0 cannot hide a wrong long row.
double max_row_err(const std::vector<double>& got, const std::vector<double>& want, int len) {
  double worst = 0.0;
  for (std::size_t r = 0; r < want.size() / len; ++r) {
    const std::vector<double> g(got.begin() + r * len, got.begin() + (r + 1) * len);
    const std::vector<double> w(want.begin() + r * len, want.begin() + (r + 1) * len);
    worst = std::max(worst, rel_err(g, w));
  }
  return worst;
}

TEST(AttentionLong, T32768SampledRows) {
  QT_REQUIRE_GPU();
  const int B = 1, T = 32768, nh = 16, nkv = 8, hd = 128, ratio = nh / nkv;
  const std::size_t nq = static_cast<std::size_t>(T) * nh * hd,
                    nkvn = static_cast<std::size_t>(T) * nkv * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  Noise noise{qt::test::test_seed() ^ 0x5151ull};
  std::vector<std::uint16_t> q(nq), k(nkvn), v(nkvn), dout(nq);
  for (auto& x : q) x = noise.bf16();
  for (auto& x : k) x = noise.bf16();
  for (auto& x : v) x = noise.bf16();
  for (auto& x : dout) x = noise.bf16();
  auto Q = [&](int t, int h, int d) {
    return bf16_value(q[(static_cast<std::size_t>(t) * nh + h) * hd + d]);
  };
  auto K = [&](int t, int g, int d) {
    return bf16_value(k[(static_cast<std::size_t>(t) * nkv + g) * hd + d]);
  };
  auto V = [&](int t, int g, int d) {
    return bf16_value(v[(static_cast<std::size_t>(t) * nkv + g) * hd + d]);
  };
  auto DO = [&](int t, int h, int d) {
    return bf16_value(dout[(static_cast<std::size_t>(t) * nh + h) * hd + d]);
  };

  // 16 positions spread over T, the last included: query rows (all heads) and kv rows.
  std::vector<int> rows;
  for (int i = 0; i < 16; ++i)
    rows.push_back(static_cast<int>((static_cast<long long>(T - 1) * i) / 15));
  const int nr = static_cast<int>(rows.size());

  // Per-row reference of out, lse and dq in double, from the inputs alone.
  std::vector<double> o_ref(static_cast<std::size_t>(nr) * nh * hd), dq_ref(o_ref.size());
  std::vector<double> l_ref(static_cast<std::size_t>(nr) * nh);
  parallel_for(nr * nh, [&](int idx) {
    const int t = rows[idx / nh], h = idx % nh, g = h / ratio;
    std::vector<double> s(t + 1);
    double m = -1e300;
    for (int j = 0; j <= t; ++j) {
      double acc = 0.0;
      for (int d = 0; d < hd; ++d) acc += Q(t, h, d) * K(j, g, d);
      s[j] = acc * scale;
      m = std::max(m, s[j]);
    }
    double sum = 0.0;
    for (int j = 0; j <= t; ++j) sum += std::exp(s[j] - m);
    const double lse = m + std::log(sum);
    l_ref[idx] = lse;
    std::vector<double> o(hd, 0.0), dqr(hd, 0.0);
    for (int j = 0; j <= t; ++j) {
      s[j] = std::exp(s[j] - lse);  // P
      for (int d = 0; d < hd; ++d) o[d] += s[j] * V(j, g, d);
    }
    double D = 0.0;
    for (int d = 0; d < hd; ++d) D += DO(t, h, d) * o[d];
    for (int j = 0; j <= t; ++j) {
      double dp = 0.0;
      for (int d = 0; d < hd; ++d) dp += DO(t, h, d) * V(j, g, d);
      const double ds = s[j] * (dp - D);
      for (int d = 0; d < hd; ++d) dqr[d] += scale * ds * K(j, g, d);
    }
    for (int d = 0; d < hd; ++d) {
      o_ref[static_cast<std::size_t>(idx) * hd + d] = o[d];
      dq_ref[static_cast<std::size_t>(idx) * hd + d] = dqr[d];
    }
  });
  // dk, dv of the sampled kv rows need every later query row's lse and D: the reference takes
  // them from the first configuration's GPU out and lse (whose sampled rows are checked).
  std::vector<double> dk_ref, dv_ref;

  GuardedBuffer<std::uint16_t> gq(q), gk(k), gv(v), gdo(dout), gout(nq), gdq(nq), gdk(nkvn),
      gdv(nkvn);
  GuardedBuffer<float> glse(static_cast<std::size_t>(nh) * T);
  for (const PathConfig& pc : path_configs()) {
    SCOPED_TRACE("path " + pc.name);
    const AttentionConfig& cfg = pc.cfg;
    gout.upload(std::vector<std::uint16_t>(nq, kBf16NaN));
    attention_forward(as_bf16(gout), glse.get(), as_bf16(gq), as_bf16(gk), as_bf16(gv), B, T, nh,
                      nkv, hd, cfg, nullptr);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    const std::vector<std::uint16_t> out_g = gout.download();
    const std::vector<float> lse_g = glse.download();
    EXPECT_EQ(count_nonfinite(bf16_to_double(out_g)), 0u);
    EXPECT_EQ(count_nonfinite(lse_g), 0u);
    EXPECT_TRUE(gout.guard_intact() && glse.guard_intact());

    std::vector<double> o_got(o_ref.size()), l_got(l_ref.size());
    for (int idx = 0; idx < nr * nh; ++idx) {
      const int t = rows[idx / nh], h = idx % nh;
      l_got[idx] = lse_g[static_cast<std::size_t>(h) * T + t];
      for (int d = 0; d < hd; ++d)
        o_got[static_cast<std::size_t>(idx) * hd + d] =
            bf16_value(out_g[(static_cast<std::size_t>(t) * nh + h) * hd + d]);
    }
    const double e_out = max_row_err(o_got, o_ref, nh * hd);
    double e_lse = 0.0;
    for (std::size_t i = 0; i < l_ref.size(); ++i)
      e_lse = std::max(e_lse, std::abs(l_got[i] - l_ref[i]) / std::max(1.0, std::abs(l_ref[i])));
    EXPECT_LT(e_out, Tol::kBf16) << "out, sampled rows";
    EXPECT_LT(e_lse, Tol::kLse) << "lse, sampled rows";

    gdq.upload(std::vector<std::uint16_t>(nq, kBf16NaN));
    gdk.upload(std::vector<std::uint16_t>(nkvn, kBf16NaN));
    gdv.upload(std::vector<std::uint16_t>(nkvn, kBf16NaN));
    attention_backward(as_bf16(gdq), as_bf16(gdk), as_bf16(gdv), as_bf16(gdo), as_bf16(gq),
                       as_bf16(gk), as_bf16(gv), as_bf16(gout), glse.get(), B, T, nh, nkv, hd, cfg,
                       nullptr);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    const std::vector<std::uint16_t> dq_g = gdq.download(), dk_g = gdk.download(),
                                     dv_g = gdv.download();
    EXPECT_EQ(count_nonfinite(bf16_to_double(dq_g)), 0u);
    EXPECT_EQ(count_nonfinite(bf16_to_double(dk_g)), 0u);
    EXPECT_EQ(count_nonfinite(bf16_to_double(dv_g)), 0u);
    EXPECT_TRUE(gdq.guard_intact() && gdk.guard_intact() && gdv.guard_intact());

    std::vector<double> dq_got(dq_ref.size());
    for (int idx = 0; idx < nr * nh; ++idx) {
      const int t = rows[idx / nh], h = idx % nh;
      for (int d = 0; d < hd; ++d)
        dq_got[static_cast<std::size_t>(idx) * hd + d] =
            bf16_value(dq_g[(static_cast<std::size_t>(t) * nh + h) * hd + d]);
    }
    const double e_dq = max_row_err(dq_got, dq_ref, nh * hd);
    EXPECT_LT(e_dq, Tol::kBf16) << "dq, sampled rows";

    if (dk_ref.empty()) {
      dk_ref.assign(static_cast<std::size_t>(nr) * nkv * hd, 0.0);
      dv_ref.assign(dk_ref.size(), 0.0);
      parallel_for(nr * nkv, [&](int idx) {
        const int j = rows[idx / nkv], g = idx % nkv;
        std::vector<double> dkr(hd, 0.0), dvr(hd, 0.0);
        for (int h = g * ratio; h < (g + 1) * ratio; ++h)
          for (int i = j; i < T; ++i) {
            double sc = 0.0, dp = 0.0, D = 0.0;
            for (int d = 0; d < hd; ++d) {
              sc += Q(i, h, d) * K(j, g, d);
              dp += DO(i, h, d) * V(j, g, d);
              D += DO(i, h, d) * bf16_value(out_g[(static_cast<std::size_t>(i) * nh + h) * hd + d]);
            }
            const double p = std::exp(sc * scale - lse_g[static_cast<std::size_t>(h) * T + i]);
            const double ds = p * (dp - D);
            for (int d = 0; d < hd; ++d) {
              dvr[d] += p * DO(i, h, d);
              dkr[d] += scale * ds * Q(i, h, d);
            }
          }
        for (int d = 0; d < hd; ++d) {
          dk_ref[static_cast<std::size_t>(idx) * hd + d] = dkr[d];
          dv_ref[static_cast<std::size_t>(idx) * hd + d] = dvr[d];
        }
      });
    }
    std::vector<double> dk_got(dk_ref.size()), dv_got(dk_ref.size());
    for (int idx = 0; idx < nr * nkv; ++idx) {
      const int j = rows[idx / nkv], g = idx % nkv;
      for (int d = 0; d < hd; ++d) {
        const std::size_t src = (static_cast<std::size_t>(j) * nkv + g) * hd + d;
        dk_got[static_cast<std::size_t>(idx) * hd + d] = bf16_value(dk_g[src]);
        dv_got[static_cast<std::size_t>(idx) * hd + d] = bf16_value(dv_g[src]);
      }
    }
    const double e_dk = max_row_err(dk_got, dk_ref, nkv * hd);
    const double e_dv = max_row_err(dv_got, dv_ref, nkv * hd);
    EXPECT_LT(e_dk, Tol::kBf16) << "dk, sampled kv rows";
    EXPECT_LT(e_dv, Tol::kBf16) << "dv, sampled kv rows";
    std::printf(
        "[attention] T32768 nh16 nkv8 hd128 %-6s, worst sampled row  rel err: out %.2e "
        "lse %.2e dq %.2e dk %.2e dv %.2e\n",
        pc.name.c_str(), e_out, e_lse, e_dq, e_dk, e_dv);
  }
}

}  // namespace
}  // namespace qt::cuda
