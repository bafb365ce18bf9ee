// The synthetic Markov source: deterministic by index, valid ids, and a loss floor that matches
// the empirical cross-entropy of its own transition probabilities.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "qtrain/data.h"
#include "support/random.h"

namespace qt {
namespace {

TEST(Synthetic, SamplesAreDeterministicShiftedAndInRange) {
  const std::uint64_t seed = test::test_seed();
  auto a = make_synthetic_source(50, 3, seed), b = make_synthetic_source(50, 3, seed);
  auto other = make_synthetic_source(50, 3, seed + 1);
  const int T = 33;
  std::vector<std::int32_t> in1(T), tg1(T), in2(T), tg2(T), in3(T), tg3(T);
  a->sample(12345, in1.data(), tg1.data(), nullptr, T);
  b->sample(12345, in2.data(), tg2.data(), nullptr, T);
  other->sample(12345, in3.data(), tg3.data(), nullptr, T);
  EXPECT_EQ(in1, in2);
  EXPECT_EQ(tg1, tg2);
  EXPECT_NE(in1, in3);
  for (int t = 0; t < T; ++t) {
    EXPECT_GE(in1[t], 0);
    EXPECT_LT(in1[t], 50);
    if (t + 1 < T) EXPECT_EQ(tg1[t], in1[t + 1]);  // targets are the inputs shifted by one
  }
  a->sample(12346, in2.data(), tg2.data(), nullptr, T);
  EXPECT_NE(in1, in2);
  // Positions: one sequence, 0 .. T-1; and the same tokens as without them.
  std::vector<std::int32_t> pos(T, -1);
  a->sample(12345, in2.data(), tg2.data(), pos.data(), T);
  EXPECT_EQ(in1, in2);
  for (int t = 0; t < T; ++t) EXPECT_EQ(pos[t], t);
}

TEST(Synthetic, LossFloorIsTheEmpiricalEntropyRate) {
  const int V = 30, K = 4, T = 64;
  auto src = make_synthetic_source(V, K, test::test_seed());
  // Estimate P(next | current) and the entropy rate from samples.
  std::map<std::pair<int, int>, double> pair_count;
  std::vector<double> from_count(V, 0);
  std::vector<std::int32_t> in(T), tg(T);
  for (int s = 0; s < 4000; ++s) {
    src->sample(s, in.data(), tg.data(), nullptr, T);
    for (int t = 0; t < T; ++t) {
      pair_count[{in[t], tg[t]}] += 1;
      from_count[in[t]] += 1;
    }
  }
  double total = 0, nll = 0;
  std::map<int, int> successors;
  for (const auto& [key, c] : pair_count) {
    nll -= c * std::log(c / from_count[key.first]);
    total += c;
    successors[key.first]++;
  }
  for (const auto& [from, k] : successors) EXPECT_LE(k, K) << "token " << from;
  const double empirical = nll / total;
  EXPECT_NEAR(src->loss_floor(), empirical, 0.01 * empirical);
  EXPECT_GT(src->loss_floor(), 0.0);
  EXPECT_LT(src->loss_floor(), std::log(K) + 1e-9);
}

}  // namespace
}  // namespace qt
