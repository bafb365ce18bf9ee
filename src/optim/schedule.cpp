#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

namespace qt {

double lr_at(const OptimConfig& o, int total_steps, std::int64_t step) {
  if (o.warmup_steps > 0 && step < o.warmup_steps)
    return o.lr * static_cast<double>(step + 1) / o.warmup_steps;
  const double span = std::max(1, total_steps - o.warmup_steps);
  const double p = std::clamp(static_cast<double>(step - o.warmup_steps) / span, 0.0, 1.0);
  switch (o.schedule) {
    case Schedule::kCosine: return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * p));
    case Schedule::kLinear: return o.lr + (o.min_lr - o.lr) * p;
    case Schedule::kConstant: return o.lr;
  }
  return o.lr;
}

}  // namespace qt
