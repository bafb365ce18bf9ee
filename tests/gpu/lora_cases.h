// The LoRA GPU training tests' deck (test_lora_train_cuda_np2, test_lora_train_pp_cuda_np2): a
// tiny model with rank-8 adapters on every linear layer, dropout on, 16 steps; and the comparison
// of two runs' losses and first gradient norms.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>

#include "train/training_harness.h"

namespace qt::test {

// layers: the preset's when 0; checkpoint_every: checkpoint.every (-1: none).
inline std::string lora_deck(const std::string& dir, int layers = 0, int checkpoint_every = -1) {
  return "[model]\npreset = tiny\nvocab_size = 256\nhidden_size = 128\nintermediate_size = 256\n"
         "num_heads = 4\nnum_kv_heads = 2\nhead_dim = 64\n" +
         (layers > 0 ? "num_layers = " + std::to_string(layers) + "\n" : std::string()) +
         "[train]\nseq_len = 128\nmicro_batch = 2\nglobal_batch = 8\nsteps = 16\nseed = 9\n"
         "device = cuda\n"
         "[optim]\nlr = 1e-2\nmin_lr = 1e-3\nwarmup_steps = 3\nweight_decay = 0.01\n"
         "[lora]\nr = 8\nalpha = 16\ndropout = 0.1\ntargets = all-linear\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = " + std::to_string(checkpoint_every) +
         "\nresume = none\n[log]\nevery = 1\n";
}

// The largest relative difference of the losses (from step `from` on) and of the gradient norms
// (steps 1 to 3: later the adapters of two meshes drift apart by bf16 rounding, and the noisy
// gradient follows) over the steps both runs logged; infinity when none is shared or a value is
// not finite.
struct LoraDiffs {
  double loss = -1, norm = -1;
};
inline LoraDiffs lora_diffs(const RunResult& got, const RunResult& ref, long from = 1) {
  LoraDiffs d;
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

}  // namespace qt::test
