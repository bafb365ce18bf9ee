// fp16's loss scaling (train.precision = fp16, issue 19) on the CPU back end under mpiexec -n 2,
// where the arithmetic stays fp32: a power-of-two scale is exact there, so a run that never
// overflows must give the fp32 run's losses and norms (a missing unscale, or a load-balancing
// loss left unscaled, would not); injected overflows are skipped and move the scale as
// DeepSpeed's rule says, step by step (the expected scales are worked out by hand below); a
// scale stuck at its minimum stops the run; a resumed run continues the scaler.
#include <gtest/gtest.h>

#include <filesystem>

#include "train/skip_cases.h"

namespace qt {
namespace {

std::string tiny_deck(bool moe = false) {
  std::string d =
      "[model]\npreset = tiny\nvocab_size = 128\nhidden_size = 32\nintermediate_size = 64\n"
      "num_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nhead_dim = 8\n";
  if (moe)  // a large load-balancing weight: its gradient must carry the scale too
    d += "num_experts = 4\nnum_experts_per_tok = 2\nmoe_intermediate_size = 16\n"
         "router_aux_loss_coef = 0.5\n";
  return d + "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 8\nsteps = 10\nseed = " +
         std::to_string(test::run_seed()) +
         "\n[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 2\n"
         "[data]\nsource = synthetic\n[checkpoint]\nresume = none\nevery = -1\n[log]\nevery = 1\n";
}

// The largest relative difference of two runs' grad norms (infinity when the steps differ or a
// norm of `a` is not finite where b's is).
double max_rel_norm_diff(const std::vector<test::StepRecord>& a,
                         const std::vector<test::StepRecord>& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].step != b[i].step) return INFINITY;
    if (std::isnan(a[i].grad_norm) && std::isnan(b[i].grad_norm)) continue;  // both skipped
    if (!std::isfinite(a[i].grad_norm)) return INFINITY;
    worst = std::max(worst, std::abs(a[i].grad_norm - b[i].grad_norm) / std::abs(b[i].grad_norm));
  }
  return worst;
}

std::vector<double> loss_scales(const std::string& metrics) {
  std::vector<double> out;
  for (const auto& j : test::metrics_lines_of_kind(metrics, ""))
    out.push_back(j.contains("loss_scale") ? j["loss_scale"].get<double>() : -1);
  return out;
}

std::vector<long> skipped_steps_of(const std::string& metrics) {
  std::vector<long> out;
  for (const auto& j : test::metrics_lines_of_kind(metrics, ""))
    if (j["skipped"].get<bool>()) out.push_back(j["step"].get<long>());
  return out;
}

// Every rank has read the runs' files: then rank 0 removes them.
void remove_when_read(const std::string& tmp) {
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

TEST(Fp16LossScaling, MatchesFp32WhereNothingOverflows) {
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("fp16-match");
  struct Case {
    const char* name;
    int ranks;
    bool moe;
    std::vector<std::string> mesh;
  };
  const std::vector<Case> cases = {
      {"serial", 1, false, {}},
      {"dp2 ZeRO-1", 2, false, {"--optim.zero_stage=1"}},
      {"dp2 ZeRO-3", 2, false, {"--optim.zero_stage=3"}},
      {"tp2", 2, false, {"--mesh.tp=2"}},
      {"pp2", 2, false, {"--mesh.pp=2"}},
      {"moe dp2", 2, true, {}},
      {"moe pp2", 2, true, {"--mesh.pp=2"}},
  };
  int k = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string at = tmp + "/" + std::to_string(k++);
    const auto fp32 = test::run(c.ranks, tiny_deck(c.moe), c.mesh, at + "-fp32.jsonl");
    ASSERT_EQ(fp32.exit_code, 0) << fp32.error;
    const auto fp16 = test::run(c.ranks, tiny_deck(c.moe),
                                test::with(c.mesh, {"--train.precision=fp16"}),
                                at + "-fp16.jsonl");
    ASSERT_EQ(fp16.exit_code, 0) << fp16.error;
    EXPECT_LE(test::max_rel_loss_diff(fp16.steps, fp32.steps), 1e-6);
    EXPECT_LE(max_rel_norm_diff(fp16.steps, fp32.steps), 1e-6);
    EXPECT_EQ(loss_scales(at + "-fp16.jsonl"), std::vector<double>(10, 65536.0));
  }
  // A static scale that is not a power of two: equal up to rounding.
  const auto fp32 = test::run(2, tiny_deck(), {}, tmp + "/static-fp32.jsonl");
  const auto fixed = test::run(2, tiny_deck(), {"--train.precision=fp16", "--train.loss_scale=1000"},
                               tmp + "/static-fp16.jsonl");
  ASSERT_EQ(fixed.exit_code, 0) << fixed.error;
  EXPECT_LE(test::max_rel_loss_diff(fixed.steps, fp32.steps), 1e-5);
  EXPECT_LE(max_rel_norm_diff(fixed.steps, fp32.steps), 1e-5);
  EXPECT_EQ(loss_scales(tmp + "/static-fp16.jsonl"), std::vector<double>(10, 1000.0));
  remove_when_read(tmp);
}

// Overflows at steps 3, 4, 5 and 8 with hysteresis 2 from 2^12: step 3 spends the hysteresis,
// 4 halves (the next step runs at 2048), 5 halves again (1024), 8 halves (512). They are skipped
// like the fp32 run's non-finite steps, which therefore gives the same losses; overflows of a
// dynamic scale do not count toward train.max_consecutive_skips (2 here, 3 came in a row).
TEST(Fp16LossScaling, OverflowsAreSkippedAndHalveTheScale) {
  const std::string tmp = test::shared_temp_dir("fp16-overflow");
  for (const char* poison : {"3,4,5,8", "3@1,4@0,5@1,8@0"}) {
    SCOPED_TRACE(poison);
    test::NonFiniteSteps nan_steps(poison);
    const std::vector<std::string> fp16 = {"--train.precision=fp16", "--train.initial_scale_power=12",
                                           "--train.hysteresis=2", "--train.max_consecutive_skips=2"};
    const auto scaled = test::run(2, tiny_deck(), fp16, tmp + "/fp16.jsonl");
    ASSERT_EQ(scaled.exit_code, 0) << scaled.error;
    const auto plain = test::run(2, tiny_deck(), {}, tmp + "/fp32.jsonl");
    ASSERT_EQ(plain.exit_code, 0) << plain.error;
    EXPECT_LE(test::max_rel_loss_diff(scaled.steps, plain.steps), 1e-6);
    EXPECT_LE(max_rel_norm_diff(scaled.steps, plain.steps), 1e-6);
    EXPECT_EQ(skipped_steps_of(tmp + "/fp16.jsonl"), (std::vector<long>{3, 4, 5, 8}));
    EXPECT_EQ(loss_scales(tmp + "/fp16.jsonl"),
              (std::vector<double>{4096, 4096, 4096, 4096, 2048, 1024, 1024, 1024, 512, 512}));
    const auto last = test::metrics_lines_of_kind(tmp + "/fp16.jsonl", "").back();
    EXPECT_EQ(last["overflow_steps"].get<long>(), 4);
    EXPECT_EQ(last["skipped_steps"].get<long>(), 4);
    MPI_Barrier(MPI_COMM_WORLD);  // every rank has read them
    if (test::world_rank() == 0) {
      std::filesystem::remove(tmp + "/fp16.jsonl");
      std::filesystem::remove(tmp + "/fp32.jsonl");
    }
  }
  remove_when_read(tmp);
}

// Window 3 from 2^4: the scale doubles after steps 3, 6 and 9; an overflow at step 5 (hysteresis
// 1: it halves at once) restarts the count, so the next doubling comes after step 8.
TEST(Fp16LossScaling, GrowsAfterEachCleanWindow) {
  const std::string tmp = test::shared_temp_dir("fp16-grow");
  test::NonFiniteSteps nan_steps("5");
  const auto r = test::run(2, tiny_deck(),
                           {"--train.precision=fp16", "--train.initial_scale_power=4",
                            "--train.loss_scale_window=3", "--train.hysteresis=1"},
                           tmp + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.error;
  // steps:   1   2   3   4   5   6   7   8   9   10
  EXPECT_EQ(loss_scales(tmp + "/m.jsonl"),
            (std::vector<double>{16, 16, 16, 32, 32, 16, 16, 16, 32, 32}));
  remove_when_read(tmp);
}

// From 2^2 with a floor of 2 and no hysteresis: step 1's overflow halves to 2, step 2's cannot
// lower it any more, so the run stops there (exit 3) without a checkpoint.
TEST(Fp16LossScaling, AnOverflowAtTheMinimumScaleStopsTheRun) {
  const std::string tmp = test::shared_temp_dir("fp16-stuck");
  test::NonFiniteSteps nan_steps("1,2,3");
  const auto r = test::run(2, tiny_deck(),
                           {"--train.precision=fp16", "--train.initial_scale_power=2",
                            "--train.min_loss_scale=2", "--train.hysteresis=1",
                            "--checkpoint.every=0", "--checkpoint.dir=" + tmp + "/ckpt"},
                           tmp + "/m.jsonl");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(loss_scales(tmp + "/m.jsonl"), (std::vector<double>{4, 2}));
  if (test::world_rank() == 0) {
    int files = 0;
    if (std::filesystem::exists(tmp + "/ckpt"))
      for (const auto& e : std::filesystem::directory_iterator(tmp + "/ckpt"))
        files += e.path().extension() == ".h5";
    EXPECT_EQ(files, 0) << "a stopped run wrote a checkpoint";
  }
  remove_when_read(tmp);
}

// A static scale cannot mend an overflow: they count toward train.max_consecutive_skips.
TEST(Fp16LossScaling, StaticScaleOverflowsCountTowardTheStop) {
  const std::string tmp = test::shared_temp_dir("fp16-static");
  test::NonFiniteSteps nan_steps("2,3");
  const auto r = test::run(2, tiny_deck(),
                           {"--train.precision=fp16", "--train.loss_scale=1024",
                            "--train.max_consecutive_skips=2"},
                           tmp + "/m.jsonl");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(skipped_steps_of(tmp + "/m.jsonl"), (std::vector<long>{2, 3}));
  remove_when_read(tmp);
}

// Stopped after step 5 and resumed (with another train.initial_scale_power, which a resumed
// dynamic scaler ignores), the run gives the uninterrupted one's losses and scales: the
// checkpoint carries the scale (halved twice by then), the spent hysteresis and the clean count:
// the window of 4 clean steps after the overflow at step 4 completes at step 8 in both (a resumed
// count starting afresh would complete it at step 9).
TEST(Fp16LossScaling, ResumedRunContinuesTheScaler) {
  const std::string tmp = test::shared_temp_dir("fp16-resume");
  test::NonFiniteSteps nan_steps("2,3,4");
  const std::vector<std::string> fp16 = {"--train.precision=fp16", "--train.loss_scale_window=4",
                                         "--train.hysteresis=2", "--checkpoint.every=0"};
  const auto whole = test::run(
      2, tiny_deck(),
      test::with(fp16, {"--checkpoint.dir=" + tmp + "/w", "--train.initial_scale_power=10"}),
      tmp + "/whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.error;
  const auto first = test::run(
      2, tiny_deck(),
      test::with(fp16, {"--checkpoint.dir=" + tmp + "/p", "--train.initial_scale_power=10",
                        "--train.stop_at=5"}),
      tmp + "/parts.jsonl");
  ASSERT_EQ(first.exit_code, 0) << first.error;
  const auto second = test::run(2, tiny_deck(),
                                test::with(fp16, {"--checkpoint.dir=" + tmp + "/p",
                                                  "--checkpoint.resume=auto",
                                                  "--train.initial_scale_power=3"}),
                                tmp + "/parts.jsonl");
  ASSERT_EQ(second.exit_code, 0) << second.error;
  EXPECT_LE(test::max_rel_loss_diff(second.steps, whole.steps), 0.0);
  //        steps:  1     2     3     4    5    6    7    8    9    10
  const std::vector<double> want = {1024, 1024, 1024, 512, 256, 256, 256, 256, 512, 512};
  EXPECT_EQ(loss_scales(tmp + "/whole.jsonl"), want);
  EXPECT_EQ(loss_scales(tmp + "/parts.jsonl"), want);
  const auto last = test::metrics_lines_of_kind(tmp + "/parts.jsonl", "").back();
  EXPECT_EQ(last["overflow_steps"].get<long>(), 3);
  remove_when_read(tmp);
}

}  // namespace
}  // namespace qt
