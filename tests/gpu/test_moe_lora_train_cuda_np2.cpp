// LoRA on a Qwen3-MoE model on two GPUs (issue 18): moe_cases.h's model with rank-8 adapters on
// the attention projections (dropout on: every mesh draws the masks of the micro-batch's first
// sequence), the routers and experts frozen, at pp 2 (backend_cuda_pipeline.cpp: each stage's
// frozen units and its layers' adapters; 1F1B at ZeRO 0 and 1, ZB-H1 with its empty weight
// halves, recompute) and at dp 2 with ep 2 (backend_cuda_lora.cpp: each rank's 4 of the 8
// frozen experts, the rows exchanged both ways, no expert gradients) against one GPU's LoRA run:
// the losses over all ten steps, the load-balancing losses and the adapters' gradient norms over
// the first kTpSteps (moe_cases.h: bf16 rounding in another order flips near-tied routes, and
// the noisy adapter gradients follow). The pp 2 run's step-5 checkpoint (the adapters and their
// moments) resumes on one GPU and continues the pp run. Skips unless two GPUs are visible.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test.h"
#include "moe_cases.h"
#include "train/training_harness.h"

namespace qt {
namespace {

using test::with;

// The MoE deck with attention adapters (moe_cases.h train_lora).
test::EpRun train_lora(int ranks, const std::string& tmp, const std::string& tag,
                       std::vector<std::string> ov) {
  return test::train_lora(ranks, tmp, tag,
                          "r = 8\nalpha = 16\ndropout = 0.1\ntargets = q_proj, k_proj, v_proj, "
                          "o_proj\n",
                          std::move(ov));
}

TEST(MoeLoraTrainCuda2, PipelineAndExpertParallelReproduceOneGpu) {
  QT_REQUIRE_GPUS(2);
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("moe-lora-cuda2");
  std::printf("deck seed 5 (fixed: the data, the base and the adapters' initialisation)\n");
  const test::EpRun one = train_lora(1, tmp, "one", {"--optim.zero_stage=0"});
  ASSERT_EQ(one.moe.size(), static_cast<std::size_t>(test::kEpSteps));
  EXPECT_LT(one.moe.back().loss, one.moe.front().loss);  // it trains
  const std::vector<std::string> pp = {"--mesh.pp=2"};
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"lora_pp2_z0", with(pp, {"--optim.zero_stage=0"})},
      {"lora_pp2_z1", with(pp, {"--optim.zero_stage=1"})},
      {"lora_pp2_zb", with(pp, {"--optim.zero_stage=1", "--mesh.pp_schedule=zb-h1"})},
      {"lora_pp2_recompute", with(pp, {"--optim.zero_stage=1", "--train.recompute=true"})},
      {"lora_dp2_ep2_z1", {"--mesh.ep=2", "--optim.zero_stage=1"}},
      {"lora_dp2_ep2_z0_recompute",
       {"--mesh.ep=2", "--optim.zero_stage=0", "--train.recompute=true"}},
  };
  test::EpRun pp2;
  for (const auto& [tag, ov] : cases) {
    const test::EpRun run = train_lora(2, tmp, tag, ov);
    test::expect_close(run, one, 0, tag, test::kNormTol, test::kTpSteps);
    ASSERT_FALSE(run.moe.empty()) << tag;
    ASSERT_EQ(run.moe.back().tokens.size(), 2u) << tag;  // both sparse layers' load
    if (tag == "lora_pp2_z1") pp2 = run;
  }

  // pp 2's checkpoint holds the global adapters: one GPU resumes it and continues the pp run.
  const std::string from = tmp + "/lora_pp2_z1/step_00000005.h5";
  ASSERT_TRUE(std::filesystem::exists(from)) << from;
  const test::EpRun resumed = train_lora(1, tmp, "lora_pp1_resumed",
                                         {"--checkpoint.resume=" + from});
  ASSERT_EQ(resumed.moe.size(), 5u);
  EXPECT_EQ(resumed.steps.front().step, 6);
  test::expect_close(resumed, pp2, 5, "LoRA pp 2 checkpoint resumed on one GPU (vs the pp 2 run)",
                     test::kNormTol, test::kTpSteps);
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
