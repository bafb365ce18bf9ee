// The step metrics' derived figures: the balance of each sparse layer's expert load.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "train/metrics.h"

namespace qt {
namespace {

TEST(ExpertLoad, CoefficientOfVariationAndMaxOverMean) {
  // Two layers of four experts: even, then 8 tokens on one expert of four (mean 2).
  const std::vector<double> load = {5, 5, 5, 5, 8, 0, 0, 0};
  const ExpertLoadSummary s = summarize_expert_load(load, 4);
  ASSERT_EQ(s.cv.size(), 2u);
  EXPECT_DOUBLE_EQ(s.cv[0], 0.0);
  EXPECT_DOUBLE_EQ(s.max_over_mean[0], 1.0);
  // population std of {8, 0, 0, 0}: sqrt((36 + 3 x 4) / 4) = sqrt(12); / mean 2
  EXPECT_NEAR(s.cv[1], std::sqrt(12.0) / 2.0, 1e-12);
  EXPECT_DOUBLE_EQ(s.max_over_mean[1], 4.0);
  // No tokens: zeros, not NaN; no experts or a ragged tail: nothing.
  const ExpertLoadSummary z = summarize_expert_load({0, 0, 0}, 3);
  ASSERT_EQ(z.cv.size(), 1u);
  EXPECT_EQ(z.cv[0], 0.0);
  EXPECT_TRUE(summarize_expert_load(load, 0).cv.empty());
  EXPECT_EQ(summarize_expert_load(load, 3).cv.size(), 2u);  // 8 values: two whole layers of 3
}

}  // namespace
}  // namespace qt
