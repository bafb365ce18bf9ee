// Numerical safety (issue 19) on the CPU back end under mpiexec -n 2: a step whose gradients are
// NaN (on one rank only, or on all) is skipped at every ZeRO stage and with tp and pp, changing
// nothing in the checkpointed state; too many in a row stop the run (exit 3); the count survives a
// checkpoint, so a resumed run continues AdamW exactly; the loss-spike watch.
#include <gtest/gtest.h>

#include <filesystem>

#include "train/loss_spike.h"
#include "train/skip_cases.h"

namespace qt {
namespace {

std::string tiny_deck() {
  return "[model]\npreset = tiny\nvocab_size = 128\nhidden_size = 32\nintermediate_size = 64\n"
         "num_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nhead_dim = 8\n"
         "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 8\nsteps = 8\nseed = " +
         std::to_string(test::run_seed()) +
         "\n[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 2\n"
         "[data]\nsource = synthetic\n[checkpoint]\nresume = none\n[log]\nevery = 1\n";
}

TEST(NumericalSafety, SkippedStepChangesNothingOnEveryMesh) {
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("skip");
  test::expect_skips_change_nothing(
      {{"serial", 1, {}, -1},
       {"dp2 ZeRO-0, rank 1 only", 2, {}, 1},
       {"dp2 ZeRO-1, rank 0 only", 2, {"--optim.zero_stage=1"}, 0},
       {"dp2 ZeRO-2", 2, {"--optim.zero_stage=2"}, 1},
       {"dp2 ZeRO-3", 2, {"--optim.zero_stage=3"}, 1},
       {"dp2 offload", 2, {"--optim.zero_stage=1", "--optim.offload=cpu"}, 1},
       {"tp2", 2, {"--mesh.tp=2"}, 0},
       {"pp2 (the last stage's loss scale)", 2, {"--mesh.pp=2"}, 1}},
      tiny_deck(), tmp);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

TEST(NumericalSafety, StopsAfterConsecutiveSkips) {
  const std::string tmp = test::shared_temp_dir("skip-stop");
  test::expect_stop_after_consecutive_skips("dp2 ZeRO-1", 2, tiny_deck(), {"--optim.zero_stage=1"},
                                            tmp + "/dp2");
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

// A run skipping step 3, stopped after step 5 and resumed, gives the uninterrupted run's losses
// bit for bit: the checkpoint carries skipped_steps, so AdamW's bias correction continues from
// the 4 updates applied (with 5 it would differ from step 6 on).
TEST(NumericalSafety, ResumedRunContinuesTheSkipCount) {
  const std::string tmp = test::shared_temp_dir("skip-resume");
  const std::vector<std::string> base = {"--optim.zero_stage=1", "--checkpoint.every=0",
                                         "--log.every=1"};
  test::NonFiniteSteps poison("3");
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), base.begin(), base.end());
    return extra;
  };
  const auto whole =
      test::run(2, tiny_deck(), with({"--checkpoint.dir=" + tmp + "/whole"}), tmp + "/whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.error;
  const auto first =
      test::run(2, tiny_deck(), with({"--checkpoint.dir=" + tmp + "/parts", "--train.stop_at=5"}),
                tmp + "/parts.jsonl");
  ASSERT_EQ(first.exit_code, 0) << first.error;
  const auto second = test::run(
      2, tiny_deck(), with({"--checkpoint.dir=" + tmp + "/parts", "--checkpoint.resume=auto"}),
      tmp + "/parts.jsonl");
  ASSERT_EQ(second.exit_code, 0) << second.error;
  ASSERT_EQ(second.steps.size(), whole.steps.size());
  for (std::size_t i = 0; i < whole.steps.size(); ++i) {
    EXPECT_EQ(second.steps[i].step, whole.steps[i].step);
    if (whole.steps[i].step == 3) continue;  // the skipped step's norm is NaN in both
    EXPECT_EQ(second.steps[i].loss, whole.steps[i].loss) << "step " << whole.steps[i].step;
    EXPECT_EQ(second.steps[i].grad_norm, whole.steps[i].grad_norm)
        << "step " << whole.steps[i].step;
  }
  if (test::world_rank() == 0) {
    const auto lines = test::metrics_lines(tmp + "/parts.jsonl");
    EXPECT_EQ(lines.at(8)["skipped_steps"].get<long>(), 1);
    std::filesystem::remove_all(tmp);
  }
}

TEST(LossSpikeWatch, ReportsALossAboveTheFactorTimesTheRecentMeanAfterTheWarmup) {
  LossSpikeWatch w(2.0);
  // Warm-up: even a tenfold jump among the first kWarmup losses is not reported.
  for (int i = 0; i < LossSpikeWatch::kWarmup; ++i) EXPECT_FALSE(w.observe(i == 3 ? 30.0 : 3.0));
  // The mean now: 3, moved once by 27 x kWeight and back over the later steps, in closed form.
  double mean = 3.0;
  for (int i = 1; i < LossSpikeWatch::kWarmup; ++i)
    mean += LossSpikeWatch::kWeight * ((i == 3 ? 30.0 : 3.0) - mean);
  EXPECT_FALSE(w.observe(1.99 * mean));
  mean += LossSpikeWatch::kWeight * (1.99 * mean - mean);
  EXPECT_TRUE(w.observe(2.01 * mean));
  EXPECT_DOUBLE_EQ(w.mean_before(), mean);
  EXPECT_FALSE(w.observe(std::nan("")));  // ignored
  EXPECT_FALSE(w.observe(INFINITY));
  LossSpikeWatch off(0);
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(off.observe(i < 15 ? 1.0 : 100.0));
}

}  // namespace
}  // namespace qt
