// A run never loses a user's work (issue 15): whatever the deck, the checkpoints already in
// checkpoint.dir are resumed, refused with exit 2, or skipped and kept, but never overwritten or
// pruned unless the run wrote them or resumed past them; a state that is not finite is never
// written. Whole trainings in-process on 2 ranks (tests/train/training_harness.h).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;
using test::run;

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\n"
         "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 4\nsteps = 3\nseed = 7\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 1\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = 1\nkeep = 3\nresume = auto\n"
         "[log]\nevery = 10\n";
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Every file of a directory with its bytes: equal snapshots mean nothing was touched.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file()) out[e.path().filename().string()] = read_bytes(e.path());
  return out;
}

std::vector<std::string> names(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& [name, bytes] : snapshot(dir)) out.push_back(name);
  return out;
}

class CheckpointSafety : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(test::world_size(), 2) << "run under mpiexec -n 2";
    tmp_ = test::shared_temp_dir("safety");
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(tmp_);
  }
  std::string path(const std::string& name) const { return tmp_ + "/" + name; }
  // A finished 3-step run with checkpoints at steps 1, 2 and 3 in path(dir).
  void train(const std::string& dir, std::vector<std::string> more = {}) {
    auto r = run(2, deck_text(path(dir)), more, path(dir + ".jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(names(path(dir)).size(), 3u);
  }
  // Runs on `dir` with `more`; expects exit 2 naming `want` and `dir` untouched.
  void expect_refused(const std::string& dir, std::vector<std::string> more,
                      const std::string& want) {
    const auto before = snapshot(path(dir));
    more.push_back("--train.steps=6");
    auto r = run(2, deck_text(path(dir)), more, path("refused.jsonl"));
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_NE(r.error.find(want), std::string::npos) << r.error;
    EXPECT_EQ(snapshot(path(dir)), before) << "the checkpoints were changed";
    EXPECT_TRUE(r.steps.empty()) << "the refused run trained";
  }
  std::string tmp_;
};

// Case 1: a complete checkpoint of another model stops resume = auto instead of being skipped,
// overwritten and pruned.
TEST_F(CheckpointSafety, AutoResumeRefusesAnotherModel) {
  train("c");
  expect_refused("c", {"--model.hidden_size=32"},
                 "model.hidden_size is 64 in the checkpoint but 32 in the deck");
  expect_refused("c", {"--model.num_layers=3"}, "model.num_layers is 2 in the checkpoint");
}

TEST_F(CheckpointSafety, AutoResumeRefusesOtherLoraSettings) {
  train("full");
  expect_refused("full", {"--lora.r=4"}, "holds the whole model, not LoRA adapters");
  train("lora", {"--lora.r=4"});
  expect_refused("lora", {"--lora.r=8"}, "lora.r is 4 in the checkpoint but 8 in the deck");
  expect_refused("lora", {}, "holds LoRA adapters (lora.r = 4), not the whole model");
  expect_refused("lora", {"--lora.r=4", "--train.seed=8"}, "its LoRA adapters were trained on the base");
}

// Case 1: resume = none and resume = <older file> would overwrite checkpoints of the directory.
TEST_F(CheckpointSafety, NoneAndOlderFileRefuseToOverwrite) {
  train("c");
  expect_refused("c", {"--checkpoint.resume=none"}, "already holds 3 checkpoint(s)");
  expect_refused("c", {"--checkpoint.resume=" + path("c/step_00000001.h5")},
                 "holds 2 checkpoint(s) newer than step 1");
  // Without checkpoints to write there is nothing to overwrite.
  auto bench = run(2, deck_text(path("c")), {"--checkpoint.resume=none", "--checkpoint.every=-1"},
                   path("bench.jsonl"));
  EXPECT_EQ(bench.exit_code, 0) << bench.error;
}

// Case 1: an unreadable (here truncated) newest checkpoint is skipped, and neither the keep
// count nor the checkpoint of the same step overwrites it: it is moved aside, byte for byte.
TEST_F(CheckpointSafety, UnreadableCheckpointIsSkippedAndKept) {
  train("c");
  const fs::path newest = path("c/step_00000003.h5");
  if (test::world_rank() == 0) fs::resize_file(newest, fs::file_size(newest) / 2);
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string damaged = read_bytes(newest);
  auto r = run(2, deck_text(path("c")), {"--train.steps=5", "--checkpoint.keep=1"},
               path("r.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_FALSE(r.steps.empty());
  EXPECT_EQ(r.steps.front().step, 3) << "resumed from step 2";
  const std::vector<std::string> want = {"step_00000003.h5.unreadable", "step_00000005.h5"};
  EXPECT_EQ(names(path("c")), want);
  EXPECT_EQ(read_bytes(path("c/step_00000003.h5.unreadable")), damaged);
}

// Only the run's own checkpoints and those it resumed past are pruned; other files stay.
TEST_F(CheckpointSafety, PrunesOnlyWhatTheRunSuperseded) {
  train("c");
  if (test::world_rank() == 0) {
    std::ofstream(path("c/step_00000009.h5")) << "not a checkpoint";  // newer, unreadable
    std::ofstream(path("c/notes.txt")) << "mine";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto r = run(2, deck_text(path("c")), {"--train.steps=5", "--checkpoint.keep=1"},
               path("r.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.error;
  const std::vector<std::string> want = {"notes.txt", "step_00000005.h5", "step_00000009.h5"};
  EXPECT_EQ(names(path("c")), want);
}

// Case 2: a state with infinities (decoupled weight decay of lr x wd = 1e40 at step 2) is never
// written; the run stops with exit 3 and keeps the earlier checkpoint despite keep = 1.
TEST_F(CheckpointSafety, NonFiniteStateIsNeverWrittenAndNothingIsPruned) {
  auto first = run(2, deck_text(path("c")), {"--train.steps=1"}, path("a.jsonl"));
  ASSERT_EQ(first.exit_code, 0) << first.error;
  const auto before = snapshot(path("c"));
  ASSERT_EQ(before.size(), 1u);
  auto r = run(2, deck_text(path("c")),
               {"--train.steps=4", "--checkpoint.keep=1", "--optim.lr=1e10",
                "--optim.weight_decay=1e30", "--optim.warmup_steps=0", "--optim.min_lr=0"},
               path("r.jsonl"));
  EXPECT_EQ(r.exit_code, 3) << r.error;
  EXPECT_EQ(snapshot(path("c")), before);
}

// Case 17: the first step of a run is always logged (the loss at the start), whatever log.every.
TEST_F(CheckpointSafety, FirstStepIsLogged) {
  auto r = run(2, deck_text(path("c")), {"--train.steps=12"}, path("r.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_EQ(r.steps.size(), 3u);
  EXPECT_EQ(r.steps[0].step, 1);
  EXPECT_EQ(r.steps[1].step, 10);
  EXPECT_EQ(r.steps[2].step, 12);
}

}  // namespace
}  // namespace qt
