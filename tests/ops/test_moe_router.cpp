// The Qwen3-MoE router and its load-balancing loss (ops/moe_router.h) against naive double
// references and finite differences. Logits are spaced (distinct values 0.25 apart plus noise
// below 0.05) so that no finite-difference step changes which experts are picked.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "check.h"
#include "ops/moe_router.h"

namespace qt {
namespace {

using namespace qt::cpu;
using namespace qt::test;

// [N, E] logits: each row a random permutation of 0.25 x (0 .. E-1) plus noise in [0, 0.05).
Vec spaced_logits(int N, int E, std::mt19937_64& rng) {
  Vec x(static_cast<std::size_t>(N) * E);
  std::vector<int> perm(E);
  std::uniform_real_distribution<double> noise(0.0, 0.05);
  for (int t = 0; t < N; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < E; ++e) x[t * E + e] = static_cast<float>(0.25 * perm[e] + noise(rng));
  }
  return x;
}

TEST(ops_moe_router, ForwardAgainstNaive) {
  auto rng = test_rng();
  const int N = 5, E = 8, k = 3;
  const Vec logits = spaced_logits(N, E, rng);
  for (const bool norm : {true, false}) {
    Vec probs(N * E), weight(N * k);
    std::vector<int> idx(N * k);
    router_forward<double>(probs.data(), idx.data(), weight.data(), logits.data(), N, E, k, norm);
    Vec want_p(N * E), want_w(N * k);
    for (int t = 0; t < N; ++t) {
      double z = 0;
      for (int e = 0; e < E; ++e) z += std::exp(logits[t * E + e]);
      for (int e = 0; e < E; ++e) want_p[t * E + e] = std::exp(logits[t * E + e]) / z;
      std::vector<int> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return logits[t * E + a] > logits[t * E + b]; });
      double s = 0;
      for (int j = 0; j < k; ++j) s += want_p[t * E + order[j]];
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(idx[t * k + j], order[j]) << "token " << t << " slot " << j;
        want_w[t * k + j] = want_p[t * E + order[j]] / (norm ? s : 1.0);
      }
    }
    QT_EXPECT_CLOSE(probs, want_p, kTolF64);
    QT_EXPECT_CLOSE(weight, want_w, kTolF64);
    Vec pf(N * E), wf(N * k);
    std::vector<float> probs_f(N * E), weight_f(N * k);
    std::vector<int> idx_f(N * k);
    router_forward<float>(probs_f.data(), idx_f.data(), weight_f.data(),
                          cast<float>(logits).data(), N, E, k, norm);
    QT_EXPECT_CLOSE(weight_f, want_w, kTolF32);
    EXPECT_EQ(idx_f, idx);
  }
}

// Ties go to the lower expert, as the naive order does; equal logits give equal weights.
TEST(ops_moe_router, TiesPickTheLowerExpert) {
  const int E = 4, k = 2;
  const Vec logits = {1.0, 2.0, 2.0, 0.5};
  Vec probs(E), weight(k);
  std::vector<int> idx(k);
  router_forward<double>(probs.data(), idx.data(), weight.data(), logits.data(), 1, E, k, true);
  EXPECT_EQ(idx, (std::vector<int>{1, 2}));
  EXPECT_DOUBLE_EQ(weight[0], 0.5);
  EXPECT_DOUBLE_EQ(weight[1], 0.5);
}

TEST(ops_moe_router, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  const int N = 4, E = 6, k = 2;
  Vec logits = spaced_logits(N, E, rng);
  const Vec r = random_f32_exact(N * k, rng);
  for (const bool norm : {true, false}) {
    Vec probs(N * E), weight(N * k);
    std::vector<int> idx(N * k);
    auto loss = [&] {
      Vec p(N * E), w(N * k);
      std::vector<int> ix(N * k);
      router_forward<double>(p.data(), ix.data(), w.data(), logits.data(), N, E, k, norm);
      EXPECT_EQ(ix, idx);  // the step changed no pick
      return dot(r, w);
    };
    router_forward<double>(probs.data(), idx.data(), weight.data(), logits.data(), N, E, k, norm);
    Guarded<double> dlogits(N * E);
    router_backward<double>(dlogits.data(), r.data(), probs.data(), idx.data(), N, E, k, norm);
    QT_EXPECT_CLOSE(dlogits.values(), fd_grad(logits, loss), kTolFd);
    EXPECT_TRUE(dlogits.guards_intact());
    std::vector<float> pf(N * E), wf(N * k), df(N * E);
    std::vector<int> ixf(N * k);
    router_forward<float>(pf.data(), ixf.data(), wf.data(), cast<float>(logits).data(), N, E, k,
                          norm);
    router_backward<float>(df.data(), cast<float>(r).data(), pf.data(), ixf.data(), N, E, k, norm);
    QT_EXPECT_CLOSE(df, dlogits.values(), kTolF32);
  }
}

// transformers' formula (qwen3-spec.md 3.3) over two layers, then its gradient with the counts
// held, as the training loss sees it.
TEST(ops_moe_router, AuxLossAgainstNaiveAndFiniteDifferences) {
  auto rng = test_rng();
  const int N = 5, E = 6, k = 2, layers = 2;
  std::vector<Vec> logits = {spaced_logits(N, E, rng), spaced_logits(N, E, rng)};
  std::vector<std::vector<int>> picks(layers);
  auto aux_of = [&](bool keep_picks) {
    RouterBalance b(E);
    for (int l = 0; l < layers; ++l) {
      Vec p(N * E), w(N * k);
      std::vector<int> ix(N * k);
      router_forward<double>(p.data(), ix.data(), w.data(), logits[l].data(), N, E, k, true);
      if (keep_picks) picks[l] = ix;
      EXPECT_EQ(ix, picks[l]);
      router_balance_add<double>(b, p.data(), ix.data(), N, k);
    }
    return b;
  };
  const RouterBalance b = aux_of(true);
  // Naive: f and P pooled over layers and tokens, then E sum f P.
  std::vector<double> f(E, 0), P(E, 0);
  for (int l = 0; l < layers; ++l)
    for (int t = 0; t < N; ++t) {
      double z = 0;
      for (int e = 0; e < E; ++e) z += std::exp(logits[l][t * E + e]);
      for (int e = 0; e < E; ++e) P[e] += std::exp(logits[l][t * E + e]) / z / (layers * N);
      for (int j = 0; j < k; ++j) f[picks[l][t * k + j]] += 1.0 / (layers * N);
    }
  double want = 0;
  for (int e = 0; e < E; ++e) want += E * f[e] * P[e];
  EXPECT_NEAR(router_aux_loss(b), want, 1e-12 * want);
  // A balanced router gives k: every expert picked and probable alike.
  RouterBalance even(E);
  even.count.assign(E, static_cast<double>(k));
  even.psum.assign(E, 1.0);
  even.tokens = E;
  EXPECT_NEAR(router_aux_loss(even), k, 1e-12);
  const double coef = 0.001;
  for (int l = 0; l < layers; ++l) {
    Vec probs(N * E), w(N * k);
    std::vector<int> ix(N * k);
    router_forward<double>(probs.data(), ix.data(), w.data(), logits[l].data(), N, E, k, true);
    Vec dlogits(N * E, 0.0);
    router_aux_backward<double>(dlogits.data(), b, probs.data(), N, coef);
    const Vec fd = fd_grad(logits[l], [&] { return coef * router_aux_loss(aux_of(false)); });
    QT_EXPECT_CLOSE(dlogits, fd, kTolFd);
  }
}

// Auxiliary-loss-free balancing: the bias moves the choice (top-k of probs + bias, against a
// naive sort), the weights stay the chosen experts' unbiased probabilities (renormalised with
// norm_topk), the probabilities never see it, and a zero bias is no bias, bit for bit.
TEST(ops_moe_router, BiasChoosesButDoesNotWeigh) {
  auto rng = test_rng();
  const int N = 6, E = 8, k = 2;
  const Vec logits = spaced_logits(N, E, rng);  // probabilities at least e^0.2 apart in ratio
  // A bias larger than any probability gap: expert 5 always chosen, 0 never.
  Vec bias(E, 0.0);
  bias[5] = 2.0;
  bias[0] = -2.0;
  for (const bool norm : {true, false}) {
    Vec p0(N * E), w0(N * k), p(N * E), w(N * k), pz(N * E), wz(N * k);
    std::vector<int> i0(N * k), ix(N * k), iz(N * k);
    router_forward<double>(p0.data(), i0.data(), w0.data(), logits.data(), N, E, k, norm);
    router_forward<double>(p.data(), ix.data(), w.data(), logits.data(), N, E, k, norm,
                           bias.data());
    const Vec zero(E, 0.0);
    router_forward<double>(pz.data(), iz.data(), wz.data(), logits.data(), N, E, k, norm,
                           zero.data());
    EXPECT_EQ(iz, i0);
    EXPECT_EQ(wz, w0);
    EXPECT_EQ(p, p0);
    int changed = 0;
    for (int t = 0; t < N; ++t) {
      std::vector<int> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return p[t * E + a] + bias[a] > p[t * E + b] + bias[b];
      });
      double picked = 0;
      for (int j = 0; j < k; ++j) picked += p[t * E + order[j]];
      EXPECT_EQ(ix[t * k], 5) << "token " << t;
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(ix[t * k + j], order[j]) << "token " << t << " slot " << j;
        EXPECT_NE(ix[t * k + j], 0) << "token " << t;
        const double want = p[t * E + order[j]] / (norm ? picked : 1.0);
        EXPECT_NEAR(w[t * k + j], want, 1e-15) << "token " << t << " slot " << j;
        changed += ix[t * k + j] != i0[t * k + j];
      }
    }
    EXPECT_GT(changed, 0);
  }
}

// The update rule on a hand-computed example: 2 layers of 4 experts, rate 0.5.
//   layer 0: loads 1, 3, 2, 2 (mean 2)  -> +0.5, -0.5, 0, 0
//   layer 1: loads 0, 0, 0, 8 (mean 2)  -> +0.5, +0.5, +0.5, -0.5
TEST(ops_moe_router, BiasUpdateByHand) {
  std::vector<float> bias = {0.0f, 1.0f, -1.0f, 0.25f, 0.0f, 0.0f, 0.0f, 0.0f};
  const std::vector<double> load = {1, 3, 2, 2, 0, 0, 0, 8};
  router_bias_update(bias.data(), load.data(), 2, 4, 0.5);
  EXPECT_EQ(bias, (std::vector<float>{0.5f, 0.5f, -1.0f, 0.25f, 0.5f, 0.5f, 0.5f, -0.5f}));
  // Loads at the mean: nothing moves; a mean that is not a whole number (7 / 3) still splits
  // the experts exactly (3 > 7/3 > 2).
  std::vector<float> b3 = {0.0f, 0.0f, 0.0f};
  const std::vector<double> l3 = {2, 2, 3};
  router_bias_update(b3.data(), l3.data(), 1, 3, 0.125);
  EXPECT_EQ(b3, (std::vector<float>{0.125f, 0.125f, -0.125f}));
  std::vector<float> even = {0.0f, 0.0f};
  const std::vector<double> le = {5, 5};
  router_bias_update(even.data(), le.data(), 1, 2, 1.0);
  EXPECT_EQ(even, (std::vector<float>{0.0f, 0.0f}));
}

}  // namespace
}  // namespace qt
