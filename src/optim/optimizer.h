// What an optimizer step is asked and what it reports. The optimizer itself is the sharded
// state's driver (optim/sharded_state.h on the host, cuda/sharded_state_cuda.h on the GPU), over
// AdamW's one element math (optim/adamw_math.h).
#pragma once

#include <cstdint>

namespace qt {

// One optimizer step as the trainer asks for it.
struct StepRequest {
  std::int64_t step = 0;    // 0-based index of the step: the learning-rate schedule's position
  std::int64_t update = 1;  // AdamW's bias-correction count t, 1-based: the updates applied so
                            // far with this one (step + 1 less the steps skipped before it)
  bool loss_finite = true;  // false: skip the update, whatever the gradient norm

  // The step of a run that never skipped: t = step + 1.
  static StepRequest at(std::int64_t step) { return {step, step + 1, true}; }
};

struct OptimStepStats {
  double grad_norm = 0;   // global L2 norm before clipping (NaN or infinite when skipped for it)
  double clip_scale = 1;  // factor applied to the gradients (1 when not clipped)
  double lr = 0;
  // Nothing was updated (parameters, moments and the bf16 copies as they were): the loss or the
  // gradient norm was not finite. The same on every rank: both are sums over the whole mesh.
  bool skipped = false;
};

}  // namespace qt
