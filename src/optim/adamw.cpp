#include <algorithm>
#include <cmath>

#include "optim/adamw_math.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "qtrain/error.h"

namespace qt {

AdamW::AdamW(const OptimConfig& cfg, const ParamLayout& layout, Comm& dp, int total_steps)
    : cfg_(cfg), layout_(layout), dp_(dp), total_steps_(total_steps) {
  const std::size_t n = layout.numel();
  const std::size_t chunk = (n + dp.size() - 1) / dp.size();
  padded_ = chunk * dp.size();
  range_ = cfg.zero_stage == 1 ? split_range(n, dp.size(), dp.rank()) : Range{0, n};
  m_.assign(range_.size(), 0.0f);
  v_.assign(range_.size(), 0.0f);
  if (cfg.zero_stage == 1) shard_.assign(chunk, 0.0f);
}

MomentShard AdamW::moments() { return {range_, m_.data(), v_.data()}; }

void AdamW::update_range(float* params, const float* grads, Range r, double lr, double clip,
                         std::int64_t t) {
  const AdamWStep s = adamw_step(cfg_, lr, clip, t);
  // Walk the parameters that overlap r, so weight decay follows each tensor's flag.
  for (const ParamInfo& p : layout_.params()) {
    const std::size_t lo = std::max(r.begin, p.offset), hi = std::min(r.end, p.offset + p.numel);
    if (lo >= hi) continue;
    adamw_update(params + lo, grads + (lo - r.begin), m_.data() + (lo - range_.begin),
                 v_.data() + (lo - range_.begin), hi - lo, s, p.weight_decay);
  }
}

OptimStepStats AdamW::step(float* params, float* grads, std::int64_t step) {
  OptimStepStats s;
  s.lr = lr_at(cfg_, total_steps_, step);
  const std::size_t n = layout_.numel();
  const float* g = grads;  // gradient of range_'s elements, indexed from range_.begin
  if (cfg_.zero_stage == 1) {
    dp_.reduce_scatter(grads, shard_.data(), shard_.size(), DType::kF32, ReduceOp::kSum);
    g = shard_.data();
  } else if (dp_.size() > 1) {
    dp_.all_reduce(grads, n, DType::kF32, ReduceOp::kSum);
  }
  double sumsq = 0;
  for (std::size_t i = 0; i < range_.size(); ++i) sumsq += static_cast<double>(g[i]) * g[i];
  if (cfg_.zero_stage == 1) sumsq = dp_.sum(sumsq);
  s.grad_norm = std::sqrt(sumsq);
  if (cfg_.grad_clip > 0 && s.grad_norm > cfg_.grad_clip)
    s.clip_scale = cfg_.grad_clip / (s.grad_norm + 1e-6);
  update_range(params, g, range_, s.lr, s.clip_scale, step + 1);
  if (cfg_.zero_stage == 1) {
    // All-gather the updated shards in place: rank r's shard already sits at r * chunk.
    const std::size_t chunk = shard_.size();
    dp_.all_gather(params + chunk * dp_.rank(), params, chunk, DType::kF32);
  }
  return s;
}

}  // namespace qt
