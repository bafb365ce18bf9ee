// Learning-rate schedule and AdamW (against a direct fp64 transcription of PyTorch's AdamW),
// including clipping, no decay on norm weights, and ZeRO-1 against ZeRO-0 under MPI.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "optim/adamw_math.h"
#include "optim/optimizer.h"
#include "optim/sharded_state.h"
#include "optim/schedule.h"
#include "support/random.h"

namespace qt {
namespace {

// The vectorised host AdamW of optim.offload (adamw_update_host) gives the bits of the scalar
// reference, on fresh random inputs of a length that leaves a vector remainder.
TEST(AdamWHost, VectorisedUpdateIsBitForBitTheReference) {
  std::mt19937_64 rng(test::test_seed());
  const std::size_t n = 100003;
  auto w = test::random_vector<float>(n, rng), g = test::random_vector<float>(n, rng, 1e-2);
  auto m = test::random_vector<float>(n, rng, 1e-3), v = test::random_vector<float>(n, rng, 1e-4);
  for (float& x : v) x = std::abs(x);  // second moments are never negative
  OptimConfig cfg;
  for (const bool decays : {true, false}) {
    const AdamWStep st = adamw_step(cfg, 3e-4, 0.7, 5);
    std::vector<float> w1 = w, m1 = m, v1 = v, w2 = w, m2 = m, v2 = v;
    adamw_update(w1.data(), g.data(), m1.data(), v1.data(), n, st, decays);
    adamw_update_host(w2.data() + 1, g.data() + 1, m2.data() + 1, v2.data() + 1, n - 1, st,
                      decays);  // unaligned start
    adamw_update_host(w2.data(), g.data(), m2.data(), v2.data(), 1, st, decays);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < n; ++i)
      differ += std::memcmp(&w1[i], &w2[i], 4) != 0 || std::memcmp(&m1[i], &m2[i], 4) != 0 ||
                std::memcmp(&v1[i], &v2[i], 4) != 0;
    EXPECT_EQ(differ, 0u) << "elements whose weight or moments differ (decay " << decays << ")";
    EXPECT_NE(w1, w);  // it updated something
  }
}

TEST(Schedule, WarmupThenCosineOrLinearToMinLr) {
  OptimConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(lr_at(o, 110, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(o, 110, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(o, 110, 10), 1.0);
  EXPECT_NEAR(lr_at(o, 110, 60), 0.55, 1e-12);  // half way: cosine mid point
  EXPECT_NEAR(lr_at(o, 110, 110), 0.1, 1e-12);
  EXPECT_NEAR(lr_at(o, 110, 500), 0.1, 1e-12);  // clamped after the horizon
  o.schedule = Schedule::kLinear;
  EXPECT_NEAR(lr_at(o, 110, 35), 1.0 - 0.9 * 0.25, 1e-12);
  o.schedule = Schedule::kConstant;
  EXPECT_DOUBLE_EQ(lr_at(o, 110, 80), 1.0);
  o.warmup_steps = 0;
  o.schedule = Schedule::kCosine;
  EXPECT_DOUBLE_EQ(lr_at(o, 100, 0), 1.0);
}

struct Reference {  // fp64 AdamW, PyTorch's formulation
  std::vector<double> p, m, v;
  void step(const std::vector<double>& g, const std::vector<bool>& decay, const OptimConfig& o,
            double lr, int t) {
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (decay[i]) p[i] -= lr * o.weight_decay * p[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g[i];
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g[i] * g[i];
      const double mh = m[i] / (1 - std::pow(o.beta1, t)), vh = v[i] / (1 - std::pow(o.beta2, t));
      p[i] -= lr * mh / (std::sqrt(vh) + o.eps);
    }
  }
};

class AdamWTest : public ::testing::TestWithParam<int> {};  // param: ZeRO stage

// The optimizer driver (ShardedState, one unit over the whole layout) at every ZeRO stage, ranks
// contributing uneven shares of the gradient, against an fp64 AdamW with clipping.
TEST_P(AdamWTest, MatchesFp64ReferenceWithClippingUnderMpi) {
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  ModelConfig c;
  c.vocab_size = 40;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  ParamLayout layout(c);
  OptimConfig o;
  o.lr = 1e-2;
  o.min_lr = 1e-3;
  o.warmup_steps = 2;
  o.weight_decay = 0.1;
  o.grad_clip = 0.5;
  o.zero_stage = GetParam();
  const int steps = 6;
  MeshShape mesh;
  mesh.dp = world->size();
  const ShardPlan plan = plan_one_unit(layout, "model", mesh, o.zero_stage);
  ShardedState opt(plan, layout, o, *world, steps);

  std::uint64_t seed = test::test_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);  // same data on every rank
  std::mt19937_64 rng(seed);
  const std::size_t n = layout.numel();
  auto p0 = test::random_vector<float>(n, rng, 0.5);
  for (const FlatPiece& p : opt.param_pieces())
    std::copy_n(p0.begin() + p.range.begin, p.range.size(), p.data);
  Reference ref{{p0.begin(), p0.end()}, std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  std::vector<bool> decay(n);
  for (const ParamInfo& p : layout.params())
    for (std::size_t i = 0; i < p.numel; ++i) decay[p.offset + i] = p.shape.size() > 1;

  for (int t = 0; t < steps; ++t) {
    auto g = test::random_vector<double>(n, rng, t == 0 ? 1.0 : 0.01);  // step 0 is clipped
    // Each rank contributes an uneven share; the sum over ranks is g.
    const double share = (world->rank() + 1.0) / (world->size() * (world->size() + 1) / 2.0);
    opt.zero_grads();
    float* grads = opt.grads(0);
    for (std::size_t i = 0; i < n; ++i) grads[i] = static_cast<float>(g[i] * share);
    opt.grads_done(0);
    double norm = 0;
    for (double x : g) norm += x * x;
    norm = std::sqrt(norm);
    const double clip = norm > o.grad_clip ? o.grad_clip / (norm + 1e-6) : 1.0;
    for (auto& x : g) x *= clip;
    const OptimStepStats s = opt.step(t);
    EXPECT_NEAR(s.grad_norm, norm, 1e-5 * norm);
    EXPECT_DOUBLE_EQ(s.lr, lr_at(o, steps, t));
    ref.step(g, decay, o, s.lr, t + 1);
  }
  // Element by element, so a wrongly decayed norm weight (a few elements) cannot hide. ZeRO-3
  // holds its own shard only.
  std::size_t checked = 0;
  for (const FlatPiece& p : opt.param_pieces()) {
    for (std::size_t k = 0; k < p.range.size(); ++k, ++checked) {
      const std::size_t i = p.range.begin + k;
      ASSERT_TRUE(std::isfinite(p.data[k]));
      ASSERT_NEAR(p.data[k], ref.p[i], 1e-5 * (std::abs(ref.p[i]) + 1e-2)) << "element " << i;
    }
  }
  const Range own = plan.units[0].shard(world->rank());
  EXPECT_EQ(checked, o.zero_stage == 3 ? own.size() : n);
  const StateTargets held = opt.checkpoint_targets();
  ASSERT_EQ(held.exp_avg.size(), 1u);
  EXPECT_EQ(held.exp_avg[0].range.size(), o.zero_stage == 0 ? n : own.size());
}

INSTANTIATE_TEST_SUITE_P(Zero, AdamWTest, ::testing::Values(0, 1, 2, 3),
                         [](const auto& i) { return "zero" + std::to_string(i.param); });

}  // namespace
}  // namespace qt
