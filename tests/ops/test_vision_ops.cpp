// The vision tower's reference ops (Qwen3-VL, docs/vision.md): Linear with bias, LayerNorm with
// bias, the two GELUs and non-causal attention within segments. As test_ops.cpp: forward against
// a naive double reference, backward against central finite differences of L = sum(r * y) in
// double, float against double, outputs NaN-filled (=) or prefilled (+=), guards intact.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "check.h"
#include "ops/bidirectional_attention.h"
#include "ops/gelu.h"
#include "ops/layernorm.h"
#include "ops/linear_bias.h"

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

constexpr double kEps = 1e-6;

TEST(ops_linear_bias, ForwardAndBackward) {
  auto rng = test_rng();
  const int N = 5, in = 7, out = 4;
  Vec x = random_f32_exact(N * in, rng), w = random_f32_exact(out * in, rng);
  Vec b = random_f32_exact(out, rng);
  const Vec r = random_f32_exact(N * out, rng), dw0 = random_f32_exact(out * in, rng);
  const Vec db0 = random_f32_exact(out, rng);
  Vec want(N * out);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < out; ++o) {
      double s = b[o];
      for (int k = 0; k < in; ++k) s += x[n * in + k] * w[o * in + k];
      want[n * out + o] = s;
    }
  Guarded<double> y(N * out);
  linear_bias_forward<double>(y.data(), x.data(), w.data(), b.data(), N, in, out);
  QT_EXPECT_CLOSE(y.values(), want, kTolF64);
  EXPECT_TRUE(y.guards_intact());

  auto loss = [&] {
    Vec yy(N * out);
    linear_bias_forward<double>(yy.data(), x.data(), w.data(), b.data(), N, in, out);
    return dot(r, yy);
  };
  Guarded<double> dx(N * in), dw(dw0), db(db0);
  linear_bias_backward<double>(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), N,
                               in, out);
  Vec dw_new = dw.values(), db_new = db.values();
  for (int i = 0; i < out * in; ++i) dw_new[i] -= dw0[i];  // += contract
  for (int o = 0; o < out; ++o) db_new[o] -= db0[o];
  QT_EXPECT_CLOSE(dx.values(), fd_grad(x, loss), kTolFd);
  QT_EXPECT_CLOSE(dw_new, fd_grad(w, loss), kTolFd);
  QT_EXPECT_CLOSE(db_new, fd_grad(b, loss), kTolFd);
  EXPECT_TRUE(dx.guards_intact() && dw.guards_intact() && db.guards_intact());

  // dx null: only the weight gradients; float against double
  Guarded<float> dwf(cast<float>(dw0)), dbf(cast<float>(db0));
  linear_bias_backward<float>(nullptr, dwf.data(), dbf.data(), cast<float>(r).data(),
                              cast<float>(x).data(), cast<float>(w).data(), N, in, out);
  QT_EXPECT_CLOSE(dwf.values(), dw.values(), kTolF32);
  QT_EXPECT_CLOSE(dbf.values(), db.values(), kTolF32);
}

TEST(ops_layernorm, ForwardAgainstNaive) {
  auto rng = test_rng();
  const int N = 5, C = 16;
  Vec x = random_f32_exact(N * C, rng, 3.0);
  for (int c = 0; c < C; ++c) x[c] = 2.5;  // a constant row: variance 0, eps dominates
  const Vec w = random_f32_exact(C, rng), b = random_f32_exact(C, rng);
  Vec want(N * C), want_mean(N), want_rstd(N);
  for (int n = 0; n < N; ++n) {
    double mu = 0, var = 0;
    for (int c = 0; c < C; ++c) mu += x[n * C + c] / C;
    for (int c = 0; c < C; ++c) var += (x[n * C + c] - mu) * (x[n * C + c] - mu) / C;
    want_mean[n] = mu;
    want_rstd[n] = 1.0 / std::sqrt(var + kEps);
    for (int c = 0; c < C; ++c) want[n * C + c] = (x[n * C + c] - mu) * want_rstd[n] * w[c] + b[c];
  }
  Guarded<double> y(N * C), mean(N), rstd(N);
  layernorm_forward<double>(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C,
                            kEps);
  QT_EXPECT_CLOSE(y.values(), want, kTolF64);
  QT_EXPECT_CLOSE(mean.values(), want_mean, kTolF64);
  QT_EXPECT_CLOSE(rstd.values(), want_rstd, kTolF64);
  EXPECT_TRUE(y.guards_intact() && mean.guards_intact() && rstd.guards_intact());
  Guarded<float> yf(N * C), meanf(N), rstdf(N);
  layernorm_forward<float>(yf.data(), meanf.data(), rstdf.data(), cast<float>(x).data(),
                           cast<float>(w).data(), cast<float>(b).data(), N, C, kEps);
  QT_EXPECT_CLOSE(yf.values(), want, kTolF32);
}

TEST(ops_layernorm, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  const int N = 4, C = 8;
  Vec x = random_f32_exact(N * C, rng, 2.0), w = random_f32_exact(C, rng);
  Vec b = random_f32_exact(C, rng);
  const Vec r = random_f32_exact(N * C, rng), dw0 = random_f32_exact(C, rng);
  const Vec db0 = random_f32_exact(C, rng);
  auto loss = [&] {
    Vec y(N * C), m(N), s(N);
    layernorm_forward<double>(y.data(), m.data(), s.data(), x.data(), w.data(), b.data(), N, C,
                              kEps);
    return dot(r, y);
  };
  Vec y(N * C), mean(N), rstd(N);
  layernorm_forward<double>(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C,
                            kEps);
  Guarded<double> dx(N * C), dw(dw0), db(db0);
  layernorm_backward<double>(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(),
                             mean.data(), rstd.data(), N, C);
  Vec dw_new = dw.values(), db_new = db.values();
  for (int c = 0; c < C; ++c) dw_new[c] -= dw0[c], db_new[c] -= db0[c];  // += contract
  QT_EXPECT_CLOSE(dx.values(), fd_grad(x, loss), kTolFd);
  QT_EXPECT_CLOSE(dw_new, fd_grad(w, loss), kTolFd);
  QT_EXPECT_CLOSE(db_new, fd_grad(b, loss), kTolFd);
  EXPECT_TRUE(dx.guards_intact() && dw.guards_intact() && db.guards_intact());

  // dx may alias dy
  Vec inplace = r, dw2 = dw0, db2 = db0;
  layernorm_backward<double>(inplace.data(), dw2.data(), db2.data(), inplace.data(), x.data(),
                             w.data(), mean.data(), rstd.data(), N, C);
  QT_EXPECT_CLOSE(inplace, dx.values(), kTolF64);

  // float against double
  const auto xf = cast<float>(x), wf = cast<float>(w), bf = cast<float>(b);
  std::vector<float> yf(N * C), mf(N), sf(N);
  layernorm_forward<float>(yf.data(), mf.data(), sf.data(), xf.data(), wf.data(), bf.data(), N, C,
                           kEps);
  Guarded<float> dxf(N * C), dwf(cast<float>(dw0)), dbf(cast<float>(db0));
  layernorm_backward<float>(dxf.data(), dwf.data(), dbf.data(), cast<float>(r).data(), xf.data(),
                            wf.data(), mf.data(), sf.data(), N, C);
  QT_EXPECT_CLOSE(dxf.values(), dx.values(), kTolF32);
  QT_EXPECT_CLOSE(dwf.values(), dw.values(), kTolF32);
  QT_EXPECT_CLOSE(dbf.values(), db.values(), kTolF32);
}

// Known values: gelu_erf(1) = Phi(1) = 0.8413447460685429; gelu_tanh(1) =
// 0.5 (1 + tanh(sqrt(2/pi) 1.044715)) = 0.8411919906082768; both ~ x for large x, ~ 0 for
// large -x.
TEST(ops_gelu, KnownValuesAndBackward) {
  const Vec pts = {1.0, 0.0, 30.0, -30.0};
  Vec ye(4), yt(4);
  gelu_erf_forward<double>(ye.data(), pts.data(), 4);
  gelu_tanh_forward<double>(yt.data(), pts.data(), 4);
  EXPECT_NEAR(ye[0], 0.8413447460685429, 1e-15);
  EXPECT_NEAR(yt[0], 0.8411919906082768, 1e-15);
  EXPECT_EQ(ye[1], 0.0);
  EXPECT_NEAR(ye[2], 30.0, 1e-12);
  EXPECT_NEAR(yt[3], 0.0, 1e-12);

  auto rng = test_rng();
  const int n = 40;
  Vec x = random_f32_exact(n, rng, 2.0);
  const Vec r = random_f32_exact(n, rng);
  for (int form = 0; form < 2; ++form) {
    auto fwd = [&](double* y, const double* in) {
      form ? gelu_erf_forward<double>(y, in, n) : gelu_tanh_forward<double>(y, in, n);
    };
    auto loss = [&] {
      Vec y(n);
      fwd(y.data(), x.data());
      return dot(r, y);
    };
    Guarded<double> dx(n);
    form ? gelu_erf_backward<double>(dx.data(), r.data(), x.data(), n)
         : gelu_tanh_backward<double>(dx.data(), r.data(), x.data(), n);
    QT_EXPECT_CLOSE(dx.values(), fd_grad(x, loss), kTolFd) << "form " << form;
    EXPECT_TRUE(dx.guards_intact());
    Vec inplace = r;  // dx may alias dy
    form ? gelu_erf_backward<double>(inplace.data(), inplace.data(), x.data(), n)
         : gelu_tanh_backward<double>(inplace.data(), inplace.data(), x.data(), n);
    QT_EXPECT_CLOSE(inplace, dx.values(), kTolF64);
  }
}

// Explicit softmax over each row's own segment.
Vec naive_segment_attention(const Vec& q, const Vec& k, const Vec& v, const std::vector<int>& seg,
                            int heads, int hd) {
  const int N = seg.back();
  Vec out(static_cast<std::size_t>(N) * heads * hd, 0.0);
  for (std::size_t s = 0; s + 1 < seg.size(); ++s)
    for (int h = 0; h < heads; ++h)
      for (int i = seg[s]; i < seg[s + 1]; ++i) {
        Vec p;
        double z = 0;
        for (int j = seg[s]; j < seg[s + 1]; ++j) {
          double d = 0;
          for (int e = 0; e < hd; ++e) d += q[(i * heads + h) * hd + e] * k[(j * heads + h) * hd + e];
          p.push_back(std::exp(d / std::sqrt(double(hd))));
          z += p.back();
        }
        for (int j = seg[s]; j < seg[s + 1]; ++j)
          for (int e = 0; e < hd; ++e)
            out[(i * heads + h) * hd + e] += p[j - seg[s]] / z * v[(j * heads + h) * hd + e];
      }
  return out;
}

TEST(ops_bidirectional_attention, ForwardAndBackward) {
  auto rng = test_rng();
  const std::vector<int> seg = {0, 3, 8, 9};  // segments of 3, 5 and 1 rows
  const int N = 9, heads = 2, hd = 4, S = 3;
  const std::size_t n = static_cast<std::size_t>(N) * heads * hd;
  Vec q = random_f32_exact(n, rng), k = random_f32_exact(n, rng), v = random_f32_exact(n, rng);
  const Vec r = random_f32_exact(n, rng);
  Guarded<double> out(n), lse(heads * N);
  bidirectional_attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(),
                                          seg.data(), S, heads, hd);
  QT_EXPECT_CLOSE(out.values(), naive_segment_attention(q, k, v, seg, heads, hd), kTolF64);
  EXPECT_TRUE(out.guards_intact() && lse.guards_intact());
  // a one-row segment returns its own v
  for (int h = 0; h < heads; ++h)
    for (int e = 0; e < hd; ++e)
      EXPECT_NEAR(out[(8 * heads + h) * hd + e], v[(8 * heads + h) * hd + e], 1e-15);

  auto loss = [&] {
    Vec o(n), l(heads * N);
    bidirectional_attention_forward<double>(o.data(), l.data(), q.data(), k.data(), v.data(),
                                            seg.data(), S, heads, hd);
    return dot(r, o);
  };
  Guarded<double> dq(n), dk(n), dv(n);
  bidirectional_attention_backward<double>(dq.data(), dk.data(), dv.data(), r.data(), q.data(),
                                           k.data(), v.data(), out.values().data(),
                                           lse.values().data(), seg.data(), S, heads, hd);
  QT_EXPECT_CLOSE(dq.values(), fd_grad(q, loss), kTolFd);
  QT_EXPECT_CLOSE(dk.values(), fd_grad(k, loss), kTolFd);
  QT_EXPECT_CLOSE(dv.values(), fd_grad(v, loss), kTolFd);
  EXPECT_TRUE(dq.guards_intact() && dk.guards_intact() && dv.guards_intact());

  // float against double
  const auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), rf = cast<float>(r);
  std::vector<float> of(n), lf(heads * N), dqf(n), dkf(n), dvf(n);
  bidirectional_attention_forward<float>(of.data(), lf.data(), qf.data(), kf.data(), vf.data(),
                                         seg.data(), S, heads, hd);
  bidirectional_attention_backward<float>(dqf.data(), dkf.data(), dvf.data(), rf.data(), qf.data(),
                                          kf.data(), vf.data(), of.data(), lf.data(), seg.data(), S,
                                          heads, hd);
  QT_EXPECT_CLOSE(of, out.values(), kTolF32);
  QT_EXPECT_CLOSE(dqf, dq.values(), kTolF32);
  QT_EXPECT_CLOSE(dkf, dk.values(), kTolF32);
  QT_EXPECT_CLOSE(dvf, dv.values(), kTolF32);
}

}  // namespace
}  // namespace qt::cpu
