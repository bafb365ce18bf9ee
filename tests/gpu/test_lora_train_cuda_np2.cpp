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

// The largest relative difference of the losses (from step `from` on) and of the gradient norms
// (steps 1 to 3: later the adapters of two meshes drift apart by bf16 rounding, and the noisy
// gradient follows) over the steps both runs logged; infinity when none is shared or a value is
// not finite.
struct Diffs {
  double loss = -1, norm = -1;
};
Diffs diffs(const test::RunResult& got, const test::RunResult& ref, long from = 1) {
  Diffs d;
  for (const auto& x : got.steps)
    for (const auto& y : ref.steps) {
      if (x.step != y.step || x.step < from) continue;
      if (!std::isfinite(x.loss) || !std::isfinite(x.grad_norm)) return {INFINITY, INFINITY};
      d.loss = std::max(d.loss, std::abs(x.loss - y.loss) / y.loss);
      if (x.step <= 3) d.norm = std::max(d.norm, std::abs(x.grad_norm - y.grad_norm) / y.grad_norm);
    }
  if (d.loss < 0) d.loss = INFINITY;
  if (d.norm < 0 && from <= 3) d.norm = INFINITY;
  return d;
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
  auto one = test::run(1, deck_text(tmp + "/one"), {every8}, tmp + "/one.jsonl");
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
    const auto r = test::run(2, deck_text(tmp + "/" + c.name), c.overrides,
                             tmp + "/" + c.name + ".jsonl");
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 16u);
    const Diffs d = diffs(r, one);
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
    const auto r = test::run(c.ranks, deck_text(tmp + "/" + c.name), ov,
                             tmp + "/" + c.name + ".jsonl");
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 8u);
    EXPECT_EQ(r.steps.front().step, 9);
    const Diffs d = diffs(r, one, 9);
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
  auto one = test::run(1, deck_text(tmp + "/one"), {kv1}, tmp + "/one.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.error;
  const auto r = test::run(2, deck_text(tmp + "/tp2"), {kv1, "--mesh.tp=2"}, tmp + "/tp2.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_EQ(r.steps.size(), 16u);
  const Diffs d = diffs(r, one);
  if (test::world_rank() == 0)
    std::printf("LoRA tp2, one shared kv head, vs 1 GPU: worst relative loss difference %.3e, "
                "gradient norm (steps 1-3) %.3e\n", d.loss, d.norm);
  EXPECT_LT(d.loss, 5e-3);
  EXPECT_LT(d.norm, 2e-2);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
