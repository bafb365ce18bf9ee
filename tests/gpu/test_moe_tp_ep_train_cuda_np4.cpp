// Qwen3-MoE with tensor and expert parallelism together on four GPUs: tp 2 x dp 2 with ep 2
// (each rank 4 of the 8 experts of each sparse layer, each its tp half of their width; the rows
// exchanged within the ep group of its tp rank, the block's output summed over tp) at ZeRO 1 and
// 3, with sequence parallelism, and with recompute, reproduces one GPU's losses, load-balancing
// losses and gradient norms within bf16 tolerance; the tp 2 x ep 2 run's step-5 checkpoint
// (TpEpMap: every expert's columns at their global place) resumes on one GPU. Skips unless four
// GPUs are visible.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test.h"
#include "moe_cases.h"
#include "train/training_harness.h"

namespace qt {
namespace {

TEST(MoeTrainCudaTpEp, Tp2Ep2ReproducesOneGpuAndResumesOnOne) {
  QT_REQUIRE_GPUS(4);
  ASSERT_EQ(test::world_size(), 4);
  const std::string tmp = test::shared_temp_dir("moe-cuda-tp2-ep2");
  const test::EpRun one = test::train_ep(1, tmp, "one", {});
  ASSERT_EQ(one.moe.size(), static_cast<std::size_t>(test::kEpSteps));
  const std::vector<std::pair<std::string, std::vector<std::string>>> meshes = {
      {"tp2_ep2_z1", {"--optim.zero_stage=1"}},
      {"tp2_ep2_z3", {"--optim.zero_stage=3"}},
      {"tp2_ep2_sp_z1", {"--optim.zero_stage=1", "--mesh.sequence_parallel=true"}},
      {"tp2_ep2_sp_z3_recompute",
       {"--optim.zero_stage=3", "--mesh.sequence_parallel=true", "--train.recompute=true"}},
  };
  test::EpRun z1;  // the run the checkpoint below continues
  for (const auto& [tag, ov] : meshes) {
    std::vector<std::string> o = ov;
    o.push_back("--mesh.tp=2");
    o.push_back("--mesh.ep=2");
    test::EpRun run = test::train_ep(4, tmp, tag, o);
    test::expect_close(run, one, 0, tag, test::kTpNormTol, test::kTpSteps);
    if (tag == "tp2_ep2_z1") z1 = run;
  }
  const std::string from = tmp + "/tp2_ep2_z1/step_00000005.h5";
  ASSERT_TRUE(std::filesystem::exists(from)) << from;
  const test::EpRun resumed =
      test::train_ep(1, tmp, "one_resumed", {"--checkpoint.resume=" + from});
  ASSERT_EQ(resumed.moe.size(), 5u);
  EXPECT_EQ(resumed.steps.front().step, 6);
  test::expect_close(resumed, z1, 5, "tp 2 x ep 2 checkpoint resumed on one GPU (vs that run)",
                     test::kTpNormTol);
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
