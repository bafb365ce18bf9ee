// The sharded state (issue 16) on the CPU reference, whole trainings under mpiexec -n 4: every
// ZeRO stage on every dp size reproduces the serial run's losses, gradient norms and final
// parameters; a checkpoint written at (dp 2, ZeRO-3) resumes at (1, 0) and (4, 2) on the
// uninterrupted serial run's losses.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <vector>

#include "qtrain/checkpoint.h"
#include "qtrain/params.h"
#include "training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;
using test::run;
using test::RunResult;
using test::StepRecord;

constexpr double kTol = 1e-5;  // fp32 sums in another order, over 10 steps

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\n"
         "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 8\nsteps = 10\nseed = 7\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 3\ngrad_clip = 1.0\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = 5\nkeep = 4\nresume = none\n"
         "[log]\nevery = 1\n";
}

// Largest relative difference of losses and of gradient norms at the steps both runs logged
// from `from`; infinity when a value is not finite or no step is shared.
double max_rel(const std::vector<StepRecord>& a, const std::vector<StepRecord>& b, long from = 1) {
  double worst = -1;
  for (const auto& x : a)
    for (const auto& y : b) {
      if (x.step != y.step || x.step < from) continue;
      if (!std::isfinite(x.loss) || !std::isfinite(x.grad_norm)) return INFINITY;
      worst = std::max({worst, std::abs(x.loss - y.loss) / std::abs(y.loss),
                        std::abs(x.grad_norm - y.grad_norm) / std::abs(y.grad_norm)});
    }
  return worst < 0 ? INFINITY : worst;
}

// The parameters of a checkpoint, whole, on every world rank.
std::vector<float> read_params(const std::string& path, bool tied) {
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  MeshShape shape;
  shape.dp = world->size();
  Mesh mesh(shape, world);
  ModelConfig m = *model_preset("tiny");
  m.tie_word_embeddings = tied;
  const ParamLayout layout(m);
  std::vector<float> params(layout.numel());
  checkpoint_read(path, mesh, layout, StateTargets{{{Range{0, layout.numel()}, params.data()}}, {}, {}}, m);
  return params;
}

// ||a - b|| / ||b|| over the whole model.
double rel_norm_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || b.empty()) return INFINITY;
  double d = 0, n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

class ZeroStages : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(test::world_size(), 4) << "run under mpiexec -n 4";
    tmp_ = test::shared_temp_dir("zero");
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(tmp_);
  }
  std::string path(const std::string& name) const { return tmp_ + "/" + name; }
  // A run of 10 steps at dp `ranks` with `overrides`, in its own directory `name`.
  RunResult train(const std::string& name, int ranks, std::vector<std::string> overrides) {
    RunResult r = run(ranks, deck_text(path(name)), overrides, path(name + ".jsonl"));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.error;
    return r;
  }
  std::string tmp_;
};

TEST_F(ZeroStages, EveryStageAndDpSizeReproducesTheSerialRun) {
  const RunResult serial = train("serial", 1, {"--optim.zero_stage=0"});
  ASSERT_EQ(serial.steps.size(), 10u);
  EXPECT_LT(serial.steps.back().loss, serial.steps.front().loss);  // it trains
  const std::vector<float> want = read_params(path("serial/step_00000010.h5"), true);
  struct Case {
    const char* name;
    int dp;
    std::vector<std::string> overrides;
  };
  const std::vector<Case> cases = {
      {"dp2_z1", 2, {"--optim.zero_stage=1"}},
      {"dp2_z2", 2, {"--optim.zero_stage=2"}},
      {"dp2_z3", 2, {"--optim.zero_stage=3"}},
      {"dp4_z3", 4, {"--optim.zero_stage=3"}},
      {"dp4_z2", 4, {"--optim.zero_stage=2"}},
      {"dp2_z3_offload", 2, {"--optim.zero_stage=3", "--optim.offload=cpu"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const RunResult r = train(c.name, c.dp, c.overrides);
    ASSERT_EQ(r.steps.size(), 10u);
    EXPECT_LT(max_rel(r.steps, serial.steps), kTol);
    const std::vector<float> got = read_params(path(std::string(c.name) + "/step_00000010.h5"), true);
    EXPECT_LT(rel_norm_diff(got, want), kTol);
  }
  // dp 3 leaves a remainder in every unit's shards: it must match its own serial run.
  const RunResult serial6 = train("serial6", 1, {"--train.global_batch=6"});
  const RunResult dp3 = train("dp3_z3", 3, {"--optim.zero_stage=3", "--train.global_batch=6"});
  ASSERT_EQ(dp3.steps.size(), 10u);
  EXPECT_LT(max_rel(dp3.steps, serial6.steps), kTol);
}

TEST_F(ZeroStages, UntiedEmbeddingsShardAlike) {
  const std::vector<std::string> untied = {"--model.tie_word_embeddings=false"};
  std::vector<std::string> z3 = untied;
  z3.push_back("--optim.zero_stage=3");
  const RunResult serial = train("serial", 1, untied);
  const RunResult sharded = train("dp4_z3", 4, z3);
  ASSERT_EQ(sharded.steps.size(), 10u);
  EXPECT_LT(max_rel(sharded.steps, serial.steps), kTol);
  EXPECT_LT(rel_norm_diff(read_params(path("dp4_z3/step_00000010.h5"), false),
                          read_params(path("serial/step_00000010.h5"), false)),
            kTol);
}

TEST_F(ZeroStages, CheckpointOfZero3ResumesAtOtherMeshesAndStages) {
  const RunResult serial = train("serial", 1, {});
  const RunResult first =
      train("z3", 2, {"--optim.zero_stage=3", "--train.stop_at=5"});
  ASSERT_EQ(first.steps.size(), 5u);
  const std::string ckpt = path("z3/step_00000005.h5");
  ASSERT_TRUE(fs::exists(ckpt));
  const RunResult at1 = train("to1", 1, {"--checkpoint.resume=" + ckpt, "--optim.zero_stage=0"});
  const RunResult at4 = train("to4", 4, {"--checkpoint.resume=" + ckpt, "--optim.zero_stage=2"});
  const RunResult at2 = train("to2", 2, {"--checkpoint.resume=" + ckpt, "--optim.zero_stage=3"});
  for (const RunResult* r : {&at1, &at4, &at2}) {
    ASSERT_EQ(r->steps.size(), 5u);
    EXPECT_EQ(r->steps.front().step, 6);
    EXPECT_LT(max_rel(r->steps, serial.steps, 6), kTol);
  }
}

}  // namespace
}  // namespace qt
