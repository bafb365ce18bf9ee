// Evaluation during training (issue 19, train/evaluation.h) on the CUDA back ends, two GPUs:
//   - the held-out loss of one GPU equals the CPU reference's (fp32) within bf16 tolerance at
//     every evaluation, and dp 2 with ZeRO-3, tp 2 and pp 2 give one GPU's within the same;
//   - evaluating between steps (a forward and backward with loss scale 0, then a device
//     synchronisation) leaves the training as it was: the losses and gradient norms bit for bit
//     those of the same run without [eval], on one GPU, at ZeRO-3 and in a pipeline.
// Skips unless two GPUs are visible.
#include <cmath>
#include <filesystem>
#include <tuple>

#include "gpu_test.h"
#include "sharded_cases.h"

namespace qt {
namespace {

constexpr int kSteps = 4;

class EvaluationCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = test::shared_temp_dir("cuda-eval");
    // 11 held-out sequences of seq_len 128: no dp share of the step's shape divides them.
    test::write_random_tokens(tmp_ + "/val.h5", 11 * 128 + 1, 256, 7);
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) std::filesystem::remove_all(tmp_);
  }
  // A run of the sharded GPU deck (4 steps), with the held-out loss every 2 steps or none.
  test::RunResult train(const std::string& tag, int ranks, std::vector<std::string> ov, bool eval) {
    ov.insert(ov.end(), {"--train.steps=" + std::to_string(kSteps), "--checkpoint.every=-1",
                         "--log.every=1"});
    if (eval) ov.insert(ov.end(), {"--eval.paths=" + tmp_ + "/val.h5", "--eval.every=2"});
    test::RunResult r = test::run(ranks, test::sharded_deck(tmp_ + "/" + tag), ov, metrics(tag));
    EXPECT_EQ(r.exit_code, 0) << tag << ": " << r.error;
    return r;
  }
  std::string metrics(const std::string& tag) const { return tmp_ + "/" + tag + ".jsonl"; }
  std::vector<double> eval_losses(const std::string& tag) const {
    std::vector<double> out;
    for (const auto& j : test::metrics_lines_of_kind(metrics(tag), "eval"))
      out.push_back(j["eval_loss"].get<double>());
    return out;
  }
  std::string tmp_;
};

TEST_F(EvaluationCuda, HeldOutLossFollowsTheCpuAndIsTheSameOnEveryMesh) {
  QT_REQUIRE_GPUS(2);
  ASSERT_EQ(test::world_size(), 2);
  train("cpu", 1, {"--train.device=cpu"}, true);
  const std::vector<double> cpu = eval_losses("cpu");
  ASSERT_EQ(cpu.size(), 2u) << "at steps 2 and 4";
  for (const auto& [tag, ranks, ov] :
       {std::tuple<std::string, int, std::vector<std::string>>{"one", 1, {}},
        {"dp2_zero3", 2, {"--optim.zero_stage=3"}},
        {"tp2", 2, {"--mesh.tp=2"}},
        {"pp2", 2, {"--mesh.pp=2"}}}) {
    train(tag, ranks, ov, true);
    const std::vector<double> got = eval_losses(tag);
    ASSERT_EQ(got.size(), cpu.size()) << tag;
    double worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << tag;
      worst = std::max(worst, std::abs(got[i] - cpu[i]) / cpu[i]);
    }
    if (test::world_rank() == 0)
      std::printf("%s: held-out loss %.5f (CPU %.5f), worst relative difference %.2e\n",
                  tag.c_str(), got.back(), cpu.back(), worst);
    EXPECT_LT(worst, 1e-2) << tag;
  }
}

TEST_F(EvaluationCuda, LeavesTrainingAsItWas) {
  QT_REQUIRE_GPUS(2);
  ASSERT_EQ(test::world_size(), 2);
  for (const auto& [tag, ranks, ov] :
       {std::tuple<std::string, int, std::vector<std::string>>{"one", 1, {}},
        {"dp2_zero3", 2, {"--optim.zero_stage=3"}},
        {"pp2", 2, {"--mesh.pp=2"}}}) {
    SCOPED_TRACE(tag);
    const test::RunResult plain = train(tag + "_plain", ranks, ov, false);
    const test::RunResult with = train(tag + "_eval", ranks, ov, true);
    EXPECT_EQ(eval_losses(tag + "_eval").size(), 2u);
    ASSERT_EQ(plain.steps.size(), static_cast<std::size_t>(kSteps));
    ASSERT_EQ(with.steps.size(), plain.steps.size());
    for (std::size_t i = 0; i < plain.steps.size(); ++i) {
      EXPECT_EQ(with.steps[i].loss, plain.steps[i].loss) << "step " << i + 1;
      EXPECT_EQ(with.steps[i].grad_norm, plain.steps[i].grad_norm) << "step " << i + 1;
    }
  }
}

}  // namespace
}  // namespace qt
