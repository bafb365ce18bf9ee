// Whole trainings on different meshes (run under mpiexec -n 4): data parallelism and ZeRO-1
// reproduce one rank's losses, resumption is exact, checkpoints move between dp sizes, and a
// corrupt newest checkpoint falls back to the previous one.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "qtrain/data.h"
#include "training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;
using test::run;
using test::StepRecord;

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\n"
         "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 8\nsteps = 20\nseed = 42\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 5\ngrad_clip = 1.0\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = 10\nkeep = 3\nresume = none\n"
         "[log]\nevery = 1\n";
}

double max_rel_diff(const std::vector<StepRecord>& a, const std::vector<StepRecord>& b,
                    long from_step = 1) {
  double worst = 0;
  for (const auto& x : a)
    for (const auto& y : b)
      if (x.step == y.step && x.step >= from_step) {
        if (!std::isfinite(x.loss) || !std::isfinite(y.loss)) return INFINITY;
        worst = std::max(worst, std::abs(x.loss - y.loss) / std::abs(y.loss));
      }
  return worst;
}

class Training : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(test::world_size(), 4) << "run under mpiexec -n 4";
    tmp_ = test::shared_temp_dir("train");
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(tmp_);
  }
  std::string path(const std::string& name) const { return tmp_ + "/" + name; }
  std::string tmp_;
};

TEST_F(Training, DataParallelReproducesOneRank) {
  auto one = run(1, deck_text(path("c1")), {}, path("dp1.jsonl"));
  auto two = run(2, deck_text(path("c2")), {}, path("dp2.jsonl"));
  auto four = run(4, deck_text(path("c4")), {}, path("dp4.jsonl"));
  ASSERT_EQ(one.exit_code, 0) << one.error;
  ASSERT_EQ(one.steps.size(), 20u);
  ASSERT_EQ(two.steps.size(), 20u);
  ASSERT_EQ(four.steps.size(), 20u);
  EXPECT_LT(one.steps.back().loss, one.steps.front().loss);  // it trains
  EXPECT_LT(max_rel_diff(two.steps, one.steps), 1e-5);
  EXPECT_LT(max_rel_diff(four.steps, one.steps), 1e-5);
}

TEST_F(Training, Zero1ReproducesZero0) {
  auto z0 = run(2, deck_text(path("a")), {"--optim.zero_stage=0"}, path("z0.jsonl"));
  auto z1 = run(2, deck_text(path("b")), {"--optim.zero_stage=1"}, path("z1.jsonl"));
  auto z1x4 = run(4, deck_text(path("c")), {"--optim.zero_stage=1"}, path("z1x4.jsonl"));
  ASSERT_EQ(z0.steps.size(), 20u);
  ASSERT_EQ(z1.steps.size(), 20u);
  ASSERT_EQ(z1x4.steps.size(), 20u);
  EXPECT_LT(max_rel_diff(z1.steps, z0.steps), 1e-5);
  EXPECT_LT(max_rel_diff(z1x4.steps, z0.steps), 1e-5);
}

TEST_F(Training, StoppedAndResumedRunIsExact) {
  auto full = run(2, deck_text(path("full")), {}, path("full.jsonl"));
  auto first = run(2, deck_text(path("split")), {"--train.stop_at=10"}, path("split.jsonl"));
  ASSERT_EQ(first.steps.size(), 10u);
  ASSERT_TRUE(fs::exists(path("split/step_00000010.h5")));
  auto rest = run(2, deck_text(path("split")), {"--checkpoint.resume=auto"}, path("split.jsonl"));
  ASSERT_EQ(rest.exit_code, 0) << rest.error;
  ASSERT_EQ(rest.steps.size(), 20u);  // appended after the first ten
  for (int i = 10; i < 20; ++i) {
    EXPECT_EQ(rest.steps[i].step, full.steps[i].step);
    EXPECT_EQ(rest.steps[i].loss, full.steps[i].loss) << "step " << i + 1;  // bit for bit
    EXPECT_EQ(rest.steps[i].grad_norm, full.steps[i].grad_norm) << "step " << i + 1;
  }
}

TEST_F(Training, CheckpointMovesBetweenDpSizesAndZeroStages) {
  auto full = run(1, deck_text(path("ref")), {}, path("ref.jsonl"));
  auto first = run(2, deck_text(path("dp2")), {"--train.stop_at=10", "--optim.zero_stage=1"},
                   path("dp2.jsonl"));
  ASSERT_EQ(first.steps.size(), 10u);
  const std::string ckpt = path("dp2/step_00000010.h5");
  auto at1 = run(1, deck_text(path("to1")), {"--checkpoint.resume=" + ckpt}, path("to1.jsonl"));
  auto at4 = run(4, deck_text(path("to4")), {"--checkpoint.resume=" + ckpt, "--optim.zero_stage=1"},
                 path("to4.jsonl"));
  ASSERT_EQ(at1.exit_code, 0) << at1.error;
  ASSERT_EQ(at1.steps.size(), 10u);
  EXPECT_EQ(at1.steps.front().step, 11);
  EXPECT_LT(max_rel_diff(at1.steps, full.steps, 11), 1e-5);
  ASSERT_EQ(at4.steps.size(), 10u);
  EXPECT_LT(max_rel_diff(at4.steps, full.steps, 11), 1e-5);
}

TEST_F(Training, CorruptNewestCheckpointFallsBackToPrevious) {
  auto full = run(2, deck_text(path("run")), {}, path("full.jsonl"));
  ASSERT_EQ(full.steps.size(), 20u);
  const std::string newest = path("run/step_00000020.h5");
  if (test::world_rank() == 0) fs::resize_file(newest, fs::file_size(newest) / 2);
  MPI_Barrier(MPI_COMM_WORLD);
  // Resume the same run: step 20 is unreadable, so it continues from step 10.
  auto again = run(2, deck_text(path("run")), {"--checkpoint.resume=auto", "--train.stop_at=20"},
                   path("again.jsonl"));
  ASSERT_EQ(again.exit_code, 0) << again.error;
  ASSERT_EQ(again.steps.size(), 10u);
  EXPECT_EQ(again.steps.front().step, 11);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(again.steps[i].loss, full.steps[10 + i].loss);
}

TEST_F(Training, CorruptNamedCheckpointIsABadInputError) {
  auto full = run(1, deck_text(path("run")), {"--train.stop_at=10"}, path("full.jsonl"));
  const std::string ckpt = path("run/step_00000010.h5");
  if (test::world_rank() == 0) fs::resize_file(ckpt, fs::file_size(ckpt) / 3);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto size_before = fs::file_size(ckpt);
  auto bad = run(2, deck_text(path("run")), {"--checkpoint.resume=" + ckpt}, path("bad.jsonl"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.error.find("step_00000010.h5"), std::string::npos) << bad.error;
  EXPECT_EQ(fs::file_size(ckpt), size_before);  // left as it was
}

TEST_F(Training, TrainsFromATokenFileOnAnyDpSize) {
  // A token file of repeating documents; dp = 1 and dp = 2 must agree and the loss must fall.
  const std::string file = path("tokens.h5");
  if (test::world_rank() == 0) {
    std::vector<std::int32_t> tokens;
    std::vector<std::int64_t> offsets = {0};
    std::vector<std::uint8_t> mask;
    for (int d = 0; d < 200; ++d) {
      for (int i = 0; i < 37; ++i) {
        tokens.push_back((d * 7 + i * i) % 256);
        mask.push_back(i % 9 != 0);  // some targets not counted
      }
      offsets.push_back(static_cast<std::int64_t>(tokens.size()));
    }
    write_token_file(file, tokens, offsets, mask, 256);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::vector<std::string> ov = {"--data.source=file", "--data.path=" + file};
  auto one = run(1, deck_text(path("f1")), ov, path("f1.jsonl"));
  auto two = run(2, deck_text(path("f2")), ov, path("f2.jsonl"));
  ASSERT_EQ(one.exit_code, 0) << one.error;
  ASSERT_EQ(one.steps.size(), 20u);
  ASSERT_EQ(two.steps.size(), 20u);
  EXPECT_LT(one.steps.back().loss, one.steps.front().loss);
  EXPECT_LT(max_rel_diff(two.steps, one.steps), 1e-5);
}

TEST_F(Training, CheckpointEveryMinusOneWritesNone) {
  auto res = run(2, deck_text(path("none")), {"--checkpoint.every=-1"}, path("none.jsonl"));
  ASSERT_EQ(res.exit_code, 0) << res.error;
  ASSERT_EQ(res.steps.size(), 20u);
  EXPECT_FALSE(fs::exists(path("none")) && !fs::is_empty(path("none")));
}

TEST_F(Training, MissingTokenFileIsABadInputErrorOnEveryRank) {
  auto res = run(2, deck_text(path("x")), {"--data.source=file", "--data.path=" + path("absent.h5")},
                 path("x.jsonl"));
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.error.find("absent.h5"), std::string::npos) << res.error;
}

}  // namespace
}  // namespace qt
