// LoRA adapters on every expert of the Qwen3-MoE block (ops/moe_experts.h ExpertLora, issue 18
// item 5): the adapted block equals the block with each expert's merged weights
// W_e + scale B_e A_e, its frozen backward matches finite differences for the adapters and the
// input, an expert no token reaches gets no adapter gradient, and B = 0 gives the base block bit
// for bit.
#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "check.h"
#include "ops/gemm.h"
#include "ops/moe_block.h"
#include "ops/moe_experts.h"

namespace qt {
namespace {

using namespace qt::cpu;
using namespace qt::test;

struct Block {
  MoeShape s{4, 5, 3, 6, 2, true};  // 8 pairs over 6 experts
  int r = 2;
  double scale = 1.5;
  Vec x, gate, gate_up, down, gu_a, gu_b, dn_a, dn_b;
  Vec probs, w;
  std::vector<int> idx;
  bool adapt_gu = true, adapt_dn = true;
  explicit Block(std::mt19937_64& rng) {
    const int N = s.N, H = s.H, Im = s.Im, E = s.E;
    x = random_f32_exact(N * H, rng);
    gate = random_f32_exact(E * H, rng);
    gate_up = random_f32_exact(E * 2 * Im * H, rng);
    down = random_f32_exact(E * H * Im, rng);
    gu_a = random_f32_exact(E * r * H, rng);
    gu_b = random_f32_exact(E * 2 * Im * r, rng);
    dn_a = random_f32_exact(E * r * Im, rng);
    dn_b = random_f32_exact(E * H * r, rng);
    probs.resize(N * E), w.resize(N * s.k), idx.resize(N * s.k);
  }
  ExpertLora<double> lora(Vec* g = nullptr) {
    ExpertLora<double> l;
    l.r = r, l.scale = scale;
    if (adapt_gu) l.gu_a = gu_a.data(), l.gu_b = gu_b.data();
    if (adapt_dn) l.dn_a = dn_a.data(), l.dn_b = dn_b.data();
    if (g) {  // g: [4] gradients, the shapes of gu_a, gu_b, dn_a, dn_b
      if (adapt_gu) l.g_gu_a = g[0].data(), l.g_gu_b = g[1].data();
      if (adapt_dn) l.g_dn_a = g[2].data(), l.g_dn_b = g[3].data();
    }
    return l;
  }
  Vec forward(bool with_lora = true) {
    Vec y(s.N * s.H);
    const ExpertLora<double> l = lora();
    moe_block_forward<double>(y.data(), probs.data(), idx.data(), w.data(), x.data(),
                              gate.data(), gate_up.data(), down.data(), s, nullptr,
                              with_lora ? &l : nullptr);
    return y;
  }
};

TEST(ops_moe_expert_lora, ForwardIsTheMergedExperts) {
  auto rng = test_rng();
  Block b(rng);
  const int H = b.s.H, Im = b.s.Im;
  const Vec y = b.forward();
  Vec gu = b.gate_up, dn = b.down;  // W_e [out, in] += scale * B_e [out, r] A_e [r, in]
  for (int e = 0; e < b.s.E; ++e) {
    gemm<double>(false, false, 2 * Im, H, b.r, b.scale, b.gu_b.data() + e * 2 * Im * b.r, b.r,
                 b.gu_a.data() + e * b.r * H, H, 1.0, gu.data() + e * 2 * Im * H, H);
    gemm<double>(false, false, H, Im, b.r, b.scale, b.dn_b.data() + e * H * b.r, b.r,
                 b.dn_a.data() + e * b.r * Im, Im, 1.0, dn.data() + e * H * Im, Im);
  }
  Vec want(b.s.N * H);
  moe_block_forward<double>(want.data(), b.probs.data(), b.idx.data(), b.w.data(), b.x.data(),
                            b.gate.data(), gu.data(), dn.data(), b.s);
  QT_EXPECT_CLOSE(y, want, kTolF64);
  EXPECT_GT(rel_err(y, b.forward(false)), 1e-3);  // the adapters are not a no-op
}

// Each adapter pair alone and both: the frozen block's backward (null base gradients) against
// central differences of <rnd, y> in the adapters and x.
TEST(ops_moe_expert_lora, BackwardAgainstFiniteDifferences) {
  for (const auto& [gu_on, dn_on] : {std::pair{true, true}, {true, false}, {false, true}}) {
    auto rng = test_rng();
    Block b(rng);
    b.adapt_gu = gu_on, b.adapt_dn = dn_on;
    const Vec rnd = random_f32_exact(b.s.N * b.s.H, rng);
    auto loss = [&] { return dot(rnd, b.forward()); };
    b.forward();
    Vec g[4] = {Vec(b.gu_a.size(), 0.25), Vec(b.gu_b.size(), 0.25), Vec(b.dn_a.size(), 0.25),
                Vec(b.dn_b.size(), 0.25)};  // gradients add to what is there
    Vec dx(b.s.N * b.s.H);
    const ExpertLora<double> l = b.lora(g);
    moe_block_backward<double>(dx.data(), nullptr, nullptr, nullptr, rnd.data(), b.x.data(),
                               b.probs.data(), b.idx.data(), b.w.data(), b.gate.data(),
                               b.gate_up.data(), b.down.data(), b.s, nullptr, 0, &l);
    for (Vec& v : g)
      for (double& e : v) e -= 0.25;
    SCOPED_TRACE(::testing::Message() << "gate_up " << gu_on << " down " << dn_on);
    QT_EXPECT_CLOSE(dx, fd_grad(b.x, loss), kTolFd);
    Vec* params[4] = {&b.gu_a, &b.gu_b, &b.dn_a, &b.dn_b};
    for (int i = 0; i < 4; ++i) {
      const bool on = i < 2 ? gu_on : dn_on;
      if (on) {
        QT_EXPECT_CLOSE(g[i], fd_grad(*params[i], loss), kTolFd);
        // An expert no token reaches gets nothing.
        const std::size_t per = g[i].size() / b.s.E;
        for (int e = 0; e < b.s.E; ++e)
          if (std::find(b.idx.begin(), b.idx.end(), e) == b.idx.end())
            EXPECT_TRUE(std::all_of(g[i].begin() + e * per, g[i].begin() + (e + 1) * per,
                                    [](double v) { return v == 0; }));
      } else {
        EXPECT_TRUE(std::all_of(g[i].begin(), g[i].end(), [](double v) { return v == 0; }));
      }
    }
  }
}

// PEFT's initialisation (B = 0): the float block is the base block bit for bit.
TEST(ops_moe_expert_lora, ZeroBIsTheBaseBitForBit) {
  auto rng = test_rng();
  Block b(rng);
  const MoeShape& s = b.s;
  auto f = [](const Vec& v) { return cast<float>(v); };
  const std::vector<float> x = f(b.x), gate = f(b.gate), gu = f(b.gate_up), dn = f(b.down),
                           gua = f(b.gu_a), dna = f(b.dn_a);
  const std::vector<float> gub(b.gu_b.size(), 0.f), dnb(b.dn_b.size(), 0.f);
  ExpertLora<float> l;
  l.r = b.r, l.scale = 1.5f, l.gu_a = gua.data(), l.gu_b = gub.data(), l.dn_a = dna.data(),
  l.dn_b = dnb.data();
  std::vector<float> y0(s.N * s.H), y1(s.N * s.H), p(s.N * s.E), w(s.N * s.k);
  std::vector<int> idx(s.N * s.k);
  moe_block_forward<float>(y0.data(), p.data(), idx.data(), w.data(), x.data(), gate.data(),
                           gu.data(), dn.data(), s);
  moe_block_forward<float>(y1.data(), p.data(), idx.data(), w.data(), x.data(), gate.data(),
                           gu.data(), dn.data(), s, nullptr, &l);
  for (std::size_t i = 0; i < y0.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(y0[i]), std::bit_cast<std::uint32_t>(y1[i])) << i;
  // The backward's dx too (the adapters' B = 0 adds exact zeros); dB is not zero.
  std::vector<float> dy = f(random_f32_exact(s.N * s.H, rng)), dx0(s.N * s.H), dx1(s.N * s.H);
  std::vector<float> ga(gua.size()), gb(gub.size()), gda(dna.size()), gdb(dnb.size());
  l.g_gu_a = ga.data(), l.g_gu_b = gb.data(), l.g_dn_a = gda.data(), l.g_dn_b = gdb.data();
  moe_block_backward<float>(dx0.data(), nullptr, nullptr, nullptr, dy.data(), x.data(), p.data(),
                            idx.data(), w.data(), gate.data(), gu.data(), dn.data(), s);
  moe_block_backward<float>(dx1.data(), nullptr, nullptr, nullptr, dy.data(), x.data(), p.data(),
                            idx.data(), w.data(), gate.data(), gu.data(), dn.data(), s, nullptr,
                            0.0f, &l);
  for (std::size_t i = 0; i < dx0.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(dx0[i]), std::bit_cast<std::uint32_t>(dx1[i])) << i;
  EXPECT_TRUE(std::any_of(gb.begin(), gb.end(), [](float v) { return v != 0; }));
  EXPECT_TRUE(std::all_of(ga.begin(), ga.end(), [](float v) { return v == 0; }));  // B = 0
}

}  // namespace
}  // namespace qt
