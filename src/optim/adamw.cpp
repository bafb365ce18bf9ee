#include <algorithm>
#include <cmath>

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
  const double b1 = cfg_.beta1, b2 = cfg_.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
  // Walk the parameters that overlap r, so weight decay follows each tensor's flag.
  for (const ParamInfo& p : layout_.params()) {
    const std::size_t lo = std::max(r.begin, p.offset), hi = std::min(r.end, p.offset + p.numel);
    if (lo >= hi) continue;
    const float decay = p.weight_decay ? static_cast<float>(lr * cfg_.weight_decay) : 0.0f;
    for (std::size_t i = lo; i < hi; ++i) {
      const std::size_t j = i - range_.begin;  // index into the moments
      const float g = static_cast<float>(grads[i - r.begin] * clip);
      m_[j] = static_cast<float>(b1 * m_[j] + (1.0 - b1) * g);
      v_[j] = static_cast<float>(b2 * v_[j] + (1.0 - b2) * static_cast<double>(g) * g);
      const double mhat = m_[j] / bc1, vhat = v_[j] / bc2;
      float w = params[i];
      w -= decay * w;  // decoupled weight decay
      w -= static_cast<float>(lr * mhat / (std::sqrt(vhat) + cfg_.eps));
      params[i] = w;
    }
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
