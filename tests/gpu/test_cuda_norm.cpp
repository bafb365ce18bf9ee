// CUDA RMSNorm (plain, fused with the residual add, backward) and fused q/k-norm + RoPE against
// the CPU ops in double on the same bf16 inputs. Also: the forward's rounding order reproduced
// bit for bit on the host, NaN-filled outputs, guard bytes, allowed aliases, deterministic dw.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_op_check.h"
#include "ops/cuda/qk_norm_rope.cuh"
#include "ops/cuda/rmsnorm.cuh"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace qt::test {
namespace {

constexpr double kEps = 1e-6;

// Host emulation of the forward's rounding: bf16(w * bf16(x * r)) in float.
float norm_out(float x, float w, float r) {
  const float t = __bfloat162float(__float2bfloat16_rn(x * r));
  return __bfloat162float(__float2bfloat16_rn(w * t));
}

// Norm weights near 1, as trained ones are.
Bf16Input random_weight(int n, std::mt19937_64& rng) {
  Bf16Input w = random_bf16(n, rng, 0.1);
  for (int i = 0; i < n; ++i) {
    w.bits[i] = to_bf16(1.0 + w.value[i]);
    w.value[i] = from_bf16(w.bits[i]);
  }
  return w;
}

// ---------------------------------------------------------------------------------------------
// rmsnorm

struct NormCase {
  int N, C;
};

class CudaRmsNorm : public ::testing::TestWithParam<NormCase> {};

TEST_P(CudaRmsNorm, ForwardMatchesCpuAndRoundsLikeTransformers) {
  QT_REQUIRE_GPU();
  const auto [N, C] = GetParam();
  auto rng = test_rng();
  Bf16Input x = random_bf16(std::size_t(N) * C, rng);
  for (int c = 0; c < C; ++c) {  // row 0 tiny: eps matters there
    x.bits[c] = to_bf16(x.value[c] * 1e-4);
    x.value[c] = from_bf16(x.bits[c]);
  }
  const Bf16Input w = random_weight(C, rng);
  GuardedBuffer<bf16> dx(x.bits), dw(w.bits), dy(std::size_t(N) * C);
  GuardedBuffer<float> drstd(N);
  fill_nan(dy);
  fill_nan(drstd);
  cuda::rmsnorm_forward(dy.get(), drstd.get(), dx.get(), dw.get(), N, C, kEps, nullptr);

  Vec y(std::size_t(N) * C), rstd(N);
  cpu::rmsnorm_forward<double>(y.data(), rstd.data(), x.value.data(), w.value.data(), N, C, kEps);
  QT_EXPECT_GPU_CLOSE(dy, y, kTolBf16);
  QT_EXPECT_GPU_CLOSE(drstd, rstd, kTolF32);

  // Given the GPU's rstd, every output is the transformers rounding sequence, bit for bit.
  const std::vector<bf16> got = dy.download();
  const std::vector<float> r = drstd.download();
  std::size_t mismatches = 0;
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) {
      const std::size_t k = std::size_t(n) * C + c;
      const float want = norm_out(float(x.value[k]), float(w.value[c]), r[n]);
      mismatches += __bfloat162float(got[k]) != want;
    }
  EXPECT_EQ(mismatches, 0u);
}

TEST_P(CudaRmsNorm, ResidualFusedEqualsAddThenNorm) {
  QT_REQUIRE_GPU();
  const auto [N, C] = GetParam();
  const std::size_t n = std::size_t(N) * C;
  auto rng = test_rng();
  const Bf16Input res = random_bf16(n, rng), x = random_bf16(n, rng, 0.5);
  const Bf16Input w = random_weight(C, rng);
  GuardedBuffer<bf16> dres(res.bits), dx(x.bits), dw(w.bits), dres_out(n), dy(n), dy2(n);
  GuardedBuffer<float> drstd(N), drstd2(N);
  fill_nan(dres_out);
  fill_nan(dy);
  fill_nan(drstd);
  cuda::residual_rmsnorm_forward(dres_out.get(), dy.get(), drstd.get(), dres.get(), dx.get(),
                                 dw.get(), N, C, kEps, nullptr);
  // residual_out = bf16(residual + x) exactly.
  Vec sum(n);
  for (std::size_t k = 0; k < n; ++k) sum[k] = round_bf16(float(res.value[k]) + float(x.value[k]));
  EXPECT_EQ(rel_err(download(dres_out), sum), 0.0);
  EXPECT_TRUE(dres_out.guard_intact());
  // y and rstd: the same bits as the unfused norm of residual_out, and close to the CPU.
  cuda::rmsnorm_forward(dy2.get(), drstd2.get(), dres_out.get(), dw.get(), N, C, kEps, nullptr);
  EXPECT_EQ(rel_err(download(dy), download(dy2)), 0.0);
  EXPECT_TRUE(bitwise_equal(drstd.download(), drstd2.download()));
  Vec y(n), rstd(N);
  cpu::rmsnorm_forward<double>(y.data(), rstd.data(), sum.data(), w.value.data(), N, C, kEps);
  QT_EXPECT_GPU_CLOSE(dy, y, kTolBf16);
  QT_EXPECT_GPU_CLOSE(drstd, rstd, kTolF32);
  // In place on the residual stream: the same results.
  cuda::residual_rmsnorm_forward(dres.get(), dy2.get(), drstd2.get(), dres.get(), dx.get(),
                                 dw.get(), N, C, kEps, nullptr);
  EXPECT_EQ(rel_err(download(dres), download(dres_out)), 0.0);
  EXPECT_EQ(rel_err(download(dy2), download(dy)), 0.0);
}

TEST_P(CudaRmsNorm, BackwardMatchesCpuAndDwIsDeterministic) {
  QT_REQUIRE_GPU();
  const auto [N, C] = GetParam();
  const std::size_t n = std::size_t(N) * C;
  auto rng = test_rng();
  const Bf16Input x = random_bf16(n, rng), g = random_bf16(n, rng);
  const Bf16Input w = random_weight(C, rng);
  const Vec dw0 = random_f32_exact(C, rng);
  GuardedBuffer<bf16> dx_in(x.bits), dw_in(w.bits), dg(g.bits), dy(n), ddx(n);
  GuardedBuffer<float> drstd(N), ddw(cast<float>(dw0));
  GuardedBuffer<char> ws(cuda::rmsnorm_backward_workspace_bytes(N, C));
  cuda::rmsnorm_forward(dy.get(), drstd.get(), dx_in.get(), dw_in.get(), N, C, kEps, nullptr);
  fill_nan(ddx);
  cuda::rmsnorm_backward(ddx.get(), ddw.get(), dg.get(), dx_in.get(), dw_in.get(), drstd.get(), N,
                         C, ws.get(), nullptr);

  Vec y(n), rstd(N), dx(n), dw(dw0);
  cpu::rmsnorm_forward<double>(y.data(), rstd.data(), x.value.data(), w.value.data(), N, C, kEps);
  cpu::rmsnorm_backward<double>(dx.data(), dw.data(), g.value.data(), x.value.data(),
                                w.value.data(), rstd.data(), N, C);
  QT_EXPECT_GPU_CLOSE(ddx, dx, kTolBf16Once);
  // dw is accumulated: compare the increments, so that the prefill cannot hide an error.
  const std::vector<float> dw_gpu = ddw.download();
  Vec inc_gpu(C), inc_cpu(C);
  for (int c = 0; c < C; ++c) inc_gpu[c] = dw_gpu[c] - dw0[c], inc_cpu[c] = dw[c] - dw0[c];
  EXPECT_LT(rel_err(inc_gpu, inc_cpu), kTolF32);
  EXPECT_TRUE(ddw.guard_intact());
  EXPECT_TRUE(ws.guard_intact());

  // The same bits again, with dx aliasing dy this time.
  ddw.upload(cast<float>(dw0));
  cuda::rmsnorm_backward(dg.get(), ddw.get(), dg.get(), dx_in.get(), dw_in.get(), drstd.get(), N, C,
                         ws.get(), nullptr);
  EXPECT_TRUE(bitwise_equal(ddw.download(), dw_gpu)) << "dw differs between two runs";
  EXPECT_EQ(rel_err(download(dg), download(ddx)), 0.0) << "dx aliasing dy";
}

TEST_P(CudaRmsNorm, ResidualBackwardAddsTheNormGradientToTheStream) {
  QT_REQUIRE_GPU();
  const auto [N, C] = GetParam();
  const std::size_t n = std::size_t(N) * C;
  auto rng = test_rng();
  const Bf16Input x = random_bf16(n, rng), g = random_bf16(n, rng), res = random_bf16(n, rng);
  const Bf16Input w = random_weight(C, rng);
  GuardedBuffer<bf16> dx_in(x.bits), dw_in(w.bits), dg(g.bits), dy(n), dres(res.bits), ddx(n);
  GuardedBuffer<float> drstd(N), ddw(C), ddw_plain(C);
  GuardedBuffer<char> ws(cuda::rmsnorm_backward_workspace_bytes(N, C));
  cuda::rmsnorm_forward(dy.get(), drstd.get(), dx_in.get(), dw_in.get(), N, C, kEps, nullptr);
  fill_nan(ddw);
  cuda::residual_rmsnorm_backward(dres.get(), ddw.get(), dg.get(), dx_in.get(), dw_in.get(),
                                  drstd.get(), N, C, ws.get(), nullptr, /*accumulate=*/false);

  // dres = residual + the norm's input gradient (double CPU op), one bf16 rounding.
  Vec y(n), rstd(N), dx(n), dw(C, 0.0);
  cpu::rmsnorm_forward<double>(y.data(), rstd.data(), x.value.data(), w.value.data(), N, C, kEps);
  cpu::rmsnorm_backward<double>(dx.data(), dw.data(), g.value.data(), x.value.data(),
                                w.value.data(), rstd.data(), N, C);
  Vec want(n);
  for (std::size_t k = 0; k < n; ++k) want[k] = res.value[k] + dx[k];
  QT_EXPECT_GPU_CLOSE(dres, want, kTolBf16Once);
  QT_EXPECT_GPU_CLOSE(ddw, dw, kTolF32);
  EXPECT_TRUE(dres.guard_intact());
  EXPECT_TRUE(ws.guard_intact());
  // dw: the same bits as the plain backward's (written, not accumulated).
  fill_nan(ddw_plain);
  cuda::rmsnorm_backward(ddx.get(), ddw_plain.get(), dg.get(), dx_in.get(), dw_in.get(),
                         drstd.get(), N, C, ws.get(), nullptr, /*accumulate=*/false);
  EXPECT_TRUE(bitwise_equal(ddw.download(), ddw_plain.download()));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaRmsNorm,
                         ::testing::Values(NormCase{37, 264}, NormCase{130, 1024},
                                           NormCase{9, 2048}, NormCase{3, 8}, NormCase{5, 8192},
                                           NormCase{2051, 1024}),
                         [](const auto& i) {
                           return "N" + std::to_string(i.param.N) + "_C" +
                                  std::to_string(i.param.C);
                         });

// ---------------------------------------------------------------------------------------------
// q/k norm + RoPE

struct QkCase {
  int B, T, heads, hd;
  bool pos;
};

class CudaQkNormRope : public ::testing::TestWithParam<QkCase> {
 protected:
  void SetUp() override {
    if (!gpu_available()) return;
    const QkCase& p = GetParam();
    rng_ = test_rng();
    rows_ = std::size_t(p.B) * p.T * p.heads;
    n_ = rows_ * p.hd;
    max_pos_ = p.pos ? p.T + 40 : p.T;
    const std::size_t tab = std::size_t(max_pos_) * p.hd / 2;
    cos_.resize(tab);
    sin_.resize(tab);
    cpu::rope_table(cos_.data(), sin_.data(), max_pos_, p.hd, 1e6);
    cos_r_ = cos_, sin_r_ = sin_;  // transformers rounds the tables to bf16
    for (std::size_t i = 0; i < tab; ++i)
      cos_r_[i] = float(round_bf16(cos_[i])), sin_r_[i] = float(round_bf16(sin_[i]));
    if (p.pos) {
      std::uniform_int_distribution<int> d(0, max_pos_ - 1);
      pos_.resize(std::size_t(p.B) * p.T);
      for (auto& v : pos_) v = d(rng_);
    }
  }
  std::mt19937_64 rng_;
  std::size_t rows_ = 0, n_ = 0;
  int max_pos_ = 0;
  std::vector<float> cos_, sin_, cos_r_, sin_r_;
  std::vector<std::int32_t> pos_;
};

TEST_P(CudaQkNormRope, ForwardMatchesCpuAndRoundsLikeTransformers) {
  QT_REQUIRE_GPU();
  const QkCase p = GetParam();
  const Bf16Input x = random_bf16(n_, rng_, 2.0);
  const Bf16Input w = random_weight(p.hd, rng_);
  GuardedBuffer<bf16> dx(x.bits), dw(w.bits), dout(n_);
  GuardedBuffer<float> drstd(rows_), dcos(cos_), dsin(sin_);
  GuardedBuffer<std::int32_t> dpos(std::max<std::size_t>(pos_.size(), 1));
  if (p.pos) dpos.upload(pos_);
  const std::int32_t* pos = p.pos ? dpos.get() : nullptr;
  fill_nan(dout);
  fill_nan(drstd);
  cuda::qk_norm_rope_forward(dout.get(), drstd.get(), dx.get(), dw.get(), dcos.get(), dsin.get(),
                             pos, p.B, p.T, p.heads, p.hd, kEps, nullptr);

  Vec y(n_), rstd(rows_);
  cpu::rmsnorm_forward<double>(y.data(), rstd.data(), x.value.data(), w.value.data(),
                               static_cast<int>(rows_), p.hd, kEps);
  cpu::rope_forward<double>(y.data(), cos_r_.data(), sin_r_.data(), p.pos ? pos_.data() : nullptr,
                            p.B, p.T, p.heads, p.hd);
  QT_EXPECT_GPU_CLOSE(dout, y, kTolBf16);
  QT_EXPECT_GPU_CLOSE(drstd, rstd, kTolF32);

  // Bit for bit: norm rounded as transformers does, then each RoPE product and the sum rounded.
  const std::vector<bf16> got = dout.download();
  const std::vector<float> r = drstd.download();
  const int half = p.hd / 2;
  std::size_t mismatches = 0;
  for (std::size_t row = 0; row < rows_; ++row) {
    const std::size_t bt = row / p.heads;
    const std::size_t at = p.pos ? pos_[bt] : bt % p.T;
    std::vector<float> yn(p.hd);
    for (int i = 0; i < p.hd; ++i)
      yn[i] = norm_out(float(x.value[row * p.hd + i]), float(w.value[i]), r[row]);
    for (int i = 0; i < p.hd; ++i) {
      const float c = cos_r_[at * half + i % half], s = sin_r_[at * half + i % half];
      const float rot = i < half ? -yn[i + half] : yn[i - half];
      const float a = float(round_bf16(yn[i] * c)), b = float(round_bf16(rot * s));
      mismatches += __bfloat162float(got[row * p.hd + i]) != float(round_bf16(a + b));
    }
  }
  EXPECT_EQ(mismatches, 0u);

  // In place (out = x): the same bits.
  cuda::qk_norm_rope_forward(dx.get(), drstd.get(), dx.get(), dw.get(), dcos.get(), dsin.get(), pos,
                             p.B, p.T, p.heads, p.hd, kEps, nullptr);
  EXPECT_EQ(rel_err(download(dx), download(dout)), 0.0);
}

TEST_P(CudaQkNormRope, BackwardMatchesCpuAndDwIsDeterministic) {
  QT_REQUIRE_GPU();
  const QkCase p = GetParam();
  const Bf16Input x = random_bf16(n_, rng_, 2.0), g = random_bf16(n_, rng_);
  const Bf16Input w = random_weight(p.hd, rng_);
  const Vec dw0 = random_f32_exact(p.hd, rng_);
  GuardedBuffer<bf16> dx_in(x.bits), dw_in(w.bits), dg(g.bits), dout(n_), ddx(n_);
  GuardedBuffer<float> drstd(rows_), dcos(cos_), dsin(sin_), ddw(cast<float>(dw0));
  GuardedBuffer<std::int32_t> dpos(std::max<std::size_t>(pos_.size(), 1));
  if (p.pos) dpos.upload(pos_);
  const std::int32_t* pos = p.pos ? dpos.get() : nullptr;
  GuardedBuffer<char> ws(cuda::qk_norm_rope_backward_workspace_bytes(p.B, p.T, p.heads, p.hd));
  cuda::qk_norm_rope_forward(dout.get(), drstd.get(), dx_in.get(), dw_in.get(), dcos.get(),
                             dsin.get(), pos, p.B, p.T, p.heads, p.hd, kEps, nullptr);
  fill_nan(ddx);
  cuda::qk_norm_rope_backward(ddx.get(), ddw.get(), dg.get(), dx_in.get(), dw_in.get(), drstd.get(),
                              dcos.get(), dsin.get(), pos, p.B, p.T, p.heads, p.hd, ws.get(),
                              nullptr);

  // CPU: undo the rotation of the incoming gradient, then the norm's backward.
  const int rows = static_cast<int>(rows_);
  Vec y(n_), rstd(rows_), dy = g.value, dx(n_), dw = dw0;
  cpu::rmsnorm_forward<double>(y.data(), rstd.data(), x.value.data(), w.value.data(), rows, p.hd,
                               kEps);
  cpu::rope_backward<double>(dy.data(), cos_r_.data(), sin_r_.data(), p.pos ? pos_.data() : nullptr,
                             p.B, p.T, p.heads, p.hd);
  cpu::rmsnorm_backward<double>(dx.data(), dw.data(), dy.data(), x.value.data(), w.value.data(),
                                rstd.data(), rows, p.hd);
  QT_EXPECT_GPU_CLOSE(ddx, dx, kTolBf16Once);
  const std::vector<float> dw_gpu = ddw.download();
  Vec inc_gpu(p.hd), inc_cpu(p.hd);
  for (int c = 0; c < p.hd; ++c) inc_gpu[c] = dw_gpu[c] - dw0[c], inc_cpu[c] = dw[c] - dw0[c];
  EXPECT_LT(rel_err(inc_gpu, inc_cpu), kTolF32);
  EXPECT_TRUE(ddw.guard_intact());
  EXPECT_TRUE(ws.guard_intact());

  // Again with dx aliasing dout: the same bits, dw included.
  ddw.upload(cast<float>(dw0));
  cuda::qk_norm_rope_backward(dg.get(), ddw.get(), dg.get(), dx_in.get(), dw_in.get(), drstd.get(),
                              dcos.get(), dsin.get(), pos, p.B, p.T, p.heads, p.hd, ws.get(),
                              nullptr);
  EXPECT_TRUE(bitwise_equal(ddw.download(), dw_gpu)) << "dw differs between two runs";
  EXPECT_EQ(rel_err(download(dg), download(ddx)), 0.0) << "dx aliasing dout";
}

// The strided forms (q or k read from, and its gradient written into, a wider [tokens, ld] buffer,
// as the model's fused q/k/v GEMM lays them out) give the same bits as the contiguous op, and
// leave the other columns of the wide buffer untouched.
TEST_P(CudaQkNormRope, StridedMatchesContiguousBitForBit) {
  QT_REQUIRE_GPU();
  const QkCase p = GetParam();
  const int width = p.heads * p.hd, ld = width + 24, col0 = 8;  // x sits at columns [8, 8 + width)
  const std::size_t tokens = std::size_t(p.B) * p.T;
  const Bf16Input x = random_bf16(n_, rng_, 2.0), g = random_bf16(n_, rng_);
  const Bf16Input w = random_weight(p.hd, rng_);
  std::vector<bf16> wide(tokens * ld, to_bf16(0.5));
  for (std::size_t t = 0; t < tokens; ++t)
    for (int c = 0; c < width; ++c) wide[t * ld + col0 + c] = x.bits[t * width + c];
  GuardedBuffer<bf16> dx(x.bits), dwide(wide), dw(w.bits), dg(g.bits);
  GuardedBuffer<bf16> out_ref(n_), out(n_), dx_ref(n_), dx_wide(tokens * ld);
  GuardedBuffer<float> rstd_ref(rows_), rstd(rows_), dcos(cos_), dsin(sin_);
  GuardedBuffer<float> dw_ref(std::vector<float>(p.hd, 0.0f)), dw_s(std::vector<float>(p.hd, 0.0f));
  GuardedBuffer<std::int32_t> dpos(std::max<std::size_t>(pos_.size(), 1));
  if (p.pos) dpos.upload(pos_);
  const std::int32_t* pos = p.pos ? dpos.get() : nullptr;
  GuardedBuffer<char> ws(cuda::qk_norm_rope_backward_workspace_bytes(p.B, p.T, p.heads, p.hd));
  cuda::qk_norm_rope_forward(out_ref.get(), rstd_ref.get(), dx.get(), dw.get(), dcos.get(),
                             dsin.get(), pos, p.B, p.T, p.heads, p.hd, kEps, nullptr);
  cuda::qk_norm_rope_backward(dx_ref.get(), dw_ref.get(), dg.get(), dx.get(), dw.get(),
                              rstd_ref.get(), dcos.get(), dsin.get(), pos, p.B, p.T, p.heads, p.hd,
                              ws.get(), nullptr);
  fill_nan(out);
  fill_nan(dx_wide);
  cuda::qk_norm_rope_forward_strided(out.get(), rstd.get(), dwide.get() + col0, ld, dw.get(),
                                     dcos.get(), dsin.get(), pos, p.B, p.T, p.heads, p.hd, kEps,
                                     nullptr);
  cuda::qk_norm_rope_backward_strided(dx_wide.get() + col0, ld, dw_s.get(), dg.get(),
                                      dwide.get() + col0, ld, dw.get(), rstd.get(), dcos.get(),
                                      dsin.get(), pos, p.B, p.T, p.heads, p.hd, ws.get(), nullptr);
  EXPECT_EQ(rel_err(download(out), download(out_ref)), 0.0) << "out";
  EXPECT_TRUE(bitwise_equal(rstd.download(), rstd_ref.download())) << "rstd";
  EXPECT_TRUE(bitwise_equal(dw_s.download(), dw_ref.download())) << "dw";
  const Vec got = download(dx_wide), want = download(dx_ref);
  std::size_t bad = 0, outside = 0;
  for (std::size_t t = 0; t < tokens; ++t)
    for (int c = 0; c < ld; ++c) {
      const double v = got[t * ld + c];
      if (c >= col0 && c < col0 + width)
        bad += v != want[t * width + c - col0];
      else
        outside += !std::isnan(v);
    }
  EXPECT_EQ(bad, 0u) << "dx differs from the contiguous op";
  EXPECT_EQ(outside, 0u) << "columns outside the head block were written";
  EXPECT_TRUE(dx_wide.guard_intact());
  EXPECT_TRUE(out.guard_intact());
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaQkNormRope,
                         ::testing::Values(QkCase{2, 17, 3, 128, false}, QkCase{1, 33, 4, 64, true},
                                           QkCase{2, 40, 16, 128, true},
                                           QkCase{3, 300, 8, 64, false}, QkCase{1, 9, 5, 32, true},
                                           QkCase{1, 11, 2, 256, false}),
                         [](const auto& i) {
                           const QkCase& c = i.param;
                           return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_h" +
                                  std::to_string(c.heads) + "_hd" + std::to_string(c.hd) +
                                  (c.pos ? "_pos" : "");
                         });

}  // namespace
}  // namespace qt::test
