// CPU reference ops. Every op: forward against a naive double reference (where one is simple),
// backward against central finite differences of L = sum(r * y) in double, the float
// instantiation against double, NaN-filled outputs that must be overwritten (=) or prefilled
// gradients that must be added to (+=), and guard bytes around outputs.
// Suites are named ops_<op> so that `ctest -R ops` selects them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "check.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

namespace qt::cpu {
namespace {

using test::cast;
using test::dot;
using test::fd_grad;
using test::Guarded;
using test::kTolF32;
using test::kTolF64;
using test::kTolFd;
using test::random_f32_exact;
using test::test_rng;
using test::Vec;
using I32 = std::vector<std::int32_t>;

// ---------------------------------------------------------------------------------------------
// gemm

// C[M,N] = alpha op(A) op(B) + beta C, with padded leading dimensions.
template <typename T>
void check_gemm(bool ta, bool tb, double tol) {
  auto rng = test_rng();
  const int M = 7, N = 5, K = 9, pad = 3;
  const int a_rows = ta ? K : M, a_cols = ta ? M : K;
  const int b_rows = tb ? N : K, b_cols = tb ? K : N;
  const int lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
  const Vec A = random_f32_exact(std::size_t(a_rows) * lda, rng);
  const Vec B = random_f32_exact(std::size_t(b_rows) * ldb, rng);
  const Vec C0 = random_f32_exact(std::size_t(M) * ldc, rng);
  const double alpha = 0.75, beta = -1.5;
  Vec want = C0;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double s = 0.0;
      for (int k = 0; k < K; ++k)
        s += (ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
      want[i * ldc + j] = alpha * s + beta * C0[i * ldc + j];
    }
  Guarded<T> C(cast<T>(C0));
  const auto At = cast<T>(A), Bt = cast<T>(B);
  gemm<T>(ta, tb, M, N, K, T(alpha), At.data(), lda, Bt.data(), ldb, T(beta), C.data(), ldc);
  QT_EXPECT_CLOSE(C.values(), want, tol);  // also checks the padding columns are untouched
  EXPECT_TRUE(C.guards_intact());
}

TEST(ops_gemm, AllTransposesAgainstNaive) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "trans_a=" << ta << " trans_b=" << tb);
      check_gemm<double>(ta, tb, kTolF64);
      check_gemm<float>(ta, tb, kTolF32);
    }
}

TEST(ops_gemm, BetaZeroOverwritesNaN) {
  auto rng = test_rng();
  const int M = 4, N = 6, K = 3;
  const Vec A = random_f32_exact(M * K, rng), B = random_f32_exact(K * N, rng);
  Guarded<double> C(M * N);  // NaN
  gemm<double>(false, false, M, N, K, 1.0, A.data(), K, B.data(), N, 0.0, C.data(), N);
  Vec want(M * N, 0.0);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j)
      for (int k = 0; k < K; ++k) want[i * N + j] += A[i * K + k] * B[k * N + j];
  QT_EXPECT_CLOSE(C.values(), want, kTolF64);
}

// ---------------------------------------------------------------------------------------------
// linear

Vec linear_naive(const Vec& x, const Vec& w, int N, int in, int out) {
  Vec y(std::size_t(N) * out, 0.0);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < out; ++o)
      for (int i = 0; i < in; ++i) y[n * out + o] += x[n * in + i] * w[o * in + i];
  return y;
}

TEST(ops_linear, ForwardAgainstNaive) {
  auto rng = test_rng();
  const int N = 6, in = 11, out = 7;
  const Vec x = random_f32_exact(N * in, rng), w = random_f32_exact(out * in, rng);
  const Vec want = linear_naive(x, w, N, in, out);
  Guarded<double> y(N * out);
  linear_forward<double>(y.data(), x.data(), w.data(), N, in, out);
  QT_EXPECT_CLOSE(y.values(), want, kTolF64);
  EXPECT_TRUE(y.guards_intact());
  Guarded<float> yf(N * out);
  linear_forward<float>(yf.data(), cast<float>(x).data(), cast<float>(w).data(), N, in, out);
  QT_EXPECT_CLOSE(yf.values(), want, kTolF32);
}

TEST(ops_linear, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  const int N = 3, in = 5, out = 4;
  Vec x = random_f32_exact(N * in, rng), w = random_f32_exact(out * in, rng);
  const Vec r = random_f32_exact(N * out, rng), dw0 = random_f32_exact(out * in, rng);
  auto loss = [&] {
    Vec y(N * out);
    linear_forward<double>(y.data(), x.data(), w.data(), N, in, out);
    return dot(r, y);
  };
  Guarded<double> dx(N * in), dw(dw0);
  linear_backward<double>(dx.data(), dw.data(), r.data(), x.data(), w.data(), N, in, out);
  Vec dw_new = dw.values();
  for (std::size_t i = 0; i < dw_new.size(); ++i) dw_new[i] -= dw0[i];  // += contract
  QT_EXPECT_CLOSE(dx.values(), fd_grad(x, loss), kTolFd);
  QT_EXPECT_CLOSE(dw_new, fd_grad(w, loss), kTolFd);
  EXPECT_TRUE(dx.guards_intact() && dw.guards_intact());

  // dx == nullptr: only dw is accumulated, identically.
  Guarded<double> dw2(dw0);
  linear_backward<double>(nullptr, dw2.data(), r.data(), x.data(), w.data(), N, in, out);
  QT_EXPECT_CLOSE(dw2.values(), dw.values(), kTolF64);

  // float against double
  Guarded<float> dxf(N * in), dwf(cast<float>(dw0));
  linear_backward<float>(dxf.data(), dwf.data(), cast<float>(r).data(), cast<float>(x).data(),
                         cast<float>(w).data(), N, in, out);
  QT_EXPECT_CLOSE(dxf.values(), dx.values(), kTolF32);
  QT_EXPECT_CLOSE(dwf.values(), dw.values(), kTolF32);
}

// ---------------------------------------------------------------------------------------------
// rmsnorm

constexpr double kEps = 1e-6;

// Rows of x scaled differently; the last row is tiny so that eps dominates mean(x^2).
Vec rmsnorm_input(int N, int C, std::mt19937_64& rng) {
  Vec x = random_f32_exact(std::size_t(N) * C, rng);
  for (int c = 0; c < C; ++c) {
    x[c] = static_cast<float>(x[c] * 30.0);
    x[std::size_t(N - 1) * C + c] = static_cast<float>(x[std::size_t(N - 1) * C + c] * 1e-4);
  }
  return x;
}

TEST(ops_rmsnorm, ForwardAgainstNaive) {
  auto rng = test_rng();
  const int N = 5, C = 16;
  const Vec x = rmsnorm_input(N, C, rng);
  const Vec w = random_f32_exact(C, rng);
  Vec want(N * C), want_rstd(N);
  for (int n = 0; n < N; ++n) {
    double ss = 0.0;
    for (int c = 0; c < C; ++c) ss += x[n * C + c] * x[n * C + c];
    want_rstd[n] = 1.0 / std::sqrt(ss / C + kEps);
    for (int c = 0; c < C; ++c) want[n * C + c] = w[c] * x[n * C + c] * want_rstd[n];
  }
  Guarded<double> y(N * C), rstd(N);
  rmsnorm_forward<double>(y.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
  QT_EXPECT_CLOSE(y.values(), want, kTolF64);
  QT_EXPECT_CLOSE(rstd.values(), want_rstd, kTolF64);
  EXPECT_TRUE(y.guards_intact() && rstd.guards_intact());
  Guarded<float> yf(N * C), rstdf(N);
  rmsnorm_forward<float>(yf.data(), rstdf.data(), cast<float>(x).data(), cast<float>(w).data(), N,
                         C, kEps);
  QT_EXPECT_CLOSE(yf.values(), want, kTolF32);
  QT_EXPECT_CLOSE(rstdf.values(), want_rstd, kTolF32);
}

TEST(ops_rmsnorm, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  const int N = 4, C = 8;
  Vec x = rmsnorm_input(N, C, rng), w = random_f32_exact(C, rng);
  const Vec r = random_f32_exact(N * C, rng), dw0 = random_f32_exact(C, rng);
  auto loss = [&] {
    Vec y(N * C), rstd(N);
    rmsnorm_forward<double>(y.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
    return dot(r, y);
  };
  Vec y(N * C), rstd(N);
  rmsnorm_forward<double>(y.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
  Guarded<double> dx(N * C), dw(dw0);
  rmsnorm_backward<double>(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
  Vec dw_new = dw.values();
  for (int c = 0; c < C; ++c) dw_new[c] -= dw0[c];               // += contract
  QT_EXPECT_CLOSE(dx.values(), fd_grad(x, loss, 1e-3), kTolFd);  // the tiny row needs small steps
  QT_EXPECT_CLOSE(dw_new, fd_grad(w, loss), kTolFd);
  EXPECT_TRUE(dx.guards_intact() && dw.guards_intact());

  // dx may alias dy.
  Vec inplace = r, dw2 = dw0;
  rmsnorm_backward<double>(inplace.data(), dw2.data(), inplace.data(), x.data(), w.data(),
                           rstd.data(), N, C);
  QT_EXPECT_CLOSE(inplace, dx.values(), kTolF64);
  QT_EXPECT_CLOSE(dw2, dw.values(), kTolF64);

  // float against double (float forward gives its own rstd)
  const auto xf = cast<float>(x), wf = cast<float>(w);
  std::vector<float> yf(N * C), rstdf(N);
  rmsnorm_forward<float>(yf.data(), rstdf.data(), xf.data(), wf.data(), N, C, kEps);
  Guarded<float> dxf(N * C), dwf(cast<float>(dw0));
  rmsnorm_backward<float>(dxf.data(), dwf.data(), cast<float>(r).data(), xf.data(), wf.data(),
                          rstdf.data(), N, C);
  QT_EXPECT_CLOSE(dxf.values(), dx.values(), kTolF32);
  QT_EXPECT_CLOSE(dwf.values(), dw.values(), kTolF32);
}

// ---------------------------------------------------------------------------------------------
// rope

TEST(ops_rope, TableIsTheFp32Formula) {
  const int max_pos = 300, hd = 16, half = hd / 2;
  const double theta = 1e6;
  std::vector<float> cs(max_pos * half), sn(max_pos * half);
  rope_table(cs.data(), sn.data(), max_pos, hd, theta);
  for (int p = 0; p < max_pos; ++p)
    for (int i = 0; i < half; ++i) {
      // Bit-exact: fp32 exponent, fp32 power, fp32 reciprocal, fp32 angle (transformers order).
      const float e = float(2 * i) / float(hd);
      const float inv_freq = 1.0f / std::pow(float(theta), e);
      const float angle = float(p) * inv_freq;
      ASSERT_EQ(cs[p * half + i], std::cos(angle)) << "p=" << p << " i=" << i;
      ASSERT_EQ(sn[p * half + i], std::sin(angle)) << "p=" << p << " i=" << i;
      // And close to the exact angle p / theta^(2i/hd) (fp32 rounding only).
      const double exact = p / std::pow(theta, 2.0 * i / hd);
      ASSERT_NEAR(cs[p * half + i], std::cos(exact), 1e-4);
      ASSERT_NEAR(sn[p * half + i], std::sin(exact), 1e-4);
    }
}

TEST(ops_rope, TableKnownValues) {
  // theta = 1e4, hd = 4: inv_freq = {1, 1e-2}.
  std::vector<float> cs(3 * 2), sn(3 * 2);
  rope_table(cs.data(), sn.data(), 3, 4, 1e4);
  EXPECT_EQ(cs[0], 1.0f);
  EXPECT_EQ(sn[1], 0.0f);
  EXPECT_FLOAT_EQ(cs[2], std::cos(1.0f));
  EXPECT_FLOAT_EQ(sn[3], std::sin(0.01f));
  EXPECT_FLOAT_EQ(sn[4], std::sin(2.0f));
  EXPECT_FLOAT_EQ(cs[5], std::cos(0.02f));
}

struct RopeCase {
  int B = 2, Tn = 5, heads = 3, hd = 8, max_pos = 64;
  std::vector<float> cs, sn;
  I32 pos;
  explicit RopeCase(std::mt19937_64& rng) : cs(max_pos * hd / 2), sn(max_pos * hd / 2) {
    rope_table(cs.data(), sn.data(), max_pos, hd, 1e4);
    std::uniform_int_distribution<int> d(0, max_pos - 1);
    pos.resize(B * Tn);
    for (auto& p : pos) p = d(rng);
  }
  std::size_t size() const { return std::size_t(B) * Tn * heads * hd; }
};

TEST(ops_rope, ForwardIsTheRotation) {
  auto rng = test_rng();
  const RopeCase rc(rng);
  const int half = rc.hd / 2;
  const Vec x = random_f32_exact(rc.size(), rng);
  for (bool with_pos : {false, true}) {
    SCOPED_TRACE(with_pos ? "positions given" : "position = t");
    Vec want(x.size());
    for (int b = 0; b < rc.B; ++b)
      for (int t = 0; t < rc.Tn; ++t)
        for (int h = 0; h < rc.heads; ++h) {
          const int p = with_pos ? rc.pos[b * rc.Tn + t] : t;
          const std::size_t o = ((std::size_t(b) * rc.Tn + t) * rc.heads + h) * rc.hd;
          for (int i = 0; i < half; ++i) {
            const double c = rc.cs[p * half + i], s = rc.sn[p * half + i];
            want[o + i] = x[o + i] * c - x[o + i + half] * s;
            want[o + i + half] = x[o + i + half] * c + x[o + i] * s;
          }
        }
    const I32* pos = with_pos ? &rc.pos : nullptr;
    Vec y = x;
    rope_forward<double>(y.data(), rc.cs.data(), rc.sn.data(), pos ? pos->data() : nullptr, rc.B,
                         rc.Tn, rc.heads, rc.hd);
    QT_EXPECT_CLOSE(y, want, kTolF64);
    auto yf = cast<float>(x);
    rope_forward<float>(yf.data(), rc.cs.data(), rc.sn.data(), pos ? pos->data() : nullptr, rc.B,
                        rc.Tn, rc.heads, rc.hd);
    QT_EXPECT_CLOSE(yf, want, kTolF32);
  }
}

TEST(ops_rope, BackwardIsTransposeAndInverse) {
  auto rng = test_rng();
  const RopeCase rc(rng);
  Vec x = random_f32_exact(rc.size(), rng);
  const Vec r = random_f32_exact(rc.size(), rng);
  auto loss = [&] {
    Vec y = x;
    rope_forward<double>(y.data(), rc.cs.data(), rc.sn.data(), rc.pos.data(), rc.B, rc.Tn, rc.heads,
                         rc.hd);
    return dot(r, y);
  };
  Vec dx = r;
  rope_backward<double>(dx.data(), rc.cs.data(), rc.sn.data(), rc.pos.data(), rc.B, rc.Tn, rc.heads,
                        rc.hd);
  QT_EXPECT_CLOSE(dx, fd_grad(x, loss), kTolFd);

  // backward(forward(x)) = x, up to cos^2 + sin^2 = 1 in fp32.
  Vec y = x;
  rope_forward<double>(y.data(), rc.cs.data(), rc.sn.data(), rc.pos.data(), rc.B, rc.Tn, rc.heads,
                       rc.hd);
  EXPECT_GT(test::rel_err(y, x), 1e-3);  // the rotation does something
  rope_backward<double>(y.data(), rc.cs.data(), rc.sn.data(), rc.pos.data(), rc.B, rc.Tn, rc.heads,
                        rc.hd);
  QT_EXPECT_CLOSE(y, x, 1e-6);

  auto dxf = cast<float>(r);
  rope_backward<float>(dxf.data(), rc.cs.data(), rc.sn.data(), rc.pos.data(), rc.B, rc.Tn, rc.heads,
                       rc.hd);
  QT_EXPECT_CLOSE(dxf, dx, kTolF32);
}

// ---------------------------------------------------------------------------------------------
// attention

struct AttnShape {
  int B, Tn, nh, nkv, hd;
  std::size_t q_size() const { return std::size_t(B) * Tn * nh * hd; }
  std::size_t kv_size() const { return std::size_t(B) * Tn * nkv * hd; }
  std::size_t lse_size() const { return std::size_t(B) * nh * Tn; }
};

// Explicit masked softmax of the scaled scores, in double.
void attention_naive(Vec& out, Vec& lse, const Vec& q, const Vec& k, const Vec& v,
                     const AttnShape& s) {
  out.assign(s.q_size(), 0.0);
  lse.assign(s.lse_size(), 0.0);
  const double scale = 1.0 / std::sqrt(double(s.hd));
  auto qi = [&](int b, int t, int h) { return ((std::size_t(b) * s.Tn + t) * s.nh + h) * s.hd; };
  auto ki = [&](int b, int t, int g) { return ((std::size_t(b) * s.Tn + t) * s.nkv + g) * s.hd; };
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.nh; ++h) {
      const int g = h / (s.nh / s.nkv);
      for (int i = 0; i < s.Tn; ++i) {
        Vec sc(s.Tn, -INFINITY);  // masked above the diagonal
        for (int j = 0; j <= i; ++j) {
          double d = 0.0;
          for (int c = 0; c < s.hd; ++c) d += q[qi(b, i, h) + c] * k[ki(b, j, g) + c];
          sc[j] = d * scale;
        }
        const double m = *std::max_element(sc.begin(), sc.end());
        double z = 0.0;
        for (int j = 0; j < s.Tn; ++j) z += std::exp(sc[j] - m);
        lse[(std::size_t(b) * s.nh + h) * s.Tn + i] = m + std::log(z);
        for (int j = 0; j < s.Tn; ++j)
          for (int c = 0; c < s.hd; ++c)
            out[qi(b, i, h) + c] += std::exp(sc[j] - m) / z * v[ki(b, j, g) + c];
      }
    }
}

TEST(ops_attention, ForwardAgainstMaskedSoftmax) {
  auto rng = test_rng();
  for (int ratio : {1, 2, 4}) {
    for (double qk_scale : {1.0, 8.0}) {  // 8: scores of order 100, checks the max subtraction
      const AttnShape s{2, 9, 4, 4 / ratio, 8};
      SCOPED_TRACE(::testing::Message() << "nh/nkv=" << ratio << " qk_scale=" << qk_scale);
      const Vec q = random_f32_exact(s.q_size(), rng, qk_scale);
      const Vec k = random_f32_exact(s.kv_size(), rng, qk_scale);
      const Vec v = random_f32_exact(s.kv_size(), rng);
      Vec want, want_lse;
      attention_naive(want, want_lse, q, k, v, s);
      Guarded<double> out(s.q_size()), lse(s.lse_size());
      attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn,
                                s.nh, s.nkv, s.hd);
      QT_EXPECT_CLOSE(out.values(), want, kTolF64);
      QT_EXPECT_CLOSE(lse.values(), want_lse, kTolF64);
      EXPECT_TRUE(out.guards_intact() && lse.guards_intact());
      Guarded<float> outf(s.q_size()), lsef(s.lse_size());
      attention_forward<float>(outf.data(), lsef.data(), cast<float>(q).data(),
                               cast<float>(k).data(), cast<float>(v).data(), s.B, s.Tn, s.nh, s.nkv,
                               s.hd);
      QT_EXPECT_CLOSE(outf.values(), want, kTolF32);
      QT_EXPECT_CLOSE(lsef.values(), want_lse, kTolF32);
    }
  }
}

// Scores of order 1000: exp overflows unless the row maximum is subtracted (over the unmasked
// entries only: a masked larger score would make every exp underflow).
TEST(ops_attention, LargeScoresStayFinite) {
  auto rng = test_rng();
  const AttnShape s{1, 12, 2, 1, 16};
  const Vec q = random_f32_exact(s.q_size(), rng, 30.0),
            k = random_f32_exact(s.kv_size(), rng, 30.0), v = random_f32_exact(s.kv_size(), rng);
  Vec want, want_lse;
  attention_naive(want, want_lse, q, k, v, s);
  Vec out(s.q_size()), lse(s.lse_size());
  attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn, s.nh,
                            s.nkv, s.hd);
  QT_EXPECT_CLOSE(out, want, 1e-9);  // scores of 1e3 carry absolute rounding errors of 1e-13
  QT_EXPECT_CLOSE(lse, want_lse, 1e-9);
  std::vector<float> outf(s.q_size()), lsef(s.lse_size());
  attention_forward<float>(outf.data(), lsef.data(), cast<float>(q).data(), cast<float>(k).data(),
                           cast<float>(v).data(), s.B, s.Tn, s.nh, s.nkv, s.hd);
  QT_EXPECT_CLOSE(lsef, want_lse, kTolF32);
  QT_EXPECT_CLOSE(outf, want, 1e-2);  // fp32 scores of 1e3: errors of 1e-4 in the exponents
}

TEST(ops_attention, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  for (int ratio : {1, 2, 4}) {
    const AttnShape s{2, 5, 4, 4 / ratio, 6};
    SCOPED_TRACE(::testing::Message() << "nh/nkv=" << ratio);
    Vec q = random_f32_exact(s.q_size(), rng), k = random_f32_exact(s.kv_size(), rng),
        v = random_f32_exact(s.kv_size(), rng);
    const Vec r = random_f32_exact(s.q_size(), rng);
    Vec out(s.q_size()), lse(s.lse_size());
    auto loss = [&] {
      attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn,
                                s.nh, s.nkv, s.hd);
      return dot(r, out);
    };
    loss();
    Guarded<double> dq(s.q_size()), dk(s.kv_size()), dv(s.kv_size());  // NaN: must be written
    attention_backward<double>(dq.data(), dk.data(), dv.data(), r.data(), q.data(), k.data(),
                               v.data(), out.data(), lse.data(), s.B, s.Tn, s.nh, s.nkv, s.hd);
    EXPECT_TRUE(dq.guards_intact() && dk.guards_intact() && dv.guards_intact());
    QT_EXPECT_CLOSE(dq.values(), fd_grad(q, loss), kTolFd);
    QT_EXPECT_CLOSE(dk.values(), fd_grad(k, loss), kTolFd);
    QT_EXPECT_CLOSE(dv.values(), fd_grad(v, loss), kTolFd);
  }
}

TEST(ops_attention, FloatAgainstDoubleLonger) {
  auto rng = test_rng();
  const AttnShape s{1, 96, 4, 2, 32};
  const Vec q = random_f32_exact(s.q_size(), rng), k = random_f32_exact(s.kv_size(), rng),
            v = random_f32_exact(s.kv_size(), rng), r = random_f32_exact(s.q_size(), rng);
  Vec out(s.q_size()), lse(s.lse_size()), dq(s.q_size()), dk(s.kv_size()), dv(s.kv_size());
  attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn, s.nh,
                            s.nkv, s.hd);
  attention_backward<double>(dq.data(), dk.data(), dv.data(), r.data(), q.data(), k.data(),
                             v.data(), out.data(), lse.data(), s.B, s.Tn, s.nh, s.nkv, s.hd);
  Vec want, want_lse;
  attention_naive(want, want_lse, q, k, v, s);
  QT_EXPECT_CLOSE(out, want, kTolF64);

  const auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), rf = cast<float>(r);
  std::vector<float> outf(s.q_size()), lsef(s.lse_size());
  std::vector<float> dqf(s.q_size()), dkf(s.kv_size()), dvf(s.kv_size());
  attention_forward<float>(outf.data(), lsef.data(), qf.data(), kf.data(), vf.data(), s.B, s.Tn,
                           s.nh, s.nkv, s.hd);
  attention_backward<float>(dqf.data(), dkf.data(), dvf.data(), rf.data(), qf.data(), kf.data(),
                            vf.data(), outf.data(), lsef.data(), s.B, s.Tn, s.nh, s.nkv, s.hd);
  QT_EXPECT_CLOSE(outf, out, kTolF32);
  QT_EXPECT_CLOSE(lsef, lse, kTolF32);
  QT_EXPECT_CLOSE(dqf, dq, kTolF32);
  QT_EXPECT_CLOSE(dkf, dk, kTolF32);
  QT_EXPECT_CLOSE(dvf, dv, kTolF32);
}

// ---------------------------------------------------------------------------------------------
// swiglu

TEST(ops_swiglu, ForwardAgainstNaive) {
  auto rng = test_rng();
  const int N = 4, I = 9;
  Vec gate = random_f32_exact(N * I, rng, 3.0);
  gate[0] = 200.0;   // exp(-g) underflows
  gate[1] = -200.0;  // exp(-g) overflows: silu must still be finite
  const Vec up = random_f32_exact(N * I, rng);
  Vec want(N * I);
  for (int i = 0; i < N * I; ++i) want[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
  Guarded<double> h(N * I);
  swiglu_forward<double>(h.data(), gate.data(), up.data(), N, I);
  QT_EXPECT_CLOSE(h.values(), want, kTolF64);
  EXPECT_TRUE(h.guards_intact());
  Guarded<float> hf(N * I);
  swiglu_forward<float>(hf.data(), cast<float>(gate).data(), cast<float>(up).data(), N, I);
  QT_EXPECT_CLOSE(hf.values(), want, kTolF32);
}

TEST(ops_swiglu, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  const int N = 3, I = 7;
  Vec gate = random_f32_exact(N * I, rng, 3.0), up = random_f32_exact(N * I, rng);
  const Vec r = random_f32_exact(N * I, rng);
  auto loss = [&] {
    Vec h(N * I);
    swiglu_forward<double>(h.data(), gate.data(), up.data(), N, I);
    return dot(r, h);
  };
  Guarded<double> dgate(N * I), dup(N * I);
  swiglu_backward<double>(dgate.data(), dup.data(), r.data(), gate.data(), up.data(), N, I);
  QT_EXPECT_CLOSE(dgate.values(), fd_grad(gate, loss), kTolFd);
  QT_EXPECT_CLOSE(dup.values(), fd_grad(up, loss), kTolFd);
  EXPECT_TRUE(dgate.guards_intact() && dup.guards_intact());

  gate[0] = 200.0;
  gate[1] = -200.0;  // saturated gates: gradients finite (checked by rel_err)
  swiglu_backward<double>(dgate.data(), dup.data(), r.data(), gate.data(), up.data(), N, I);
  Guarded<float> dgatef(N * I), dupf(N * I);
  swiglu_backward<float>(dgatef.data(), dupf.data(), cast<float>(r).data(),
                         cast<float>(gate).data(), cast<float>(up).data(), N, I);
  QT_EXPECT_CLOSE(dgatef.values(), dgate.values(), kTolF32);
  QT_EXPECT_CLOSE(dupf.values(), dup.values(), kTolF32);
}

// ---------------------------------------------------------------------------------------------
// embedding

TEST(ops_embedding, ForwardCopiesRows) {
  auto rng = test_rng();
  const int V = 10, C = 6, N = 8;
  const Vec wte = random_f32_exact(V * C, rng);
  const I32 ids = {3, 0, 9, 3, 3, 7, 0, 1};
  Guarded<double> x(N * C);
  embedding_forward<double>(x.data(), ids.data(), wte.data(), N, C);
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) ASSERT_EQ(x[n * C + c], wte[ids[n] * C + c]);
  EXPECT_TRUE(x.guards_intact());
  Guarded<float> xf(N * C);
  embedding_forward<float>(xf.data(), ids.data(), cast<float>(wte).data(), N, C);
  EXPECT_EQ(cast<double>(xf.values()), x.values());  // inputs are float-exact: bit equal
}

TEST(ops_embedding, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  const int V = 6, C = 4, N = 7;
  Vec wte = random_f32_exact(V * C, rng);
  const I32 ids = {2, 5, 2, 0, 2, 5, 1};  // repeated ids; row 3 and 4 unused
  const Vec r = random_f32_exact(N * C, rng), d0 = random_f32_exact(V * C, rng);
  auto loss = [&] {
    Vec x(N * C);
    embedding_forward<double>(x.data(), ids.data(), wte.data(), N, C);
    return dot(r, x);
  };
  Guarded<double> dwte(d0);
  embedding_backward<double>(dwte.data(), r.data(), ids.data(), N, C);
  Vec g = dwte.values();
  for (std::size_t i = 0; i < g.size(); ++i) g[i] -= d0[i];  // += contract
  QT_EXPECT_CLOSE(g, fd_grad(wte, loss), kTolFd);
  EXPECT_TRUE(dwte.guards_intact());

  // float: bit equal to adding the rows in token order.
  const auto rf = cast<float>(r);
  std::vector<float> want = cast<float>(d0), got = want;
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) want[ids[n] * C + c] += rf[n * C + c];
  embedding_backward<float>(got.data(), rf.data(), ids.data(), N, C);
  EXPECT_EQ(got, want);
}

// ---------------------------------------------------------------------------------------------
// cross-entropy

// Losses, lse and the summed loss by a direct formula in double.
double ce_naive(Vec& losses, Vec& lse, const Vec& logits, const I32& targets, int N, int V) {
  double total = 0.0;
  losses.assign(N, 0.0);
  lse.assign(N, 0.0);
  for (int n = 0; n < N; ++n) {
    const double m = *std::max_element(logits.begin() + n * V, logits.begin() + (n + 1) * V);
    double z = 0.0;
    for (int v = 0; v < V; ++v) z += std::exp(logits[n * V + v] - m);
    lse[n] = m + std::log(z);
    if (targets[n] == kIgnoreIndex) continue;
    losses[n] = lse[n] - logits[n * V + targets[n]];
    total += losses[n];
  }
  return total;
}

struct CeCase {
  int N = 6, V = 11;
  Vec logits;
  I32 targets = {3, kIgnoreIndex, 0, 10, kIgnoreIndex, 7};
  CeCase(std::mt19937_64& rng, double scale) : logits(random_f32_exact(N * V, rng, scale)) {}
};

TEST(ops_cross_entropy, ForwardAgainstNaive) {
  auto rng = test_rng();
  for (double shift : {0.0, 1000.0, -1000.0}) {  // large logits: needs the max subtraction
    SCOPED_TRACE(::testing::Message() << "shift=" << shift);
    CeCase cc(rng, 2.0);
    for (auto& x : cc.logits) x += shift;
    cc.logits[5 * cc.V + 2] = shift + 1000.0;  // one dominating logit: loss about 1000
    Vec want, want_lse;
    const double want_total = ce_naive(want, want_lse, cc.logits, cc.targets, cc.N, cc.V);
    Guarded<double> losses(cc.N), lse(cc.N);
    const double total = cross_entropy_forward<double>(losses.data(), lse.data(), cc.logits.data(),
                                                       cc.targets.data(), cc.N, cc.V);
    QT_EXPECT_CLOSE(losses.values(), want, kTolF64);
    QT_EXPECT_CLOSE(lse.values(), want_lse, kTolF64);
    EXPECT_NEAR(total, want_total, kTolF64 * std::abs(want_total));
    EXPECT_EQ(losses[1], 0.0);
    EXPECT_EQ(losses[4], 0.0);
    EXPECT_TRUE(losses.guards_intact() && lse.guards_intact());

    Guarded<float> lossesf(cc.N), lsef(cc.N);
    const double totalf = cross_entropy_forward<float>(
        lossesf.data(), lsef.data(), cast<float>(cc.logits).data(), cc.targets.data(), cc.N, cc.V);
    QT_EXPECT_CLOSE(lossesf.values(), want, kTolF32);
    QT_EXPECT_CLOSE(lsef.values(), want_lse, kTolF32);
    EXPECT_NEAR(totalf, want_total, kTolF32 * std::abs(want_total));
  }
}

TEST(ops_cross_entropy, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  CeCase cc(rng, 2.0);
  const double scale = 0.37;
  const int N = cc.N, V = cc.V;
  auto loss = [&] {
    Vec losses(N), lse(N);
    return scale * cross_entropy_forward<double>(losses.data(), lse.data(), cc.logits.data(),
                                                 cc.targets.data(), N, V);
  };
  Vec losses(N), lse(N);
  cross_entropy_forward<double>(losses.data(), lse.data(), cc.logits.data(), cc.targets.data(), N,
                                V);
  Guarded<double> dlogits(N * V);
  cross_entropy_backward<double>(dlogits.data(), cc.logits.data(), lse.data(), cc.targets.data(),
                                 scale, N, V);
  EXPECT_TRUE(dlogits.guards_intact());
  for (int v = 0; v < V; ++v) {  // ignored rows: exactly zero
    ASSERT_EQ(dlogits[1 * V + v], 0.0);
    ASSERT_EQ(dlogits[4 * V + v], 0.0);
  }
  const Vec logits0 = cc.logits;
  QT_EXPECT_CLOSE(dlogits.values(), fd_grad(cc.logits, loss), kTolFd);

  // dlogits may alias logits.
  Vec inplace = logits0;
  cross_entropy_backward<double>(inplace.data(), inplace.data(), lse.data(), cc.targets.data(),
                                 scale, N, V);
  QT_EXPECT_CLOSE(inplace, dlogits.values(), kTolF64);

  // float against double, also with logits of 1000.
  for (double shift : {0.0, 1000.0}) {
    Vec shifted = logits0;
    for (auto& x : shifted) x += shift;
    Vec l64(N), lse64(N), d64(N * V);
    cross_entropy_forward<double>(l64.data(), lse64.data(), shifted.data(), cc.targets.data(), N,
                                  V);
    cross_entropy_backward<double>(d64.data(), shifted.data(), lse64.data(), cc.targets.data(),
                                   scale, N, V);
    QT_EXPECT_CLOSE(d64, dlogits.values(), 1e-9);  // softmax is shift invariant
    const auto lf = cast<float>(shifted);
    std::vector<float> l32(N), lse32(N), d32(N * V);
    cross_entropy_forward<float>(l32.data(), lse32.data(), lf.data(), cc.targets.data(), N, V);
    cross_entropy_backward<float>(d32.data(), lf.data(), lse32.data(), cc.targets.data(),
                                  float(scale), N, V);
    QT_EXPECT_CLOSE(d32, d64, shift == 0.0 ? kTolF32 : 1e-3);
  }
}

}  // namespace
}  // namespace qt::cpu
