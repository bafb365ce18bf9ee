// What an optimizer step is asked and what it reports. The optimizer itself is the sharded
// state's driver (optim/sharded_state.h on the host, cuda/sharded_state_cuda.h on the GPU), over
// AdamW's one element math (optim/adamw_math.h).
#pragma once

#include <cmath>
#include <cstdint>

namespace qt {

// One optimizer step as the trainer asks for it.
struct StepRequest {
  std::int64_t step = 0;    // 0-based index of the step: the learning-rate schedule's position
  std::int64_t update = 1;  // AdamW's bias-correction count t, 1-based: the updates applied so
                            // far with this one (step + 1 less the steps skipped before it)
  bool loss_finite = true;  // false: skip the update, whatever the gradient norm
  // The factor the step's gradients carry (train.precision = fp16's loss scale; 1 otherwise):
  // the norm is reported without it and the update divides it out.
  double grad_scale = 1;

  // The step of a run that never skipped: t = step + 1.
  static StepRequest at(std::int64_t step) { return {step, step + 1, true, 1}; }
};

struct OptimStepStats {
  double grad_norm = 0;   // global L2 norm before clipping, without the grad_scale (NaN or
                          // infinite when skipped for it)
  double clip_scale = 1;  // factor applied to the stored gradients: 1 / grad_scale, times the
                          // clipping's (1 when neither)
  double lr = 0;
  // Nothing was updated (parameters, moments and the bf16 copies as they were): the loss or the
  // gradient norm was not finite. The same on every rank: both are sums over the whole mesh.
  bool skipped = false;
};

// The step's verdict from the squared global norm of the stored gradients (summed over the mesh:
// the same on every rank): grad_norm without the request's grad_scale, skipped when the loss or
// the norm is not finite, else clip_scale, the factor that undoes grad_scale and clips the norm
// to grad_clip (> 0; 0: no clipping).
inline void judge_gradients(OptimStepStats& st, double sumsq, const StepRequest& request,
                            double grad_clip) {
  st.grad_norm = std::sqrt(sumsq) / request.grad_scale;
  st.skipped = !request.loss_finite || !std::isfinite(st.grad_norm);
  if (st.skipped) return;
  st.clip_scale = 1 / request.grad_scale;
  if (grad_clip > 0 && st.grad_norm > grad_clip)
    st.clip_scale *= grad_clip / (st.grad_norm + 1e-6);
}

}  // namespace qt
