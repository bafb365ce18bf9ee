// cuBLASLt GEMM and linear layer against the CPU ops in double. Inputs are fresh random numbers
// rounded to bf16 first, so the GPU and the reference see the same values and only the
// accumulation and the rounding of the outputs differ.
#include <cuda_runtime.h>  // typed cudaMalloc overload used by gpu_test.h
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/gemm.h"
#include "gpu_test.h"
#include "ops/cuda/gemm.cuh"
#include "ops/gemm.h"
#include "ops/linear.h"
#include "support/random.h"

namespace qt::cuda {
namespace {

// Relative-error tolerances, ||got - want|| / ||want||, by output dtype. bf16 outputs carry one
// rounding (unit roundoff 2^-8, about 2.3e-3 rms); fp32 outputs only fp32 accumulation.
struct Tol {
  static constexpr double kBf16 = 1e-2;
  static constexpr double kF32 = 1e-5;
};

using qt::test::bf16_bits;
using qt::test::bf16_value;
bf16 make_bf16(std::uint16_t bits) {
  __nv_bfloat16_raw r;
  r.x = bits;
  return bf16(r);
}
double to_double(bf16 b) { return bf16_value(static_cast<__nv_bfloat16_raw>(b).x); }

// n bf16-representable values, normal with standard deviation `scale`, as doubles.
std::vector<double> random_bf16_values(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::vector<double> v = qt::test::random_vector<double>(n, rng, scale);
  for (double& x : v) x = bf16_value(bf16_bits(static_cast<float>(x)));
  return v;
}
std::vector<double> random_f32_values(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::vector<double> v = qt::test::random_vector<double>(n, rng, scale);
  for (double& x : v) x = static_cast<float>(x);
  return v;
}

std::vector<bf16> as_bf16(const std::vector<double>& v) {  // exact for bf16-representable values
  std::vector<bf16> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = make_bf16(bf16_bits(static_cast<float>(v[i])));
  return out;
}
std::vector<float> as_f32(const std::vector<double>& v) { return {v.begin(), v.end()}; }
std::vector<double> to_doubles(const std::vector<bf16>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_double(v[i]);
  return out;
}
std::vector<double> to_doubles(const std::vector<float>& v) { return {v.begin(), v.end()}; }

std::vector<bf16> nan_bf16(std::size_t n) { return std::vector<bf16>(n, make_bf16(0x7FC0)); }

// ||got - want|| / ||want||; NaN when any entry of `got` is not finite (so NaN never passes).
double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void sync() { QT_CHECK_CUDA(cudaDeviceSynchronize()); }

// ---- linear ------------------------------------------------------------------------------------

struct LinearCase {
  const char* name;
  int N, in, out;
};

class LinearVsCpu : public ::testing::TestWithParam<LinearCase> {};

TEST_P(LinearVsCpu, ForwardAndBackward) {
  QT_REQUIRE_GPU();
  const auto [name, N, in, out] = GetParam();
  std::mt19937_64 rng(qt::test::test_seed() + static_cast<std::uint64_t>(N * 7919 + in * 31 + out));
  const std::vector<double> x = random_bf16_values(std::size_t(N) * in, rng);
  const std::vector<double> w = random_bf16_values(std::size_t(out) * in, rng, 1.0 / std::sqrt(in));
  const std::vector<double> dy = random_bf16_values(std::size_t(N) * out, rng);
  // dw starts at values of the size of its increment, so "=" instead of "+=" cannot pass.
  const std::vector<double> dw0 = random_f32_values(std::size_t(out) * in, rng, std::sqrt(N));

  test::GuardedBuffer<bf16> d_x(as_bf16(x)), d_w(as_bf16(w)), d_dy(as_bf16(dy));
  test::GuardedBuffer<bf16> d_y(nan_bf16(std::size_t(N) * out)), d_dx(nan_bf16(std::size_t(N) * in));
  test::GuardedBuffer<float> d_dw(as_f32(dw0));

  linear_forward(d_y.get(), d_x.get(), d_w.get(), N, in, out, nullptr);
  linear_backward(d_dx.get(), d_dw.get(), d_dy.get(), d_x.get(), d_w.get(), N, in, out, nullptr);
  sync();

  std::vector<double> y_ref(std::size_t(N) * out), dx_ref(std::size_t(N) * in, 0.0);
  std::vector<double> dw_inc(std::size_t(out) * in, 0.0);
  cpu::linear_forward<double>(y_ref.data(), x.data(), w.data(), N, in, out);
  cpu::linear_backward<double>(dx_ref.data(), dw_inc.data(), dy.data(), x.data(), w.data(), N, in,
                               out);

  const double e_y = rel_error(to_doubles(d_y.download()), y_ref);
  const double e_dx = rel_error(to_doubles(d_dx.download()), dx_ref);
  std::vector<double> got_inc = to_doubles(d_dw.download());
  for (std::size_t i = 0; i < got_inc.size(); ++i) got_inc[i] -= dw0[i];
  const double e_dw = rel_error(got_inc, dw_inc);
  std::printf("  linear %-18s N=%-5d in=%-5d out=%-5d  rel err y %.2e  dx %.2e  dw %.2e\n", name, N,
              in, out, e_y, e_dx, e_dw);
  EXPECT_LE(e_y, Tol::kBf16) << "y (bf16)";
  EXPECT_LE(e_dx, Tol::kBf16) << "dx (bf16)";
  EXPECT_LE(e_dw, Tol::kF32) << "dw increment (fp32, accumulated)";
  EXPECT_TRUE(d_y.guard_intact()) << "write past y";
  EXPECT_TRUE(d_dx.guard_intact()) << "write past dx";
  EXPECT_TRUE(d_dw.guard_intact()) << "write past dw";

  // dx = null skips dx and still accumulates dw (now twice the increment).
  linear_backward(nullptr, d_dw.get(), d_dy.get(), d_x.get(), d_w.get(), N, in, out, nullptr);
  sync();
  got_inc = to_doubles(d_dw.download());
  for (std::size_t i = 0; i < got_inc.size(); ++i) {
    got_inc[i] -= dw0[i];
    dw_inc[i] *= 2;
  }
  EXPECT_LE(rel_error(got_inc, dw_inc), Tol::kF32) << "second accumulation into dw";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearVsCpu,
    ::testing::Values(LinearCase{"tiny", 1, 1, 1}, LinearCase{"odd", 37, 19, 23},
                      LinearCase{"odd_wide", 5, 129, 3}, LinearCase{"aligned", 64, 128, 96},
                      // Qwen3-0.6B: hidden 1024, q 2048, kv 1024, intermediate 3072
                      LinearCase{"q_proj_0p6b", 512, 1024, 2048},
                      LinearCase{"kv_proj_0p6b", 512, 1024, 1024},
                      LinearCase{"o_proj_0p6b", 512, 2048, 1024},
                      LinearCase{"gate_up_0p6b", 512, 1024, 3072},
                      LinearCase{"down_0p6b", 512, 3072, 1024},
                      LinearCase{"kv_proj_4k_tok", 4096, 1024, 1024}),
    [](const ::testing::TestParamInfo<LinearCase>& i) { return std::string(i.param.name); });

// ---- general gemm ----------------------------------------------------------------------------

// All four transpose combinations, alpha and beta, leading dimensions padded by 3 elements (so
// rows start at 2-byte-aligned addresses only), for bf16 and fp32 outputs.
template <typename CT>
void check_gemm(bool ta, bool tb, std::mt19937_64& rng) {
  const int M = 33, N = 47, K = 61, pad = 3;
  const int a_rows = ta ? K : M, a_cols = ta ? M : K;
  const int b_rows = tb ? N : K, b_cols = tb ? K : N;
  const int lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
  const float alpha = 0.75f, beta = -0.5f;
  const std::vector<double> A = random_bf16_values(std::size_t(a_rows) * lda, rng);
  const std::vector<double> B = random_bf16_values(std::size_t(b_rows) * ldb, rng);
  constexpr bool f32 = std::is_same_v<CT, float>;
  const std::vector<double> C0 =
      f32 ? random_f32_values(std::size_t(M) * ldc, rng) : random_bf16_values(std::size_t(M) * ldc, rng);

  test::GuardedBuffer<bf16> dA(as_bf16(A)), dB(as_bf16(B));
  std::vector<double> got;
  test::GuardedBuffer<CT> dC(std::size_t(M) * ldc);
  if constexpr (f32) dC.upload(as_f32(C0)); else dC.upload(as_bf16(C0));
  gemm(ta, tb, M, N, K, alpha, dA.get(), lda, dB.get(), ldb, beta, dC.get(), ldc, nullptr);
  sync();
  got = to_doubles(dC.download());

  std::vector<double> want = C0;
  cpu::gemm<double>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, want.data(), ldc);
  const double e = rel_error(got, want);
  const char* what = f32 ? "fp32" : "bf16";
  EXPECT_LE(e, f32 ? Tol::kF32 : Tol::kBf16) << "gemm ta=" << ta << " tb=" << tb << " C " << what;
  for (int i = 0; i < M; ++i)
    for (int j = N; j < ldc; ++j)
      ASSERT_EQ(got[std::size_t(i) * ldc + j], C0[std::size_t(i) * ldc + j])
          << "padding of C written at row " << i << " (C " << what << ")";
  EXPECT_TRUE(dC.guard_intact()) << "write past C (" << what << ")";
}

TEST(Gemm, TransposesAlphaBetaPaddedLeadingDims) {
  QT_REQUIRE_GPU();
  std::mt19937_64 rng(qt::test::test_seed() + 17);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_gemm<bf16>(ta, tb, rng);
      check_gemm<float>(ta, tb, rng);
    }
}

TEST(Gemm, EmptyInnerDimension) {
  QT_REQUIRE_GPU();
  std::mt19937_64 rng(qt::test::test_seed() + 29);
  const int M = 5, N = 7;
  const std::vector<double> C0 = random_f32_values(std::size_t(M) * N, rng);
  test::GuardedBuffer<float> C(as_f32(C0));
  gemm(false, false, M, N, 0, 1.f, nullptr, 1, nullptr, N, 1.f, C.get(), N, nullptr);  // C unchanged
  sync();
  EXPECT_EQ(to_doubles(C.download()), C0);
  gemm(false, false, M, N, 0, 1.f, nullptr, 1, nullptr, N, 0.f, C.get(), N, nullptr);  // C = 0
  sync();
  for (double v : to_doubles(C.download())) ASSERT_EQ(v, 0.0);
  EXPECT_TRUE(C.guard_intact());
}

TEST(Gemm, BadArgumentsAreClearErrors) {
  QT_REQUIRE_GPU();
  test::GuardedBuffer<bf16> A(64), B(64), C(64);
  const bf16* odd = reinterpret_cast<const bf16*>(reinterpret_cast<const char*>(A.get()) + 1);
  try {
    gemm(false, false, 2, 2, 2, 1.f, odd, 2, B.get(), 2, 0.f, C.get(), 2, nullptr);
    FAIL() << "expected std::invalid_argument for a misaligned A";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("A ("), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("aligned to 2 bytes"), std::string::npos) << e.what();
  }
  try {
    gemm(false, false, 4, 4, 8, 1.f, A.get(), 4, B.get(), 4, 0.f, C.get(), 4, nullptr);
    FAIL() << "expected std::invalid_argument for lda < K";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("lda must be >= 8"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gemm(false, false, -1, 2, 2, 1.f, A.get(), 2, B.get(), 2, 0.f, C.get(), 2, nullptr),
               std::invalid_argument);
  EXPECT_THROW(linear_forward(C.get(), A.get(), nullptr, 2, 2, 2, nullptr), std::invalid_argument);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Gemm, PlansAreCachedPerShape) {
  QT_REQUIRE_GPU();
  std::mt19937_64 rng(qt::test::test_seed() + 41);
  const int N = 16, in = 24, out = 40;
  test::GuardedBuffer<bf16> x(as_bf16(random_bf16_values(std::size_t(N) * in, rng)));
  test::GuardedBuffer<bf16> w(as_bf16(random_bf16_values(std::size_t(out) * in, rng)));
  test::GuardedBuffer<bf16> y(std::size_t(N) * out);
  linear_forward(y.get(), x.get(), w.get(), N, in, out, nullptr);
  const std::size_t plans = GemmContext::current().plan_count();
  for (int i = 0; i < 5; ++i) linear_forward(y.get(), x.get(), w.get(), N, in, out, nullptr);
  EXPECT_EQ(GemmContext::current().plan_count(), plans);
  linear_forward(y.get(), x.get(), w.get(), N, in, out - 8, nullptr);  // a new shape, a new plan
  EXPECT_EQ(GemmContext::current().plan_count(), plans + 1);
  sync();
}

TEST(Gemm, TunedPlanStaysCorrect) {
  QT_REQUIRE_GPU();
  std::mt19937_64 rng(qt::test::test_seed() + 67);
  const int N = 384, in = 512, out = 640;
  const std::vector<double> x = random_bf16_values(std::size_t(N) * in, rng);
  const std::vector<double> w = random_bf16_values(std::size_t(out) * in, rng, 1.0 / std::sqrt(in));
  test::GuardedBuffer<bf16> dx(as_bf16(x)), dw(as_bf16(w)), dy(nan_bf16(std::size_t(N) * out));
  GemmArgs g;  // the forward's GEMM: y[N, out] = x[N, in] w[out, in]^T
  g.trans_b = true;
  g.M = N, g.N = out, g.K = in;
  g.A = dx.get(), g.lda = in, g.B = dw.get(), g.ldb = in, g.C = dy.get(), g.ldc = out;
  const std::vector<float> ms = GemmContext::current().tune(g, nullptr, 8, 3);
  ASSERT_FALSE(ms.empty());
  EXPECT_GT(ms[0], 0.f) << "the heuristic's first choice must run";
  qt::cuda::upload(dy.get(), nan_bf16(std::size_t(N) * out).data(), std::size_t(N) * out * 2);
  linear_forward(dy.get(), dx.get(), dw.get(), N, in, out, nullptr);  // the tuned plan
  sync();
  std::vector<double> ref(std::size_t(N) * out);
  cpu::linear_forward<double>(ref.data(), x.data(), w.data(), N, in, out);
  EXPECT_LE(rel_error(to_doubles(dy.download()), ref), Tol::kBf16);
  EXPECT_TRUE(dy.guard_intact());
}

TEST(Gemm, CallerWorkspaceFromAnArena) {
  QT_REQUIRE_GPU();
  DeviceArena arena(kGemmWorkspaceBytes + (std::size_t{16} << 20), "gemm");
  gemm_init(arena.allocate(kGemmWorkspaceBytes), kGemmWorkspaceBytes);
  EXPECT_EQ(GemmContext::current().plan_count(), 0u);  // a fresh context
  EXPECT_EQ(GemmContext::current().workspace_bytes(), kGemmWorkspaceBytes);
  std::mt19937_64 rng(qt::test::test_seed() + 53);
  const int N = 256, in = 512, out = 384;
  const std::vector<double> x = random_bf16_values(std::size_t(N) * in, rng);
  const std::vector<double> w = random_bf16_values(std::size_t(out) * in, rng);
  bf16* dx = arena.allocate<bf16>(x.size());
  bf16* dw = arena.allocate<bf16>(w.size());
  bf16* dy = arena.allocate<bf16>(std::size_t(N) * out);
  qt::cuda::upload(dx, as_bf16(x).data(), x.size() * 2);
  qt::cuda::upload(dw, as_bf16(w).data(), w.size() * 2);
  linear_forward(dy, dx, dw, N, in, out, nullptr);
  std::vector<bf16> y(std::size_t(N) * out);
  QT_CHECK_CUDA(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> ref(y.size());
  cpu::linear_forward<double>(ref.data(), x.data(), w.data(), N, in, out);
  EXPECT_LE(rel_error(to_doubles(y), ref), Tol::kBf16);
  // Back to a self-owned workspace before the arena goes away.
  gemm_init(nullptr, kGemmWorkspaceBytes);
}

}  // namespace
}  // namespace qt::cuda
