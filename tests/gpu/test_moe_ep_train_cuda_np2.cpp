// Qwen3-MoE with expert parallelism on two GPUs (cuda_ops_moe_ep.cpp): ep 2 (dp 2, each rank 4 of
// the 8 experts of each sparse layer, its tokens' rows sent to their experts' rank and back) at
// ZeRO 0 to 3, ZeRO-2 and 3 with offload and ZeRO-1 and 3 with recompute reproduces one GPU's
// losses, load-balancing losses and gradient norms for the same global batch and micro-batch,
// within bf16 tolerance (the experts' rows and the gradient sums come in another order); and the
// ep 2 run's step-5 checkpoint (experts as global tensors) resumes on one GPU at ep 1 on the
// uninterrupted run's losses. Skips unless two GPUs are visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "moe_cases.h"
#include "train/training_harness.h"

namespace qt {
namespace {

TEST(MoeTrainCudaEp2, ReproducesOneGpuAndResumesAtEp1) {
  QT_REQUIRE_GPUS(2);
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("moe-cuda-ep2");
  const test::EpRun one = test::train_ep(1, tmp, "one", {});
  ASSERT_EQ(one.moe.size(), static_cast<std::size_t>(test::kEpSteps));
  EXPECT_LT(one.moe.back().loss, one.moe.front().loss);  // it trains
  const std::vector<std::pair<std::string, std::vector<std::string>>> meshes = {
      {"ep2_z0", {"--optim.zero_stage=0"}},
      {"ep2_z1", {"--optim.zero_stage=1"}},
      {"ep2_z2", {"--optim.zero_stage=2"}},
      {"ep2_z2_offload", {"--optim.zero_stage=2", "--optim.offload=cpu"}},
      {"ep2_z1_recompute", {"--optim.zero_stage=1", "--train.recompute=true"}},
      {"ep2_z3", {"--optim.zero_stage=3"}},
      {"ep2_z3_recompute", {"--optim.zero_stage=3", "--train.recompute=true"}},
      {"ep2_z3_offload", {"--optim.zero_stage=3", "--optim.offload=cpu"}},
  };
  for (const auto& [tag, ov] : meshes) {
    std::vector<std::string> o = ov;
    o.push_back("--mesh.ep=2");
    test::expect_close(test::train_ep(2, tmp, tag, o), one, 0, tag);
  }
  // ep 2's checkpoint holds every expert at its global row: it resumes on one GPU (ep 1).
  const std::string from = tmp + "/ep2_z1/step_00000005.h5";
  ASSERT_TRUE(std::filesystem::exists(from)) << from;
  const test::EpRun resumed =
      test::train_ep(1, tmp, "ep1_resumed", {"--checkpoint.resume=" + from});
  ASSERT_EQ(resumed.moe.size(), 5u);
  EXPECT_EQ(resumed.steps.front().step, 6);
  test::expect_close(resumed, one, 5, "ep 2 checkpoint resumed at ep 1");
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

// A capacity factor at ep 2: each rank drops its own micro-batch's overflow before the
// all-to-all (the same micro-batches, hence the same rule, as on one GPU) and receives at most E C
// rows a layer.
TEST(MoeTrainCudaEp2, CapacityFactorReproducesOneGpu) {
  QT_REQUIRE_GPUS(2);
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("moe-cuda-ep2-capacity");
  const std::string cf = "--model.moe_capacity_factor=1";
  const test::EpRun one = test::train_ep(1, tmp, "one", {cf});
  ASSERT_EQ(one.moe.size(), static_cast<std::size_t>(test::kEpSteps));
  for (const char* zero : {"1", "3"}) {
    const std::string tag = std::string("ep2_z") + zero;
    const test::EpRun ep = test::train_ep(
        2, tmp, tag, {cf, "--mesh.ep=2", std::string("--optim.zero_stage=") + zero});
    test::expect_close(ep, one, 0, tag + " with capacity factor 1");
    ASSERT_EQ(ep.moe.size(), one.moe.size());
    double worst = 0, sum = 0;
    for (std::size_t i = 0; i < ep.moe.size(); ++i) {
      ASSERT_GE(ep.moe[i].dropped_fraction, 0) << tag << " logs no dropped_fraction";
      worst = std::max(worst, std::abs(ep.moe[i].dropped_fraction - one.moe[i].dropped_fraction));
      sum += one.moe[i].dropped_fraction;
    }
    std::printf("%s: dropped share within %.4f of one GPU's (mean %.4f)\n", tag.c_str(), worst,
                sum / one.moe.size());
    EXPECT_GT(sum / one.moe.size(), 0.02) << "the capacity should drop token-slots here";
    EXPECT_LT(worst, 0.02);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

// Auxiliary-loss-free balancing at ep 2: every rank routes its own tokens with the same bias,
// updated from the load summed over dp, so ep 2 (dp 2) follows one GPU's run with the bias.
TEST(MoeTrainCudaEp2, RouterBiasReproducesOneGpu) {
  QT_REQUIRE_GPUS(2);
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("moe-cuda-ep2-bias");
  const std::string rate = "--model.router_bias_update_rate=1e-3";
  const test::EpRun one = test::train_ep(1, tmp, "one", {rate});
  ASSERT_EQ(one.moe.size(), static_cast<std::size_t>(test::kEpSteps));
  test::expect_close(test::train_ep(2, tmp, "ep2_z1", {rate, "--mesh.ep=2", "--optim.zero_stage=1"}),
                     one, 0, "ep2_z1 with the router bias");
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
