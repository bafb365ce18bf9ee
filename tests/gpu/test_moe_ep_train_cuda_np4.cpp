// Qwen3-MoE with expert parallelism on four GPUs (cuda_ops_moe_ep.cpp): dp 4 with ep 2 (two
// expert-dp groups of two: each expert unit sharded and reduced over its edp pair, the rest over
// dp 4) at ZeRO 1, 2 and 3 (its gather ring over both groups), and dp 4 with ep 4 (each rank 2
// of the 8 experts, edp 1), reproduce one GPU's losses, load-balancing losses and gradient norms
// within bf16 tolerance; the dp 4 x ep 2 run's step-5 checkpoint resumes at dp 2 x ep 2. Skips
// unless four GPUs are visible.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "moe_cases.h"
#include "train/training_harness.h"

namespace qt {
namespace {

TEST(MoeTrainCudaEp4, ExpertDataParallelGroupsReproduceOneGpu) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 4) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 4 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 4);
  const std::string tmp = test::shared_temp_dir("moe-cuda-ep4");
  const test::EpRun one = test::train_ep(1, tmp, "one", {});
  ASSERT_EQ(one.moe.size(), static_cast<std::size_t>(test::kEpSteps));
  const std::vector<std::pair<std::string, std::vector<std::string>>> meshes = {
      {"dp4_ep2_z1", {"--mesh.ep=2", "--optim.zero_stage=1"}},
      {"dp4_ep2_z2", {"--mesh.ep=2", "--optim.zero_stage=2"}},
      {"dp4_ep2_z3", {"--mesh.ep=2", "--optim.zero_stage=3"}},
      {"dp4_ep4_z1", {"--mesh.ep=4", "--optim.zero_stage=1"}},
  };
  for (const auto& [tag, ov] : meshes)
    test::expect_close(test::train_ep(4, tmp, tag, ov), one, 0, tag);
  const std::string from = tmp + "/dp4_ep2_z1/step_00000005.h5";
  ASSERT_TRUE(std::filesystem::exists(from)) << from;
  const test::EpRun resumed =
      test::train_ep(2, tmp, "dp2_ep2_resumed", {"--mesh.ep=2", "--checkpoint.resume=" + from});
  ASSERT_EQ(resumed.moe.size(), 5u);
  EXPECT_EQ(resumed.steps.front().step, 6);
  test::expect_close(resumed, one, 5, "dp 4 x ep 2 checkpoint resumed at dp 2 x ep 2");
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
