// LoRA data parallelism on two GPUs: dp = 2 (ZeRO-0 and ZeRO-1; the adapter gradients all-reduced
// over NCCL after the backward, fp32 or bf16 on the wire) reproduces one GPU's losses for the same
// global batch, dropout included (its masks depend on the data order, not the mesh). Skips unless
// two GPUs are visible.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "gpu_test.h"
#include "train/training_harness.h"

namespace qt {
namespace {

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\nvocab_size = 256\nhidden_size = 128\nintermediate_size = 256\n"
         "num_heads = 4\nnum_kv_heads = 2\nhead_dim = 64\n"
         "[train]\nseq_len = 128\nmicro_batch = 2\nglobal_batch = 8\nsteps = 16\nseed = 9\n"
         "device = cuda\n"
         "[optim]\nlr = 1e-2\nmin_lr = 1e-3\nwarmup_steps = 3\nweight_decay = 0.01\n"
         "[lora]\nr = 8\nalpha = 16\ndropout = 0.1\ntargets = all-linear\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = -1\nresume = none\n"
         "[log]\nevery = 1\n";
}

TEST(LoraTrainCudaDp2, ReproducesOneGpu) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-lora-dp2");
  auto one = test::run(1, deck_text(tmp + "/a"), {}, tmp + "/one.jsonl");
  auto two = test::run(2, deck_text(tmp + "/b"), {}, tmp + "/two.jsonl");
  auto z1 = test::run(2, deck_text(tmp + "/c"), {"--optim.zero_stage=1"}, tmp + "/z1.jsonl");
  auto bf16 = test::run(2, deck_text(tmp + "/d"), {"--optim.grad_reduce=bf16"}, tmp + "/bf16.jsonl");
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

}  // namespace
}  // namespace qt
