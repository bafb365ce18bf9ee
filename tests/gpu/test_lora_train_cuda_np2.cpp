// LoRA data parallelism on two GPUs: dp = 2 (ZeRO-0 and ZeRO-1; the adapter gradients all-reduced
// over NCCL after the backward, fp32 or bf16 on the wire) reproduces one GPU's losses for the same
// global batch, dropout included (its masks depend on the data order, not the mesh). LoRA under
// tensor parallelism: tp = 2, with and without sequence parallelism (the base and the adapters
// split as on the CPU, the whole factors' gradients summed over tp, a row-parallel input's
// dropout masks the serial run's columns) reproduces one GPU's losses and first gradient norms,
// and its checkpoint (global PEFT tensors) continues on one GPU as the one-GPU run does. Skips
// unless two GPUs are visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "lora_cases.h"
#include "train/training_harness.h"

namespace qt {
namespace {

TEST(LoraTrainCudaDp2, ReproducesOneGpu) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-lora-dp2");
  auto one = test::run(1, test::lora_deck(tmp + "/a"), {}, tmp + "/one.jsonl");
  auto two = test::run(2, test::lora_deck(tmp + "/b"), {}, tmp + "/two.jsonl");
  auto z1 = test::run(2, test::lora_deck(tmp + "/c"), {"--optim.zero_stage=1"}, tmp + "/z1.jsonl");
  auto bf16 = test::run(2, test::lora_deck(tmp + "/d"), {"--optim.grad_reduce=bf16"}, tmp + "/bf16.jsonl");
  for (const auto* r : {&one, &two, &z1, &bf16}) {
    ASSERT_EQ(r->exit_code, 0) << r->error;
    ASSERT_EQ(r->steps.size(), 16u);
  }
  const double w2 = test::max_rel_loss_diff(two.steps, one.steps);
  const double wz1 = test::max_rel_loss_diff(z1.steps, one.steps);
  const double wbf = test::max_rel_loss_diff(bf16.steps, two.steps);
  if (test::world_rank() == 0)
    std::printf("LoRA dp 2 vs 1 GPU: worst relative loss difference %.3e (ZeRO-0), %.3e (ZeRO-1); "
                "bf16 reduction vs fp32 %.3e\n", w2, wz1, wbf);
  EXPECT_LT(w2, 5e-3);
  EXPECT_LT(wz1, 5e-3);
  EXPECT_LT(wbf, 1e-2);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

TEST(LoraTrainCudaTp2, ReproducesOneGpu) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-lora-tp2");
  // The reference and the tp runs write a checkpoint at step 8 (and 16).
  const std::string every8 = "--checkpoint.every=8";
  auto one = test::run(1, test::lora_deck(tmp + "/one"), {every8}, tmp + "/one.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.error;
  ASSERT_EQ(one.steps.size(), 16u);
  struct Case {
    const char* name;
    std::vector<std::string> overrides;
  };
  for (const Case& c : {Case{"tp2", {"--mesh.tp=2", every8}},
                        // norms and residual adds on each rank's half of the rows
                        Case{"tp2_sp", {"--mesh.tp=2", "--mesh.sequence_parallel=true", every8}},
                        Case{"tp2_recompute", {"--mesh.tp=2", "--train.recompute=true"}}}) {
    SCOPED_TRACE(c.name);
    const auto r = test::run(2, test::lora_deck(tmp + "/" + c.name), c.overrides,
                             tmp + "/" + c.name + ".jsonl");
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 16u);
    const test::LoraDiffs d = test::lora_diffs(r, one);
    if (test::world_rank() == 0)
      std::printf("LoRA %s vs 1 GPU: worst relative loss difference %.3e, gradient norm (steps "
                  "1-3) %.3e\n", c.name, d.loss, d.norm);
    EXPECT_LT(d.loss, 5e-3);
    EXPECT_LT(d.norm, 2e-2);
  }
  // Checkpoints hold the global adapters: one GPU continues tp 2's from step 9 as its own run
  // goes on, and tp 2 continues one GPU's.
  struct Resume {
    const char* name;
    const char* from;  // the run whose step 8 is resumed
    int ranks;
    std::vector<std::string> overrides;
  };
  for (const Resume& c : {Resume{"tp2_to_one", "tp2", 1, {}},
                          Resume{"tp2_sp_to_one", "tp2_sp", 1, {}},
                          Resume{"one_to_tp2", "one", 2, {"--mesh.tp=2"}}}) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> ov = c.overrides;
    ov.push_back("--checkpoint.resume=" + tmp + "/" + c.from + "/step_00000008.h5");
    const auto r = test::run(c.ranks, test::lora_deck(tmp + "/" + c.name), ov,
                             tmp + "/" + c.name + ".jsonl");
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 8u);
    EXPECT_EQ(r.steps.front().step, 9);
    const test::LoraDiffs d = test::lora_diffs(r, one, 9);
    if (test::world_rank() == 0)
      std::printf("LoRA %s (step 8 resumed): worst relative loss difference %.3e\n", c.name,
                  d.loss);
    EXPECT_LT(d.loss, 5e-3);
  }
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

// One kv head shared by both tp ranks: its base rows and the k/v adapters' B factors on both,
// their gradients summed over the pair.
TEST(LoraTrainCudaTp2, SharedKvHeadReproducesOneGpu) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-lora-tp2-kv1");
  const std::string kv1 = "--model.num_kv_heads=1";
  auto one = test::run(1, test::lora_deck(tmp + "/one"), {kv1}, tmp + "/one.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.error;
  const auto r = test::run(2, test::lora_deck(tmp + "/tp2"), {kv1, "--mesh.tp=2"}, tmp + "/tp2.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_EQ(r.steps.size(), 16u);
  const test::LoraDiffs d = test::lora_diffs(r, one);
  if (test::world_rank() == 0)
    std::printf("LoRA tp2, one shared kv head, vs 1 GPU: worst relative loss difference %.3e, "
                "gradient norm (steps 1-3) %.3e\n", d.loss, d.norm);
  EXPECT_LT(d.loss, 5e-3);
  EXPECT_LT(d.norm, 2e-2);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
