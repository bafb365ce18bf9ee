// Shared by the sharded, tensor- and pipeline-parallel GPU tests: a small model with the CUDA
// attention's head_dim, 20 steps, and the comparison with a reference run.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "train/training_harness.h"

namespace qt::test {

inline std::string sharded_deck(const std::string& dir) {
  return "[model]\npreset = tiny\nvocab_size = 256\nhidden_size = 128\nintermediate_size = 256\n"
         "num_heads = 4\nnum_kv_heads = 2\nhead_dim = 64\n"
         "[train]\nseq_len = 128\nmicro_batch = 2\nglobal_batch = 8\nsteps = 20\nseed = 5\n"
         "device = cuda\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 5\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = 10\nkeep = 4\nresume = none\n"
         "[log]\nevery = 1\n";
}

// The largest relative loss difference over the steps both runs logged (infinity when none is
// shared or a loss is not finite); prints it under `name`.
inline double worst_loss_diff(const char* name, const RunResult& got, const RunResult& ref,
                              long from = 1) {
  double worst = -1;
  for (const auto& x : got.steps)
    for (const auto& y : ref.steps) {
      if (x.step != y.step || x.step < from) continue;
      if (!std::isfinite(x.loss)) return INFINITY;
      worst = std::max(worst, std::abs(x.loss - y.loss) / y.loss);
    }
  if (worst < 0) worst = INFINITY;
  if (world_rank() == 0) std::printf("%s: worst relative loss difference %.3e\n", name, worst);
  return worst;
}

// The same for the gradient norms (the norm is taken during the backward at dp > 1, unit by unit
// as each shard's last reduction lands), up to step `until`: infinity when a norm is not finite
// or none is shared.
inline double worst_norm_diff(const char* name, const RunResult& got, const RunResult& ref,
                              long until = 1L << 40) {
  double worst = -1;
  for (const auto& x : got.steps)
    for (const auto& y : ref.steps) {
      if (x.step != y.step || x.step > until) continue;
      if (!std::isfinite(x.grad_norm) || !std::isfinite(y.grad_norm)) return INFINITY;
      worst = std::max(worst, std::abs(x.grad_norm - y.grad_norm) / y.grad_norm);
    }
  if (worst < 0) worst = INFINITY;
  if (world_rank() == 0) std::printf("%s: worst relative gradient norm difference %.3e\n", name, worst);
  return worst;
}

// bf16 compute: the sums of another mesh or stage differ in their last bits (as dp 2 vs 1 GPU).
constexpr double kShardedTol = 5e-3;
// Gradient norms: bf16 gradients summed in another order; a norm of part of the micro-batches
// would be off by tens of percent.
constexpr double kShardedNormTol = 3e-2;

// GPUs this process sees (0 when CUDA cannot count them; the error is cleared).
inline int visible_gpus() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return gpus;
}

// A run of `name` against its reference: it ran its 20 steps, and its losses and gradient norms
// are within the bf16 tolerances above.
inline void expect_matches(const char* name, const RunResult& r, const RunResult& want) {
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_EQ(r.steps.size(), 20u);
  EXPECT_LT(worst_loss_diff(name, r, want), kShardedTol);
  EXPECT_LT(worst_norm_diff(name, r, want), kShardedNormTol);
}

// The pipeline tests' model (test_train_pp_cuda_np2/np4): four layers (two stages of two, or two
// chunks of one on each stage) and lr 1e-3. At the deck's 3e-3 this model's gradient norm spikes
// (4x at steps 9 and 12), and a tied table's gradient, summed in another order than on one GPU
// (its head and embedding halves on two stages), leaves the last bits of step 8 amplified to 7%
// of a norm by step 13 (untied: bit for bit).
inline std::vector<std::string> four_layers(std::vector<std::string> overrides = {}) {
  overrides.insert(overrides.begin(), {"--model.num_layers=4", "--optim.lr=1e-3"});
  return overrides;
}

// One GPU's runs of that model in tmp/one and tmp/one_untied, the references of the cases.
struct PipelineRefs {
  RunResult tied, untied;
};
inline PipelineRefs pipeline_refs(const std::string& tmp) {
  PipelineRefs r;
  r.tied = run(1, sharded_deck(tmp + "/one"), four_layers(), tmp + "/one.jsonl");
  EXPECT_EQ(r.tied.exit_code, 0) << r.tied.error;
  r.untied = run(1, sharded_deck(tmp + "/one_untied"),
                 four_layers({"--model.tie_word_embeddings=false"}), tmp + "/one_untied.jsonl");
  EXPECT_EQ(r.untied.exit_code, 0) << r.untied.error;
  return r;
}

}  // namespace qt::test
