// What an optimizer step reports. The optimizer itself is the sharded state's driver
// (optim/sharded_state.h on the host, cuda/sharded_state_cuda.h on the GPU), over AdamW's one element math (optim/adamw_math.h).
#pragma once

namespace qt {

struct OptimStepStats {
  double grad_norm = 0;   // global L2 norm before clipping
  double clip_scale = 1;  // factor applied to the gradients (1 when not clipped)
  double lr = 0;
};

}  // namespace qt
