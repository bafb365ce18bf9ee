// Qwen3-MoE with data parallelism on two GPUs: dp = 2 at every ZeRO stage (the experts are
// ordinary parameters of the flat layout, sharded and reduced like the rest) reproduces one GPU's
// losses and load-balancing losses for the same global batch and micro-batch (the aux loss pools
// a micro-batch's tokens, so train.micro_batch stays 2). Skips unless two GPUs are visible.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "moe_cases.h"
#include "train/training_harness.h"

namespace qt {
namespace {

constexpr int kSteps = 10;

TEST(MoeTrainCudaDp2, ReproducesOneGpuAtEveryZeroStage) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("moe-cuda-dp2");
  auto one = test::run(1, test::moe_deck(tmp + "/one", kSteps), {}, tmp + "/one.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.error;
  const auto ref = test::read_moe_metrics(tmp + "/one.jsonl");
  ASSERT_EQ(ref.size(), static_cast<std::size_t>(kSteps));
  for (int zero = 0; zero <= 3; ++zero) {
    const std::string tag = "z" + std::to_string(zero);
    auto two =
        test::run(2, test::moe_deck(tmp + "/" + tag, kSteps),
                  {"--optim.zero_stage=" + std::to_string(zero)}, tmp + "/" + tag + ".jsonl");
    ASSERT_EQ(two.exit_code, 0) << tag << ": " << two.error;
    const auto got = test::read_moe_metrics(tmp + "/" + tag + ".jsonl");
    ASSERT_EQ(got.size(), ref.size()) << tag;
    double worst = 0, worst_aux = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i].loss) && got[i].aux > 0) << tag << " step " << i + 1;
      worst = std::max(worst, std::abs(got[i].loss - ref[i].loss) / ref[i].loss);
      worst_aux = std::max(worst_aux, std::abs(got[i].aux - ref[i].aux) / ref[i].aux);
    }
    if (test::world_rank() == 0)
      std::printf("dp 2 ZeRO-%d vs 1 GPU: worst relative loss difference %.3e, aux %.3e\n", zero,
                  worst, worst_aux);
    EXPECT_LT(worst, 5e-3) << tag;
    EXPECT_LT(worst_aux, 1e-2) << tag;
  }
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
