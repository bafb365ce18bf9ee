// Qwen3-MoE with expert parallelism inside a pipeline on four GPUs (backend_cuda_pipeline.cpp
// with cuda_ops_moe_ep.cpp; issue 18): pp 2 x dp 2 with ep 2 (each stage's sparse layers' 8
// experts split 4 and 4 over the stage's two dp ranks, their units over edp 1; two micro-batches
// a step a dp rank, so stage 0 holds both in flight, each with its own exchange counts and maps
// kept for its backward) in 1F1B at ZeRO 0 and 1, ZB-H1 and with recompute, against one GPU's
// run: the losses over all ten steps, the load-balancing losses and gradient norms over the
// first kTpSteps (moe_cases.h: rows summed in another order round differently in bf16 and flip
// near-tied routes, as under tp). Both stages' sparse layers' load is counted once. The 1F1B
// ZeRO-1 run's step-5 checkpoint (each stage's ep rank's experts at their global places)
// resumes on one GPU and continues that run. Interleaved (two chunks a stage, four layers)
// follows one GPU's four-layer run. LoRA (attention adapters, the experts frozen; and with
// adapters on every expert) at pp 2 x dp 2 with ep 2 follows one GPU's LoRA run. Skips unless four GPUs are visible.
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

using test::with;

double slots(const std::vector<double>& layer) {
  double n = 0;
  for (double t : layer) n += t;
  return n;
}

TEST(MoeTrainCudaEpPp4, ExpertParallelStagesReproduceOneGpuAndResumeOnOne) {
  QT_REQUIRE_GPUS(4);
  ASSERT_EQ(test::world_size(), 4);
  const std::string tmp = test::shared_temp_dir("moe-cuda-ep-pp4");
  const test::EpRun one = test::train_ep(1, tmp, "one", {});
  ASSERT_EQ(one.moe.size(), static_cast<std::size_t>(test::kEpSteps));
  const std::vector<std::string> mesh = {"--mesh.pp=2", "--mesh.ep=2"};
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"pp2_dp2_ep2_z0", with(mesh, {"--optim.zero_stage=0"})},
      {"pp2_dp2_ep2_z1", with(mesh, {"--optim.zero_stage=1"})},
      {"pp2_dp2_ep2_zb", with(mesh, {"--optim.zero_stage=1", "--mesh.pp_schedule=zb-h1"})},
      {"pp2_dp2_ep2_recompute", with(mesh, {"--optim.zero_stage=1", "--train.recompute=true"})},
  };
  test::EpRun z1;
  for (const auto& [tag, ov] : cases) {
    const test::EpRun run = test::train_ep(4, tmp, tag, ov);
    test::expect_close(run, one, 0, tag, test::kNormTol, test::kTpSteps);
    // Every (token, slot) pair of the step's 8 x 64 tokens, k = 2, in each sparse layer, once.
    ASSERT_EQ(run.moe.size(), one.moe.size()) << tag;
    ASSERT_EQ(run.moe.back().tokens.size(), 2u) << tag;
    for (const std::vector<double>& layer : run.moe.back().tokens)
      EXPECT_EQ(slots(layer), 1024) << tag;
    if (tag == "pp2_dp2_ep2_z1") z1 = run;
  }
  const std::string from = tmp + "/pp2_dp2_ep2_z1/step_00000005.h5";
  ASSERT_TRUE(std::filesystem::exists(from)) << from;
  const test::EpRun resumed =
      test::train_ep(1, tmp, "resumed_on_one", {"--checkpoint.resume=" + from});
  ASSERT_EQ(resumed.moe.size(), 5u);
  EXPECT_EQ(resumed.steps.front().step, 6);
  test::expect_close(resumed, z1, 5, "pp 2 x dp 2 x ep 2 checkpoint resumed on one GPU",
                     test::kNormTol, test::kTpSteps);

  // Interleaved 1F1B (four layers, two chunks a stage): a stage's two chunks keep their slots'
  // exchange counts apart (slot k of each chunk is a different micro-batch).
  const std::vector<std::string> four = {"--model.num_layers=4"};
  const test::EpRun one4 = test::train_ep(1, tmp, "one4", four);
  test::expect_close(test::train_ep(4, tmp, "pp2_dp2_ep2_v2",
                                    with(with(mesh, four), {"--mesh.pp_chunks=2"})),
                     one4, 0, "pp2_dp2_ep2_v2 (four layers)", test::kNormTol, test::kTpSteps);

  // LoRA: the same mesh against one GPU's LoRA run.
  const std::vector<std::string> lora = {"--lora.r=8", "--lora.alpha=16",
                                         "--lora.targets=q_proj,k_proj,v_proj,o_proj",
                                         "--optim.lr=1e-2", "--optim.min_lr=1e-3"};
  const test::EpRun one_lora = test::train_ep(1, tmp, "one_lora", lora);
  test::expect_close(test::train_ep(4, tmp, "lora_pp2_dp2_ep2", with(mesh, lora)), one_lora, 0,
                     "LoRA pp2_dp2_ep2", test::kNormTol, test::kTpSteps);
  // And with adapters on every expert (each ep rank runs its experts' rows of them).
  const std::vector<std::string> experts = {
      "--lora.r=8", "--lora.alpha=16",
      "--lora.targets=q_proj,v_proj,experts.gate_up_proj,experts.down_proj", "--optim.lr=1e-2",
      "--optim.min_lr=1e-3"};
  const test::EpRun one_experts = test::train_ep(1, tmp, "one_expert_lora", experts);
  test::expect_close(test::train_ep(4, tmp, "expert_lora_pp2_dp2_ep2", with(mesh, experts)),
                     one_experts, 0, "expert LoRA pp2_dp2_ep2", test::kNormTol, test::kTpSteps);
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
