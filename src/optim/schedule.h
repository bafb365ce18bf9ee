// Learning-rate schedule: linear warm-up from 0 to lr over warmup_steps, then cosine or linear
// decay from lr to min_lr over the remaining steps (or constant lr).
#pragma once

#include <cstdint>

#include "qtrain/deck.h"

namespace qt {

// Learning rate for the optimizer step with 0-based index `step` of a run of `total_steps`.
double lr_at(const OptimConfig& o, int total_steps, std::int64_t step);

}  // namespace qt
