// The routed experts of a Qwen3-MoE block (ops/moe_experts.h) against a naive per-token double
// reference and finite differences.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "check.h"
#include "ops/moe_block.h"
#include "ops/moe_experts.h"
#include "moe_block_fd.h"

namespace qt {
namespace {

using namespace qt::cpu;
using namespace qt::test;

struct Case {
  int N = 6, H = 5, Im = 3, E = 5, k = 2;
  std::vector<int> idx;  // [N, k] distinct experts a token, never the last (an idle expert)
  Vec x, w, gate_up, down;
  explicit Case(std::mt19937_64& rng) {
    std::vector<int> experts(E - 1);
    for (int t = 0; t < N; ++t) {
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), rng);
      idx.insert(idx.end(), experts.begin(), experts.begin() + k);
    }
    x = random_f32_exact(N * H, rng);
    w = random_f32_exact(N * k, rng);
    gate_up = random_f32_exact(E * 2 * Im * H, rng);
    down = random_f32_exact(E * H * Im, rng);
  }
  Vec forward() const {
    Vec y(N * H);
    moe_experts_forward<double>(y.data(), x.data(), idx.data(), w.data(), gate_up.data(),
                                down.data(), N, H, Im, E, k);
    return y;
  }
};

TEST(ops_moe_experts, ForwardAgainstNaive) {
  auto rng = test_rng();
  const Case c(rng);
  const int H = c.H, Im = c.Im, k = c.k;
  Vec want(c.N * H, 0.0);
  for (int t = 0; t < c.N; ++t)
    for (int j = 0; j < k; ++j) {
      const int e = c.idx[t * k + j];
      std::vector<double> h(Im);
      for (int i = 0; i < Im; ++i) {
        double g = 0, u = 0;
        for (int a = 0; a < H; ++a) {
          g += c.gate_up[(e * 2 * Im + i) * H + a] * c.x[t * H + a];
          u += c.gate_up[(e * 2 * Im + Im + i) * H + a] * c.x[t * H + a];
        }
        h[i] = g / (1 + std::exp(-g)) * u;
      }
      for (int a = 0; a < H; ++a) {
        double o = 0;
        for (int i = 0; i < Im; ++i) o += c.down[(e * H + a) * Im + i] * h[i];
        want[t * H + a] += c.w[t * k + j] * o;
      }
    }
  QT_EXPECT_CLOSE(c.forward(), want, kTolF64);
  std::vector<float> yf(c.N * H);
  moe_experts_forward<float>(yf.data(), cast<float>(c.x).data(), c.idx.data(),
                             cast<float>(c.w).data(), cast<float>(c.gate_up).data(),
                             cast<float>(c.down).data(), c.N, H, Im, c.E, k);
  QT_EXPECT_CLOSE(yf, want, kTolF32);
}

TEST(ops_moe_experts, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  Case c(rng);
  const Vec r = random_f32_exact(c.N * c.H, rng);
  auto loss = [&] { return dot(r, c.forward()); };
  Guarded<double> dx(c.N * c.H), dw(c.N * c.k);
  // The weight gradients add to what is there.
  Vec dgate_up(c.gate_up.size(), 0.5), ddown(c.down.size(), -0.25);
  moe_experts_backward<double>(dx.data(), dw.data(), dgate_up.data(), ddown.data(), r.data(),
                               c.x.data(), c.idx.data(), c.w.data(), c.gate_up.data(),
                               c.down.data(), c.N, c.H, c.Im, c.E, c.k);
  for (double& v : dgate_up) v -= 0.5;
  for (double& v : ddown) v += 0.25;
  QT_EXPECT_CLOSE(dx.values(), fd_grad(c.x, loss), kTolFd);
  QT_EXPECT_CLOSE(dw.values(), fd_grad(c.w, loss), kTolFd);
  QT_EXPECT_CLOSE(dgate_up, fd_grad(c.gate_up, loss), kTolFd);
  QT_EXPECT_CLOSE(ddown, fd_grad(c.down, loss), kTolFd);
  EXPECT_TRUE(dx.guards_intact() && dw.guards_intact());
  // The idle expert's weights get no gradient.
  const std::size_t last_gu = std::size_t(c.E - 1) * 2 * c.Im * c.H;
  EXPECT_TRUE(std::all_of(dgate_up.begin() + last_gu, dgate_up.end(),
                          [](double v) { return v == 0.0; }));
  std::vector<float> dxf(c.N * c.H), dwf(c.N * c.k), dguf(c.gate_up.size(), 0.f),
      ddf(c.down.size(), 0.f);
  moe_experts_backward<float>(dxf.data(), dwf.data(), dguf.data(), ddf.data(),
                              cast<float>(r).data(), cast<float>(c.x).data(), c.idx.data(),
                              cast<float>(c.w).data(), cast<float>(c.gate_up).data(),
                              cast<float>(c.down).data(), c.N, c.H, c.Im, c.E, c.k);
  QT_EXPECT_CLOSE(dxf, dx.values(), kTolF32);
  QT_EXPECT_CLOSE(dguf, dgate_up, kTolF32);
}


// The whole sparse block (ops/moe_block.h) against finite differences (moe_block_fd.h).
TEST(ops_moe_block, BackwardAgainstFiniteDifferences) {
  auto rng = test_rng();
  MoeBlockFd b(MoeShape{6, 5, 3, 5, 2, true}, rng);
  const MoeShape& s = b.s;
  b.expect_matches_finite_differences();
  // Without the aux term the router's gradient differs: the term is not a no-op.
  Vec dgate_plain(b.gate.size(), 0.0), scratch_gu(b.gate_up.size(), 0.0), scratch_d(b.down.size(), 0.0);
  Vec dx_plain(s.N * s.H);
  b.backward(dx_plain.data(), dgate_plain.data(), scratch_gu.data(), scratch_d.data(), s, 0);
  EXPECT_GT(rel_err(dgate_plain, b.dgate), 1e-4);
  // The frozen block (LoRA on MoE: no weight gradients) gives the trainable block's dx bit for
  // bit (the same math), hence the finite differences' too; the load-balancing loss still
  // reaches x through the frozen router's logits (dx differs from dx_plain's).
  Guarded<double> dx_frozen(s.N * s.H);
  b.backward(dx_frozen.data(), nullptr, nullptr, nullptr, s, b.coef);
  EXPECT_EQ(dx_frozen.values(), b.dx.values());
  QT_EXPECT_CLOSE(dx_frozen.values(), fd_grad(b.x, [&b] { return b.loss(); }), kTolFd);
  EXPECT_GT(rel_err(dx_plain, dx_frozen.values()), 1e-6);
  EXPECT_TRUE(dx_frozen.guards_intact());
}

}  // namespace
}  // namespace qt
