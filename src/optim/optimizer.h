// AdamW over the flat fp32 parameter buffer, with data-parallel gradient reduction and optional
// ZeRO-1 (optimizer state sharded over dp).
//
//   ZeRO-0: all-reduce gradients; every rank updates every parameter with its full moments.
//   ZeRO-1: reduce-scatter gradients; rank r updates its shard split_range(n, dp, r) with the
//           moments of that shard only, then the parameters are all-gathered.
//
// Buffers `params` and `grads` hold padded_numel() elements (the layout's numel rounded up to a
// multiple of dp; the padding stays zero).
#pragma once

#include <cstdint>
#include <vector>

#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/params.h"

namespace qt {

struct OptimStepStats {
  double grad_norm = 0;   // global L2 norm before clipping
  double clip_scale = 1;  // factor applied to the gradients (1 when not clipped)
  double lr = 0;
};

class AdamW {
 public:
  AdamW(const OptimConfig& cfg, const ParamLayout& layout, Comm& dp, int total_steps);

  std::size_t padded_numel() const { return padded_; }
  // The moments this rank holds (for checkpoints).
  MomentShard moments();

  // grads: this rank's gradient sums, already scaled so that their sum over dp is the mean
  // gradient. Reduces them over dp, clips, and updates params. `step` is the 0-based index of
  // this optimizer step (bias correction uses step + 1). Clobbers grads.
  OptimStepStats step(float* params, float* grads, std::int64_t step);

 private:
  void update_range(float* params, const float* grads, Range r, double lr, double clip,
                    std::int64_t t);

  OptimConfig cfg_;
  const ParamLayout& layout_;
  Comm& dp_;
  int total_steps_;
  std::size_t padded_;
  Range range_;                 // flat elements whose moments this rank holds
  std::vector<float> m_, v_;    // [range_.size()]
  std::vector<float> shard_;    // ZeRO-1 reduced gradients of this rank's shard: [padded_ / dp]
};

}  // namespace qt
