// The fp16 loss scaler's rule (optim/loss_scaler.h) on hand-worked sequences of clean steps and
// overflows; the expected scales follow DeepSpeed's DynamicLossScaler step by step.
#include <gtest/gtest.h>

#include <vector>

#include "optim/loss_scaler.h"

namespace qt {
namespace {

using Change = LossScaler::Change;

LossScalerConfig dynamic_config(int power, int window, int hysteresis, double min_scale = 1) {
  LossScalerConfig c;
  c.initial_scale_power = power;
  c.window = window;
  c.hysteresis = hysteresis;
  c.min_scale = min_scale;
  return c;
}

TEST(LossScaler, StartsAtTwoToTheInitialPower) {
  EXPECT_EQ(LossScaler(dynamic_config(16, 1000, 2)).scale(), 65536.0);
  EXPECT_EQ(LossScaler(dynamic_config(0, 1000, 2)).scale(), 1.0);
}

TEST(LossScaler, GrowsAfterEachCleanWindow) {
  LossScaler s(dynamic_config(4, 3, 1));
  // Window 3: doubles after the 3rd and the 6th clean step.
  const std::vector<double> want = {16, 16, 32, 32, 32, 64};
  for (double w : want) {
    s.update(false);
    EXPECT_EQ(s.scale(), w);
  }
}

TEST(LossScaler, HysteresisDelaysTheFirstReduction) {
  LossScaler s(dynamic_config(10, 100, 3));  // 1024, 3 overflows to the first halving
  EXPECT_EQ(s.update(true), Change::kHysteresis);
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.update(true), Change::kHysteresis);
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.update(true), Change::kReduced);
  EXPECT_EQ(s.scale(), 512.0);
  // The hysteresis is spent: a later overflow halves at once, clean steps between or not.
  EXPECT_EQ(s.update(false), Change::kNone);
  EXPECT_EQ(s.update(true), Change::kReduced);
  EXPECT_EQ(s.scale(), 256.0);
}

TEST(LossScaler, GrowthRefillsTheHysteresis) {
  LossScaler s(dynamic_config(3, 2, 2));  // 8
  s.update(true);   // hysteresis 2 -> 1, scale 8
  s.update(true);   // halves: 4
  EXPECT_EQ(s.scale(), 4.0);
  s.update(false);
  EXPECT_EQ(s.update(false), Change::kGrown);  // 2 clean steps: 8, hysteresis back to 2
  EXPECT_EQ(s.scale(), 8.0);
  EXPECT_EQ(s.update(true), Change::kHysteresis);
  EXPECT_EQ(s.scale(), 8.0);
}

TEST(LossScaler, AnOverflowRestartsTheCleanCount) {
  LossScaler s(dynamic_config(5, 3, 1));  // 32
  s.update(false);
  s.update(false);
  s.update(true);  // 16; the two clean steps before it no longer count
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 16.0);
  EXPECT_EQ(s.update(false), Change::kGrown);
  EXPECT_EQ(s.scale(), 32.0);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  LossScalerConfig c = dynamic_config(6, 1000, 2);
  c.consecutive_hysteresis = true;
  LossScaler s(c);  // 64
  EXPECT_EQ(s.update(true), Change::kHysteresis);
  s.update(false);  // refilled
  EXPECT_EQ(s.update(true), Change::kHysteresis);
  EXPECT_EQ(s.scale(), 64.0);
  EXPECT_EQ(s.update(true), Change::kReduced);
  EXPECT_EQ(s.scale(), 32.0);
}

TEST(LossScaler, StopsFallingAtTheMinimumAndThenIsStuck) {
  LossScaler s(dynamic_config(3, 1000, 1, 2.0));  // 8, floor 2
  EXPECT_EQ(s.update(true), Change::kReduced);
  EXPECT_EQ(s.scale(), 4.0);
  EXPECT_EQ(s.update(true), Change::kReduced);
  EXPECT_EQ(s.scale(), 2.0);
  EXPECT_EQ(s.update(true), Change::kStuck);
  EXPECT_EQ(s.scale(), 2.0);
  // A floor that is not a power-of-two step away is reached, not passed.
  LossScaler t(dynamic_config(2, 1000, 1, 3.0));  // 4, floor 3
  t.update(true);
  EXPECT_EQ(t.scale(), 3.0);
}

TEST(LossScaler, StaticScaleNeverChanges) {
  LossScalerConfig c;
  c.static_scale = 128;
  LossScaler s(c);
  EXPECT_FALSE(s.dynamic());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s.update(i % 2 == 0), Change::kNone);
  EXPECT_EQ(s.scale(), 128.0);
}

TEST(LossScaler, RestoredStateContinuesAsTheUninterruptedOne) {
  const LossScalerConfig c = dynamic_config(8, 4, 2);
  const std::vector<bool> outcomes = {false, true, false, false, true, true, false,
                                      false, false, false, false, true, false};
  LossScaler whole(c), first(c);
  for (std::size_t i = 0; i < 6; ++i) {
    whole.update(outcomes[i]);
    first.update(outcomes[i]);
  }
  LossScaler second(c);
  second.restore(first.state());
  for (std::size_t i = 6; i < outcomes.size(); ++i) {
    EXPECT_EQ(second.update(outcomes[i]), whole.update(outcomes[i])) << "step " << i;
    EXPECT_EQ(second.scale(), whole.scale()) << "step " << i;
  }
}

}  // namespace
}  // namespace qt
