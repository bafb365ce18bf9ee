// The whole sparse block (ops/moe_block.h) against finite differences, shared by the dropless and
// the capacity tests: the loss is r . y plus coef x the load-balancing loss (from the routing
// before any drop), differentiated in x and every weight. The router's logits are kept apart
// (gate rows a_e u + noise with spaced a_e, tokens +-u + noise, alternating) so that no step
// changes a pick: the +u tokens all choose the k experts of largest a_e, the -u tokens the k of
// smallest.
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "check.h"
#include "ops/moe_block.h"
#include "ops/moe_router.h"

namespace qt::test {

struct MoeBlockFd {
  cpu::MoeShape s;
  double coef = 0.1;  // large, so that the aux term's gradient counts in the comparison
  Vec gate, x, gate_up, down, r;
  // The forward at these inputs: its routing (probs [N, E], idx and w [N, k]), the balance
  // statistics, the token-slots dropped; and the backward's gradients with the aux term.
  Vec probs, w;
  std::vector<int> idx;
  cpu::RouterBalance balance;
  long dropped = 0;
  Guarded<double> dx;
  Vec dgate, dgate_up, ddown;

  MoeBlockFd(const cpu::MoeShape& shape, std::mt19937_64& rng)
      : s(shape), balance(shape.E), dx(static_cast<std::size_t>(shape.N) * shape.H) {
    Vec u = random_f32_exact(s.H, rng);
    const double norm = std::sqrt(dot(u, u));
    for (double& v : u) v /= norm;
    std::vector<int> perm(s.E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::uniform_real_distribution<double> noise(-0.01, 0.01);
    gate.resize(s.E * s.H);
    x.resize(s.N * s.H);
    for (int e = 0; e < s.E; ++e)
      for (int a = 0; a < s.H; ++a)
        gate[e * s.H + a] = static_cast<float>(perm[e] * u[a] + noise(rng));
    for (int t = 0; t < s.N; ++t)
      for (int a = 0; a < s.H; ++a)
        x[t * s.H + a] = static_cast<float>((t % 2 ? -1.0 : 1.0) * u[a] + noise(rng));
    gate_up = random_f32_exact(s.E * 2 * s.Im * s.H, rng);
    down = random_f32_exact(s.E * s.H * s.Im, rng);
    r = random_f32_exact(s.N * s.H, rng);
    probs.resize(s.N * s.E);
    w.resize(s.N * s.k);
    idx.resize(s.N * s.k);
    Vec y(s.N * s.H);
    dropped = cpu::moe_block_forward<double>(y.data(), probs.data(), idx.data(), w.data(), x.data(),
                                             gate.data(), gate_up.data(), down.data(), s);
    cpu::router_balance_add<double>(balance, probs.data(), idx.data(), s.N, s.k);
    dgate.assign(gate.size(), 0.0);
    dgate_up.assign(gate_up.size(), 0.0);
    ddown.assign(down.size(), 0.0);
    backward(dx.data(), dgate.data(), dgate_up.data(), ddown.data(), s, coef);
  }

  // The block's backward at the forward's routing with another shape (e.g. without the drops)
  // or coefficient (0: no aux term); null weight gradients: the frozen block.
  void backward(double* dx_out, double* dgate_out, double* dgate_up_out, double* ddown_out,
                const cpu::MoeShape& shape, double aux_coef) const {
    cpu::moe_block_backward<double>(dx_out, dgate_out, dgate_up_out, ddown_out, r.data(), x.data(),
                                    probs.data(), idx.data(), w.data(), gate.data(), gate_up.data(),
                                    down.data(), shape, aux_coef > 0 ? &balance : nullptr,
                                    aux_coef);
  }

  // The loss at the current inputs; checks that the routing is the first forward's.
  double loss() {
    Vec y(s.N * s.H), p(s.N * s.E), wt(s.N * s.k);
    std::vector<int> picks(s.N * s.k);
    cpu::moe_block_forward<double>(y.data(), p.data(), picks.data(), wt.data(), x.data(),
                                   gate.data(), gate_up.data(), down.data(), s);
    EXPECT_EQ(picks, idx);  // the step changed no pick
    cpu::RouterBalance b(s.E);
    cpu::router_balance_add<double>(b, p.data(), picks.data(), s.N, s.k);
    return dot(r, y) + coef * cpu::router_aux_loss(b);
  }

  // The backward's gradients against finite differences of loss() in x and every weight.
  void expect_matches_finite_differences() {
    auto f = [this] { return loss(); };
    QT_EXPECT_CLOSE(dx.values(), fd_grad(x, f), kTolFd);
    QT_EXPECT_CLOSE(dgate, fd_grad(gate, f), kTolFd);
    QT_EXPECT_CLOSE(dgate_up, fd_grad(gate_up, f), kTolFd);
    QT_EXPECT_CLOSE(ddown, fd_grad(down, f), kTolFd);
    EXPECT_TRUE(dx.guards_intact());
  }
};

}  // namespace qt::test
