#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace qt {

LossScaler::LossScaler(const LossScalerConfig& cfg) : cfg_(cfg) {
  state_.scale = dynamic() ? std::ldexp(1.0, cfg_.initial_scale_power) : cfg_.static_scale;
  state_.hysteresis_left = cfg_.hysteresis;
}

LossScaler::Change LossScaler::update(bool overflow) {
  if (!dynamic()) return Change::kNone;
  if (overflow) {
    state_.clean_steps = 0;
    if (state_.hysteresis_left > 1) {
      --state_.hysteresis_left;
      return Change::kHysteresis;
    }
    if (state_.scale <= cfg_.min_scale) return Change::kStuck;
    state_.scale = std::max(state_.scale / 2, cfg_.min_scale);
    return Change::kReduced;  // the hysteresis stays spent until a refill
  }
  ++state_.clean_steps;
  if (cfg_.consecutive_hysteresis) state_.hysteresis_left = cfg_.hysteresis;
  if (state_.clean_steps % cfg_.window != 0) return Change::kNone;
  state_.hysteresis_left = cfg_.hysteresis;
  state_.scale *= 2;
  return Change::kGrown;
}

}  // namespace qt
