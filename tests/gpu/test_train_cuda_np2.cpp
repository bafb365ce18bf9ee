// Data parallelism on two GPUs: dp = 2 (ZeRO-0 and ZeRO-1, gradients reduced over NCCL)
// reproduces one GPU's losses for the same global batch. Skips unless two GPUs are visible.
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
         "[train]\nseq_len = 128\nmicro_batch = 2\nglobal_batch = 8\nsteps = 20\nseed = 5\n"
         "device = cuda\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 5\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = -1\nresume = none\n"
         "[log]\nevery = 1\n";
}

TEST(TrainCudaDp2, ReproducesOneGpu) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-dp2");
  auto one = test::run(1, deck_text(tmp + "/a"), {}, tmp + "/one.jsonl");
  auto two = test::run(2, deck_text(tmp + "/b"), {}, tmp + "/two.jsonl");
  auto z1 = test::run(2, deck_text(tmp + "/c"), {"--optim.zero_stage=1"}, tmp + "/z1.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.error;
  ASSERT_EQ(two.exit_code, 0) << two.error;
  ASSERT_EQ(z1.exit_code, 0) << z1.error;
  ASSERT_EQ(one.steps.size(), 20u);
  ASSERT_EQ(two.steps.size(), 20u);
  ASSERT_EQ(z1.steps.size(), 20u);
  double worst = 0, worst_z1 = 0;
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(std::isfinite(two.steps[i].loss));
    worst = std::max(worst, std::abs(two.steps[i].loss - one.steps[i].loss) / one.steps[i].loss);
    worst_z1 = std::max(worst_z1, std::abs(z1.steps[i].loss - one.steps[i].loss) / one.steps[i].loss);
  }
  if (test::world_rank() == 0)
    std::printf("dp 2 vs 1 GPU: worst relative loss difference %.3e (ZeRO-0), %.3e (ZeRO-1)\n",
                worst, worst_z1);
  EXPECT_LT(worst, 5e-3);
  EXPECT_LT(worst_z1, 5e-3);

  // Small buckets (dozens per backward, crossing the ZeRO-1 shard boundary): with two ranks each
  // sum has two terms, so the bucketing cannot change a bit.
  auto small = test::run(2, deck_text(tmp + "/d"),
                         {"--optim.zero_stage=1", "--optim.reduce_bucket_mb=0.05"},
                         tmp + "/small.jsonl");
  ASSERT_EQ(small.exit_code, 0) << small.error;
  ASSERT_EQ(small.steps.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(small.steps[i].loss, z1.steps[i].loss) << "step " << i + 1;
  // bf16 on the wire: close to the fp32 reduction, not equal.
  auto bf16 = test::run(2, deck_text(tmp + "/e"),
                        {"--optim.grad_reduce=bf16", "--optim.reduce_bucket_mb=0.05"},
                        tmp + "/bf16.jsonl");
  ASSERT_EQ(bf16.exit_code, 0) << bf16.error;
  ASSERT_EQ(bf16.steps.size(), 20u);
  double worst_bf16 = 0;
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(std::isfinite(bf16.steps[i].loss));
    worst_bf16 =
        std::max(worst_bf16, std::abs(bf16.steps[i].loss - two.steps[i].loss) / two.steps[i].loss);
  }
  if (test::world_rank() == 0)
    std::printf("bf16 gradient reduction vs fp32: worst relative loss difference %.3e\n",
                worst_bf16);
  EXPECT_LT(worst_bf16, 1e-2);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
