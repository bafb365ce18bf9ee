// The expert capacity of a Qwen3-MoE block (ops/moe_capacity.h, model.moe_capacity_factor):
// capacities and drop masks worked by hand; the block with drops against the dropless experts
// with the dropped slots' weights zeroed (a reference that does not use the mask), its backward
// against finite differences while drops happen, and a capacity of N or more bit for bit the
// dropless block. Fresh random inputs (the seed is printed).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "check.h"
#include "ops/moe_block.h"
#include "ops/moe_capacity.h"
#include "ops/moe_experts.h"
#include "moe_block_fd.h"

namespace qt {
namespace {

using namespace qt::cpu;
using namespace qt::test;

TEST(ops_moe_capacity, ExpertCapacityByHand) {
  EXPECT_EQ(expert_capacity(64, 2, 8, 0.0), 64);     // dropless: N
  EXPECT_EQ(expert_capacity(64, 2, 8, 1.0), 16);     // 64 x 2 / 8
  EXPECT_EQ(expert_capacity(64, 2, 8, 1.25), 20);    // 1.25 x 16
  EXPECT_EQ(expert_capacity(10, 2, 8, 1.0), 3);      // ceil(2.5)
  EXPECT_EQ(expert_capacity(100, 3, 7, 1.1), 48);    // ceil(330 / 7 = 47.14)
  EXPECT_EQ(expert_capacity(6, 2, 5, 2.5), 6);       // exactly 6: not rounded up to 7
  EXPECT_EQ(expert_capacity(10, 2, 4, 4.0), 10);     // min(N = 10, 20)
  EXPECT_EQ(expert_capacity(8, 8, 8, 2.0), 8);       // min(8, 16)
  EXPECT_EQ(expert_capacity(5, 1, 128, 0.01), 1);    // ceil(3.9e-4): never 0 with tokens
  EXPECT_EQ(expert_capacity(0, 2, 8, 1.0), 0);
}

// N = 4 tokens, k = 2, E = 3: pairs in order (token, slot) go to experts 0 1 | 0 2 | 1 0 | 0 2.
TEST(ops_moe_capacity, KeepByHand) {
  const std::vector<int> idx = {0, 1, 0, 2, 1, 0, 0, 2};
  std::vector<std::uint8_t> keep(idx.size(), 7);
  // C = 2: expert 0's third and fourth pairs (pairs 5 and 6) dropped.
  EXPECT_EQ(capacity_keep(keep.data(), idx.data(), 4, 2, 3, 2), 2);
  EXPECT_EQ(keep, (std::vector<std::uint8_t>{1, 1, 1, 1, 1, 0, 0, 1}));
  // C = 1: each expert's first pair only (pairs 0, 1, 3).
  EXPECT_EQ(capacity_keep(keep.data(), idx.data(), 4, 2, 3, 1), 5);
  EXPECT_EQ(keep, (std::vector<std::uint8_t>{1, 1, 0, 1, 0, 0, 0, 0}));
  // C = N: everything.
  EXPECT_EQ(capacity_keep(keep.data(), idx.data(), 4, 2, 3, 4), 0);
  EXPECT_EQ(keep, std::vector<std::uint8_t>(8, 1));
}

// The drop rule as the docs state it, written out directly: pair p is kept iff fewer than C
// earlier pairs went to its expert.
std::vector<bool> kept_by_definition(const std::vector<int>& idx, int C) {
  std::vector<bool> kept(idx.size());
  for (std::size_t p = 0; p < idx.size(); ++p)
    kept[p] = std::count(idx.begin(), idx.begin() + static_cast<long>(p), idx[p]) < C;
  return kept;
}

struct Block {
  MoeShape s;
  Vec gate, gate_up, down, x;
  Block(const MoeShape& shape, std::mt19937_64& rng) : s(shape) {
    gate = random_f32_exact(static_cast<std::size_t>(s.E) * s.H, rng);
    gate_up = random_f32_exact(static_cast<std::size_t>(s.E) * 2 * s.Im * s.H, rng);
    down = random_f32_exact(static_cast<std::size_t>(s.E) * s.H * s.Im, rng);
    x = random_f32_exact(static_cast<std::size_t>(s.N) * s.H, rng);
  }
  struct Out {
    Vec y, probs, w;
    std::vector<int> idx;
    long dropped;
  };
  Out forward(double factor) const {
    MoeShape f = s;
    f.capacity_factor = factor;
    Out o{Vec(static_cast<std::size_t>(s.N) * s.H), Vec(static_cast<std::size_t>(s.N) * s.E),
          Vec(static_cast<std::size_t>(s.N) * s.k), std::vector<int>(s.N * s.k), 0};
    o.dropped = moe_block_forward<double>(o.y.data(), o.probs.data(), o.idx.data(), o.w.data(),
                                          x.data(), gate.data(), gate_up.data(), down.data(), f);
    return o;
  }
};

// 12 tokens, 4 experts, 2 a token: C = ceil(0.75 x 12 x 2 / 4) = 5, so the 4 experts keep at
// most 20 of the 24 pairs: at least 4 are dropped whatever the routing.
TEST(ops_moe_capacity, BlockForwardZeroesTheDroppedSlots) {
  auto rng = test_rng();
  const Block b(MoeShape{12, 6, 4, 4, 2, true}, rng);
  const double factor = 0.75;
  const int C = 5;
  const Block::Out dropless = b.forward(0), got = b.forward(factor);
  // The routing is the router's alone: the drops change neither the choice nor the weights.
  EXPECT_EQ(got.idx, dropless.idx);
  EXPECT_EQ(got.w, dropless.w);
  EXPECT_EQ(got.probs, dropless.probs);
  // The reference: the dropless experts with the dropped slots' weights zeroed (their experts
  // still run, adding 0).
  const std::vector<bool> kept = kept_by_definition(got.idx, C);
  Vec w0 = got.w;
  long dropped = 0;
  for (std::size_t p = 0; p < kept.size(); ++p)
    if (!kept[p]) {
      w0[p] = 0;
      ++dropped;
    }
  EXPECT_GE(dropped, 4);
  EXPECT_EQ(got.dropped, dropped);
  Vec want(got.y.size());
  moe_experts_forward<double>(want.data(), b.x.data(), got.idx.data(), w0.data(),
                              b.gate_up.data(), b.down.data(), b.s.N, b.s.H, b.s.Im, b.s.E,
                              b.s.k);
  QT_EXPECT_CLOSE(got.y, want, kTolF64);
  EXPECT_GT(rel_err(dropless.y, want), 1e-3);  // the drops changed the output
  // The float instantiation drops the same pairs.
  MoeShape f = b.s;
  f.capacity_factor = factor;
  std::vector<float> yf(got.y.size()), pf(got.probs.size()), wf(got.w.size());
  std::vector<int> idxf(got.idx.size());
  const long dropped_f = moe_block_forward<float>(
      yf.data(), pf.data(), idxf.data(), wf.data(), cast<float>(b.x).data(),
      cast<float>(b.gate).data(), cast<float>(b.gate_up).data(), cast<float>(b.down).data(), f);
  if (idxf == got.idx) {  // (a near tie may route a float token elsewhere)
    EXPECT_EQ(dropped_f, dropped);
    QT_EXPECT_CLOSE(yf, want, kTolF32);
  }
}

// A capacity of N or more (factor 100: min(N, ...) = N), or one that no expert reaches, keeps
// every pair: forward and backward bit for bit the dropless block's.
TEST(ops_moe_capacity, NoDropIsBitIdenticalToDropless) {
  auto rng = test_rng();
  const Block b(MoeShape{10, 6, 4, 4, 2, true}, rng);
  const Block::Out dropless = b.forward(0);
  // The largest expert load of this routing: a capacity of exactly that keeps all.
  std::vector<int> load(b.s.E, 0);
  for (int e : dropless.idx) ++load[e];
  const int busiest = *std::max_element(load.begin(), load.end());
  // C = ceil(busiest - 0.5) = busiest
  const double exact = (busiest - 0.5) * b.s.E / (b.s.N * b.s.k);
  ASSERT_EQ(expert_capacity(b.s.N, b.s.k, b.s.E, exact), busiest);
  for (double factor : {100.0, exact}) {
    SCOPED_TRACE(factor);
    const Block::Out got = b.forward(factor);
    EXPECT_EQ(got.dropped, 0);
    EXPECT_EQ(got.y, dropless.y);
    MoeShape f = b.s;
    f.capacity_factor = factor;
    const Vec dy = random_f32_exact(got.y.size(), rng);
    Vec dx0(got.y.size()), dg0(b.gate.size()), dgu0(b.gate_up.size()), dd0(b.down.size());
    Vec dx1 = dx0, dg1 = dg0, dgu1 = dgu0, dd1 = dd0;
    moe_block_backward<double>(dx0.data(), dg0.data(), dgu0.data(), dd0.data(), dy.data(),
                               b.x.data(), dropless.probs.data(), dropless.idx.data(),
                               dropless.w.data(), b.gate.data(), b.gate_up.data(), b.down.data(),
                               b.s);
    moe_block_backward<double>(dx1.data(), dg1.data(), dgu1.data(), dd1.data(), dy.data(),
                               b.x.data(), got.probs.data(), got.idx.data(), got.w.data(),
                               b.gate.data(), b.gate_up.data(), b.down.data(), f);
    EXPECT_EQ(dx1, dx0);
    EXPECT_EQ(dg1, dg0);
    EXPECT_EQ(dgu1, dgu0);
    EXPECT_EQ(dd1, dd0);
  }
}

// The block's backward against finite differences while pairs are dropped (moe_block_fd.h: the
// aux term from the routing before the drops). The +u tokens all choose the two experts of
// largest a_e and the -u tokens the two of smallest, three tokens each, so each of these four
// experts gets 3 pairs; factor 0.8 gives C = ceil(0.8 x 6 x 2 / 5) = 2, and each drops its third
// pair (4 of 12).
TEST(ops_moe_capacity, BlockBackwardWithDropsAgainstFiniteDifferences) {
  auto rng = test_rng();
  for (bool norm_topk : {true, false}) {
    SCOPED_TRACE(norm_topk);
    const MoeShape shape{6, 5, 3, 5, 2, norm_topk, 0.8};
    ASSERT_EQ(expert_capacity(shape.N, shape.k, shape.E, shape.capacity_factor), 2);
    MoeBlockFd b(shape, rng);
    EXPECT_EQ(b.dropped, 4);
    b.expect_matches_finite_differences();
    // The dropless backward over the same routing differs: the drops are not a no-op there.
    MoeShape dropless = shape;
    dropless.capacity_factor = 0;
    Vec dx0(shape.N * shape.H), dg0(b.gate.size(), 0.0), dgu0(b.gate_up.size(), 0.0);
    Vec dd0(b.down.size(), 0.0);
    b.backward(dx0.data(), dg0.data(), dgu0.data(), dd0.data(), dropless, b.coef);
    EXPECT_GT(rel_err(dgu0, b.dgate_up), 1e-3);
    EXPECT_GT(rel_err(dg0, b.dgate), 1e-3);
  }
}

}  // namespace
}  // namespace qt
