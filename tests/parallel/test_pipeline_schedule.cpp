// Pipeline schedules (src/parallel/pipeline_schedule.h): the greedy scheduler gives 1F1B's lists
// and bubble exactly, keeps 1F1B's memory, and with split backwards leaves less bubble (ZB-H1's
// step when P weight halves may wait); the
// simulator runs interleaved lists and refuses lists that miss, repeat or misplace an action, or
// deadlock; the layers split over stages by cost.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdio>
#include <stdexcept>

#include "parallel/pipeline_schedule.h"

namespace qt {
namespace {

// The largest number of micro-batches a stage holds between a forward and its backward (whole,
// or the input half), and of weight halves waiting after their input half.
int peak_in_flight(const std::vector<PipeAction>& stage) {
  int now = 0, peak = 0;
  for (const PipeAction& a : stage) {
    if (a.op == PipeOp::kForward) peak = std::max(peak, ++now);
    if (a.op == PipeOp::kBackward || a.op == PipeOp::kBackwardInput) --now;
  }
  return peak;
}
int peak_weights_owed(const std::vector<PipeAction>& stage) {
  int now = 0, peak = 0;
  for (const PipeAction& a : stage) {
    if (a.op == PipeOp::kBackwardInput) peak = std::max(peak, ++now);
    if (a.op == PipeOp::kBackwardWeight) --now;
  }
  return peak;
}

TEST(PipelineSchedule, OneFOneBHasItsListsBubbleAndMemory) {
  for (int P : {1, 2, 4, 8})
    for (int M : {1, 3, 8, 16}) {
      SCOPED_TRACE(testing::Message() << "P " << P << " M " << M);
      const PipeScheduleConfig cfg{P, M, 1, false};
      const PipeSchedule s = schedule(cfg);
      const PipeSimulation r = simulate(s, cfg);  // F 1, B 2
      EXPECT_DOUBLE_EQ(r.makespan, 3.0 * (M + P - 1));
      EXPECT_NEAR(r.bubble, static_cast<double>(P - 1) / (M + P - 1), 1e-12);
      for (int st = 0; st < P; ++st) {
        EXPECT_LE(peak_in_flight(s[st]), P - st) << describe(s[st]);
        // 1F1B: min(P - s, M) forwards, then alternate backward and forward, then the backwards.
        const int warm = std::min(P - st, M);
        for (int i = 0; i < warm; ++i) EXPECT_EQ(s[st][i].op, PipeOp::kForward) << describe(s[st]);
        EXPECT_EQ(s[st][warm].op, PipeOp::kBackward) << describe(s[st]);
      }
    }
  const PipeSchedule s4 = schedule({4, 8, 1, false});
  std::printf("1F1B, 4 stages, 8 micro-batches, stage 0: %s\n", describe(s4[0]).c_str());
  EXPECT_EQ(describe(s4[3]), "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 F3.4 B3.4 F3.5 B3.5 F3.6 "
                             "B3.6 F3.7 B3.7");
}

TEST(PipelineSchedule, SplitBackwardsFillTheBubble) {
  const PipeCosts unit{1, 2, 1, 1};
  for (int P : {2, 4, 8})
    for (int M : {8, 16, 32}) {
      SCOPED_TRACE(testing::Message() << "P " << P << " M " << M);
      const PipeScheduleConfig whole{P, M, 1, false}, split{P, M, 1, true};
      const double b1 = simulate(schedule(whole), whole, unit).bubble;
      const PipeSchedule zs = schedule(split);
      const double bz = simulate(zs, split, unit).bubble;
      std::printf("P %d M %2d: 1F1B bubble %.4f, split %.4f, ZB-H1's (P-1)/(3M) %.4f\n", P, M, b1,
                  bz, (P - 1) / (3.0 * M));
      EXPECT_LT(bz, b1);
      // The greedy order's step: 3M + 2(P - 1) (ZB-H1's hand-made one: 3M + P - 1).
      EXPECT_NEAR(simulate(zs, split, unit).makespan, 3.0 * M + 2.0 * (P - 1), 1e-9);
      for (int st = 0; st < P; ++st) {
        EXPECT_LE(peak_in_flight(zs[st]), P - st) << describe(zs[st]);
        EXPECT_LE(peak_weights_owed(zs[st]), P - st) << describe(zs[st]);
      }
      // P weight halves may wait: ZB-H1's step, 3M + P - 1.
      PipeScheduleConfig zb = split;
      zb.max_weights_waiting = P;
      const PipeSchedule hs = schedule(zb);
      const PipeSimulation h = simulate(hs, zb, unit);
      std::printf("         with P weight halves waiting: bubble %.4f\n", h.bubble);
      EXPECT_NEAR(h.makespan, 3.0 * M + (P - 1), 1e-9);
      EXPECT_LE(h.bubble, (P - 1) / (3.0 * M) + 1e-12);  // the bound
      for (int st = 0; st < P; ++st) {
        EXPECT_LE(peak_in_flight(hs[st]), P - st) << describe(hs[st]);
        EXPECT_LE(peak_weights_owed(hs[st]), P) << describe(hs[st]);
      }
    }
}

// Interleaving: the simulator runs a hand-written list of two chunks a stage (P 2, M 2: each
// micro-batch passes stage 0, 1, 0, 1), and schedule() refuses to build one yet.
TEST(PipelineSchedule, InterleavedListsSimulate) {
  const PipeScheduleConfig cfg{2, 2, 2, false};
  using A = PipeAction;
  const PipeOp F = PipeOp::kForward, B = PipeOp::kBackward;
  const PipeSchedule s = {
      {A{F, 0, 0}, A{F, 0, 1}, A{F, 2, 0}, A{F, 2, 1}, A{B, 2, 0}, A{B, 2, 1}, A{B, 0, 0},
       A{B, 0, 1}},
      {A{F, 1, 0}, A{F, 1, 1}, A{F, 3, 0}, A{B, 3, 0}, A{F, 3, 1}, A{B, 3, 1}, A{B, 1, 0},
       A{B, 1, 1}}};
  const PipeSimulation r = simulate(s, cfg);
  EXPECT_GT(r.makespan, 0);
  EXPECT_LT(r.bubble, 0.5);
  EXPECT_EQ(schedule(cfg), s);  // this hand-written list is Megatron's order for P = V = M = 2
  EXPECT_THROW(schedule({2, 3, 2, false}), std::invalid_argument);  // M not a multiple of P
  EXPECT_THROW(schedule({2, 3, 2, true}), std::invalid_argument);   // split backwards too
}

// Interleaved 1F1B runs without deadlock, every action once, with less bubble than 1F1B:
// (P - 1) / (V M + P - 1) of the step with F = 1, B = 2 a chunk's (each chunk 1/V of a stage).
TEST(PipelineSchedule, InterleavingShrinksTheBubble) {
  int checked = 0;
  for (int P : {2, 3, 4})
    for (int V : {2, 3})
      for (int M : {P, 2 * P, 4 * P}) {
        const PipeScheduleConfig cfg{P, M, V, false};
        const PipeSchedule s = schedule(cfg);
        const PipeSimulation r =
            simulate(s, cfg, PipeCosts{1.0 / V, 2.0 / V, 1.0 / V, 1.0 / V});
        const PipeSimulation one = simulate(schedule({P, M}), {P, M});
        const double want = double(P - 1) / (V * M + P - 1);
        EXPECT_NEAR(r.bubble, want, 1e-9) << "P " << P << " V " << V << " M " << M;
        EXPECT_LT(r.bubble, one.bubble);
        ++checked;
      }
  EXPECT_EQ(checked, 18);
}

// Interleaving with split backwards (ZB-H1's weight halves in the interleaved order's bubbles):
// every list runs without deadlock, holds each action once, and its bubble is below interleaved
// 1F1B's with the same costs (a whole backward = its two halves), and below the split lists'
// with one weight half waiting (each W right after its I: the early input gradient alone, no
// halves moved into the bubble); at most P weight halves wait on a stage.
TEST(PipelineSchedule, InterleavedSplitBackwardsFillTheBubble) {
  int checked = 0;
  for (int P : {2, 3, 4})
    for (int V : {2, 3})
      for (int M : {P, 2 * P, 4 * P}) {
        SCOPED_TRACE(testing::Message() << "P " << P << " V " << V << " M " << M);
        const PipeCosts costs{1.0 / V, 2.0 / V, 1.0 / V, 1.0 / V};
        PipeScheduleConfig split{P, M, V, true};
        split.max_weights_waiting = P;
        const PipeSchedule zb_lists = schedule(split);
        const PipeSimulation zb = simulate(zb_lists, split, costs);
        for (const std::vector<PipeAction>& st : zb_lists)
          EXPECT_LE(peak_weights_owed(st), P) << describe(st);
        PipeScheduleConfig eager = split;
        eager.max_weights_waiting = 1;
        const PipeSimulation at_once = simulate(schedule(eager), eager, costs);
        const PipeScheduleConfig whole{P, M, V, false};
        const PipeSimulation one_f_one_b = simulate(schedule(whole), whole, costs);
        std::printf("P %d V %d M %2d: interleaved 1F1B bubble %.4f, W after its I %.4f, "
                    "interleaved ZB-H1 %.4f\n", P, V, M, one_f_one_b.bubble, at_once.bubble,
                    zb.bubble);
        EXPECT_LT(zb.bubble, one_f_one_b.bubble);
        EXPECT_LT(zb.bubble, at_once.bubble - 1e-9);
        ++checked;
      }
  EXPECT_EQ(checked, 18);
}

TEST(PipelineSchedule, SimulatorRefusesBadLists) {
  const PipeScheduleConfig cfg{2, 2, 1, false};
  PipeSchedule s = schedule(cfg);
  EXPECT_NO_THROW(simulate(s, cfg));
  PipeSchedule missing = s;
  missing[1].pop_back();
  EXPECT_THROW(simulate(missing, cfg), std::logic_error);
  PipeSchedule twice = s;
  twice[0].push_back(twice[0].front());
  EXPECT_THROW(simulate(twice, cfg), std::logic_error);
  PipeSchedule misplaced = s;
  std::swap(misplaced[0], misplaced[1]);
  EXPECT_THROW(simulate(misplaced, cfg), std::logic_error);
  // Stage 0 waits for its own backward before its forward: a deadlock, named.
  PipeSchedule stuck = s;
  std::reverse(stuck[0].begin(), stuck[0].end());
  try {
    simulate(stuck, cfg);
    ADD_FAILURE() << "expected a deadlock";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("deadlocks"), std::string::npos) << e.what();
  }
}

// The layer split: consecutive, at least one layer a stage, the largest stage's cost minimal
// (checked against every cut by brute force), the head's cost moving layers off the last stage.
TEST(PipelineSchedule, LayersSplitByCost) {
  EXPECT_EQ(split_layers(8, 4, 1, 0, 0), (std::vector<int>{0, 2, 4, 6, 8}));
  EXPECT_EQ(split_layers(7, 3, 1, 0, 0), (std::vector<int>{0, 3, 5, 7}));  // earliest take more
  EXPECT_EQ(split_layers(8, 2, 1, 0, 4), (std::vector<int>{0, 6, 8}));     // the head weighs 4
  EXPECT_EQ(split_layers(4, 4, 1, 0, 100), (std::vector<int>{0, 1, 2, 3, 4}));  // one each at least
  EXPECT_THROW(split_layers(3, 4, 1, 0, 0), std::invalid_argument);
  // The deck's split (mesh.pp_layers).
  EXPECT_EQ(layer_bounds_from_counts("3, 1", 2, 4), (std::vector<int>{0, 3, 4}));
  EXPECT_EQ(layer_bounds_from_counts("1,1,2", 3, 4), (std::vector<int>{0, 1, 2, 4}));
  for (const char* bad : {"3", "2,1", "3,0", "a,1", "3,,1", "", "3 1"})
    EXPECT_THROW(layer_bounds_from_counts(bad, 2, 4), std::invalid_argument) << bad;
  EXPECT_THROW(split_layers(3, 0, 1, 0, 0), std::invalid_argument);
  // Brute force over every cut of L layers into P stages.
  int checked = 0;
  for (int L = 1; L <= 9; ++L)
    for (int P = 1; P <= std::min(L, 4); ++P)
      for (double last : {0.0, 0.5, 2.5, 7.0}) {
        const std::vector<int> b = split_layers(L, P, 1.0, 0.25, last);
        ASSERT_EQ(b.size(), static_cast<std::size_t>(P + 1));
        ASSERT_EQ(b.front(), 0);
        ASSERT_EQ(b.back(), L);
        auto worst = [&](const std::vector<int>& c) {
          double w = 0;
          for (int s = 0; s < P; ++s)
            w = std::max(w, (c[s + 1] - c[s]) + (s == 0 ? 0.25 : 0) + (s == P - 1 ? last : 0));
          return w;
        };
        double best = INFINITY;
        std::vector<int> c(P + 1, 0);
        c[P] = L;
        // every strictly increasing c[1..P-1] in [1, L-1]
        std::function<void(int)> rec = [&](int s) {
          if (s == P) {
            best = std::min(best, worst(c));
            return;
          }
          for (int x = c[s - 1] + 1; x <= L - (P - s); ++x) {
            c[s] = x;
            rec(s + 1);
          }
        };
        if (P == 1)
          best = worst(c);
        else
          rec(1);
        for (int s = 0; s < P; ++s) EXPECT_LT(b[s], b[s + 1]) << L << " " << P;
        EXPECT_EQ(worst(b), best) << "L " << L << " P " << P << " last " << last;
        ++checked;
      }
  EXPECT_GT(checked, 50);
}

}  // namespace
}  // namespace qt
