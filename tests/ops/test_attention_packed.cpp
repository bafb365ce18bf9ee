// CPU attention with pos (packed documents): query t attends key j iff t - pos[t] <= j <= t.
// Forward against a naive double softmax over an explicit [T, T] mask, backward against central
// differences, float against double, and pos == nullptr bitwise equal to pos[t] = t.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "check.h"
#include "ops/attention.h"

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

struct Shape {
  int B, Tn, nh, nkv, hd;
  std::size_t q_size() const { return std::size_t(B) * Tn * nh * hd; }
  std::size_t kv_size() const { return std::size_t(B) * Tn * nkv * hd; }
  std::size_t lse_size() const { return std::size_t(B) * nh * Tn; }
};

// pos [B, T] from the document lengths of each row (each row's lengths sum to T).
I32 pos_from_lengths(const std::vector<std::vector<int>>& rows, int Tn) {
  I32 pos;
  for (const auto& lens : rows) {
    int total = 0;
    for (int len : lens) {
      for (int p = 0; p < len; ++p) pos.push_back(p);
      total += len;
    }
    EXPECT_EQ(total, Tn);
  }
  return pos;
}

// Explicit mask [B][T][T]: true where query i may read key j (same document, j <= i). Built from
// document ids, independently of the op's t - pos[t] rule.
std::vector<std::vector<std::vector<bool>>> explicit_mask(const I32& pos, int B, int Tn) {
  std::vector<std::vector<std::vector<bool>>> mask(
      B, std::vector<std::vector<bool>>(Tn, std::vector<bool>(Tn, false)));
  for (int b = 0; b < B; ++b) {
    std::vector<int> doc(Tn);
    for (int t = 0; t < Tn; ++t)
      doc[t] = (t == 0 ? 0 : doc[t - 1] + (pos[std::size_t(b) * Tn + t] == 0 ? 1 : 0));
    for (int i = 0; i < Tn; ++i)
      for (int j = 0; j <= i; ++j) mask[b][i][j] = doc[i] == doc[j];
  }
  return mask;
}

// Softmax of the scaled scores over the unmasked keys, in double.
void attention_masked_naive(Vec& out, Vec& lse, const Vec& q, const Vec& k, const Vec& v,
                            const I32& pos, const Shape& s) {
  const auto mask = explicit_mask(pos, s.B, s.Tn);
  out.assign(s.q_size(), 0.0);
  lse.assign(s.lse_size(), 0.0);
  const double scale = 1.0 / std::sqrt(double(s.hd));
  auto qi = [&](int b, int t, int h) { return ((std::size_t(b) * s.Tn + t) * s.nh + h) * s.hd; };
  auto ki = [&](int b, int t, int g) { return ((std::size_t(b) * s.Tn + t) * s.nkv + g) * s.hd; };
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.nh; ++h) {
      const int g = h / (s.nh / s.nkv);
      for (int i = 0; i < s.Tn; ++i) {
        Vec sc(s.Tn, -INFINITY);
        for (int j = 0; j < s.Tn; ++j) {
          if (!mask[b][i][j]) continue;
          double d = 0.0;
          for (int c = 0; c < s.hd; ++c) d += q[qi(b, i, h) + c] * k[ki(b, j, g) + c];
          sc[j] = d * scale;
        }
        double m = -INFINITY;
        for (double x : sc) m = std::max(m, x);
        double z = 0.0;
        for (double x : sc) z += std::exp(x - m);
        lse[(std::size_t(b) * s.nh + h) * s.Tn + i] = m + std::log(z);
        for (int j = 0; j < s.Tn; ++j)
          for (int c = 0; c < s.hd; ++c)
            out[qi(b, i, h) + c] += std::exp(sc[j] - m) / z * v[ki(b, j, g) + c];
      }
    }
}

// Two rows with different layouts: several documents including length-1 ones at the start, in
// the middle and at the end; one document spanning the whole row.
const std::vector<std::vector<std::vector<int>>> kLayouts = {
    {{1, 4, 1, 3, 4}, {13}},
    {{13}, {5, 5, 1, 2}},
    {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {2, 11}},
};

TEST(ops_attention_packed, ForwardAgainstExplicitMask) {
  auto rng = test_rng();
  for (std::size_t layout = 0; layout < kLayouts.size(); ++layout)
    for (int ratio : {1, 2, 4}) {
      const Shape s{2, 13, 4, 4 / ratio, 8};
      SCOPED_TRACE(::testing::Message() << "layout " << layout << " nh/nkv=" << ratio);
      const I32 pos = pos_from_lengths(kLayouts[layout], s.Tn);
      const Vec q = random_f32_exact(s.q_size(), rng, 3.0), k = random_f32_exact(s.kv_size(), rng),
                v = random_f32_exact(s.kv_size(), rng);
      Vec want, want_lse;
      attention_masked_naive(want, want_lse, q, k, v, pos, s);
      Guarded<double> out(s.q_size()), lse(s.lse_size());
      attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn,
                                s.nh, s.nkv, s.hd, pos.data());
      QT_EXPECT_CLOSE(out.values(), want, kTolF64);
      QT_EXPECT_CLOSE(lse.values(), want_lse, kTolF64);
      EXPECT_TRUE(out.guards_intact() && lse.guards_intact());
      Guarded<float> outf(s.q_size()), lsef(s.lse_size());
      attention_forward<float>(outf.data(), lsef.data(), cast<float>(q).data(),
                               cast<float>(k).data(), cast<float>(v).data(), s.B, s.Tn, s.nh, s.nkv,
                               s.hd, pos.data());
      QT_EXPECT_CLOSE(outf.values(), want, kTolF32);
      QT_EXPECT_CLOSE(lsef.values(), want_lse, kTolF32);
      EXPECT_TRUE(outf.guards_intact() && lsef.guards_intact());
    }
}

// A length-1 document attends only itself: out = v of that token, lse = its own scaled score.
TEST(ops_attention_packed, LengthOneDocumentIsItsOwnValue) {
  auto rng = test_rng();
  const Shape s{1, 6, 2, 1, 4};
  const I32 pos = pos_from_lengths({{3, 1, 2}}, s.Tn);  // token 3 is a document of its own
  const Vec q = random_f32_exact(s.q_size(), rng), k = random_f32_exact(s.kv_size(), rng),
            v = random_f32_exact(s.kv_size(), rng);
  Vec out(s.q_size()), lse(s.lse_size());
  attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn, s.nh,
                            s.nkv, s.hd, pos.data());
  for (int h = 0; h < s.nh; ++h) {
    double sc = 0.0;
    for (int c = 0; c < s.hd; ++c) {
      EXPECT_EQ(out[(3 * s.nh + h) * s.hd + c], v[3 * s.hd + c]);
      sc += q[(3 * s.nh + h) * s.hd + c] * k[3 * s.hd + c];
    }
    EXPECT_NEAR(lse[h * s.Tn + 3], sc / std::sqrt(double(s.hd)), 1e-14);
  }
}

TEST(ops_attention_packed, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  const std::vector<std::vector<std::vector<int>>> layouts = {
      {{2, 1, 4}, {7}}, {{7}, {1, 3, 2, 1}}, {{1, 1, 5}, {3, 4}}};
  for (int ratio : {1, 2, 4}) {
    const Shape s{2, 7, 4, 4 / ratio, 6};
    SCOPED_TRACE(::testing::Message() << "nh/nkv=" << ratio);
    const I32 pos = pos_from_lengths(layouts[ratio == 1 ? 0 : ratio == 2 ? 1 : 2], s.Tn);
    Vec q = random_f32_exact(s.q_size(), rng), k = random_f32_exact(s.kv_size(), rng),
        v = random_f32_exact(s.kv_size(), rng);
    const Vec r = random_f32_exact(s.q_size(), rng);
    Vec out(s.q_size()), lse(s.lse_size());
    auto loss = [&] {
      attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn,
                                s.nh, s.nkv, s.hd, pos.data());
      return dot(r, out);
    };
    loss();
    Guarded<double> dq(s.q_size()), dk(s.kv_size()), dv(s.kv_size());  // NaN: must be written
    attention_backward<double>(dq.data(), dk.data(), dv.data(), r.data(), q.data(), k.data(),
                               v.data(), out.data(), lse.data(), s.B, s.Tn, s.nh, s.nkv, s.hd,
                               pos.data());
    EXPECT_TRUE(dq.guards_intact() && dk.guards_intact() && dv.guards_intact());
    QT_EXPECT_CLOSE(dq.values(), fd_grad(q, loss), kTolFd);
    QT_EXPECT_CLOSE(dk.values(), fd_grad(k, loss), kTolFd);
    QT_EXPECT_CLOSE(dv.values(), fd_grad(v, loss), kTolFd);

    // float against double, same pos
    const auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), rf = cast<float>(r);
    std::vector<float> outf(s.q_size()), lsef(s.lse_size());
    Guarded<float> dqf(s.q_size()), dkf(s.kv_size()), dvf(s.kv_size());
    attention_forward<float>(outf.data(), lsef.data(), qf.data(), kf.data(), vf.data(), s.B, s.Tn,
                             s.nh, s.nkv, s.hd, pos.data());
    attention_backward<float>(dqf.data(), dkf.data(), dvf.data(), rf.data(), qf.data(), kf.data(),
                              vf.data(), outf.data(), lsef.data(), s.B, s.Tn, s.nh, s.nkv, s.hd,
                              pos.data());
    QT_EXPECT_CLOSE(dqf.values(), dq.values(), kTolF32);
    QT_EXPECT_CLOSE(dkf.values(), dk.values(), kTolF32);
    QT_EXPECT_CLOSE(dvf.values(), dv.values(), kTolF32);
  }
}

// Keys of other documents get no gradient from this document's queries: with dout zero outside
// document d, dk and dv are zero outside d (and dq zero outside d).
TEST(ops_attention_packed, GradientsStayInsideTheDocument) {
  auto rng = test_rng();
  const Shape s{1, 10, 2, 1, 4};
  const I32 pos = pos_from_lengths({{3, 4, 3}}, s.Tn);  // documents [0,3) [3,7) [7,10)
  const Vec q = random_f32_exact(s.q_size(), rng), k = random_f32_exact(s.kv_size(), rng),
            v = random_f32_exact(s.kv_size(), rng);
  Vec r = random_f32_exact(s.q_size(), rng);
  for (int t = 0; t < s.Tn; ++t)
    if (t < 3 || t >= 7)
      for (int c = 0; c < s.nh * s.hd; ++c) r[t * s.nh * s.hd + c] = 0.0;
  Vec out(s.q_size()), lse(s.lse_size()), dq(s.q_size()), dk(s.kv_size()), dv(s.kv_size());
  attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.Tn, s.nh,
                            s.nkv, s.hd, pos.data());
  attention_backward<double>(dq.data(), dk.data(), dv.data(), r.data(), q.data(), k.data(),
                             v.data(), out.data(), lse.data(), s.B, s.Tn, s.nh, s.nkv, s.hd,
                             pos.data());
  for (int t = 0; t < s.Tn; ++t) {
    const bool inside = t >= 3 && t < 7;
    double nq = 0.0, nk = 0.0, nv = 0.0;
    for (int c = 0; c < s.nh * s.hd; ++c) nq += std::abs(dq[t * s.nh * s.hd + c]);
    for (int c = 0; c < s.nkv * s.hd; ++c) {
      nk += std::abs(dk[t * s.nkv * s.hd + c]);
      nv += std::abs(dv[t * s.nkv * s.hd + c]);
    }
    SCOPED_TRACE(::testing::Message() << "t=" << t);
    if (inside) {
      if (t > 3) EXPECT_GT(nq, 0.0);  // query 3 sees one key only: P = 1, dS = 0, dq = 0
      EXPECT_GT(nk, 0.0);
      EXPECT_GT(nv, 0.0);
    } else {
      EXPECT_EQ(nq, 0.0);
      EXPECT_EQ(nk, 0.0);
      EXPECT_EQ(nv, 0.0);
    }
  }
}

// pos == nullptr is plain causal: bitwise the same as pos[t] = t (one document per row).
TEST(ops_attention_packed, NullPosIsOneDocumentPerRow) {
  auto rng = test_rng();
  const Shape s{2, 33, 4, 2, 16};
  const I32 pos = pos_from_lengths({{33}, {33}}, s.Tn);
  const auto q = cast<float>(random_f32_exact(s.q_size(), rng)),
             k = cast<float>(random_f32_exact(s.kv_size(), rng)),
             v = cast<float>(random_f32_exact(s.kv_size(), rng)),
             r = cast<float>(random_f32_exact(s.q_size(), rng));
  std::vector<float> o0(s.q_size()), l0(s.lse_size()), o1(s.q_size()), l1(s.lse_size());
  attention_forward<float>(o0.data(), l0.data(), q.data(), k.data(), v.data(), s.B, s.Tn, s.nh,
                           s.nkv, s.hd);
  attention_forward<float>(o1.data(), l1.data(), q.data(), k.data(), v.data(), s.B, s.Tn, s.nh,
                           s.nkv, s.hd, pos.data());
  EXPECT_EQ(o0, o1);
  EXPECT_EQ(l0, l1);
  std::vector<float> dq0(s.q_size()), dk0(s.kv_size()), dv0(s.kv_size());
  std::vector<float> dq1(s.q_size()), dk1(s.kv_size()), dv1(s.kv_size());
  attention_backward<float>(dq0.data(), dk0.data(), dv0.data(), r.data(), q.data(), k.data(),
                            v.data(), o0.data(), l0.data(), s.B, s.Tn, s.nh, s.nkv, s.hd);
  attention_backward<float>(dq1.data(), dk1.data(), dv1.data(), r.data(), q.data(), k.data(),
                            v.data(), o0.data(), l0.data(), s.B, s.Tn, s.nh, s.nkv, s.hd,
                            pos.data());
  EXPECT_EQ(dq0, dq1);
  EXPECT_EQ(dk0, dk1);
  EXPECT_EQ(dv0, dv1);
}

}  // namespace
}  // namespace qt::cpu
