#include "train/loss_scaling.h"

#include <fmt/format.h>

namespace qt {

namespace {

LossScalerConfig scaler_config(const TrainConfig& tc) {
  LossScalerConfig c;
  c.static_scale = tc.loss_scale;
  c.initial_scale_power = tc.initial_scale_power;
  c.window = tc.loss_scale_window;
  c.hysteresis = tc.hysteresis;
  c.consecutive_hysteresis = tc.consecutive_hysteresis;
  c.min_scale = tc.min_loss_scale;
  return c;
}

}  // namespace

LossScaling::LossScaling(const TrainConfig& tc, TrainState& state)
    : state_(state), on_(tc.fp16()), scaler_(scaler_config(tc)) {
  if (!on_) {
    state_.loss_scale = 0;  // a checkpoint's scaler is not carried into another precision
    state_.loss_scale_hysteresis = state_.loss_scale_clean_steps = state_.overflow_steps = 0;
    return;
  }
  resumed_ = scaler_.dynamic() && state_.loss_scale > 0;
  if (resumed_)
    scaler_.restore({state_.loss_scale, static_cast<int>(state_.loss_scale_hysteresis),
                     state_.loss_scale_clean_steps});
  save();
}

void LossScaling::save() {
  const LossScalerState& s = scaler_.state();
  state_.loss_scale = s.scale;
  state_.loss_scale_hysteresis = s.hysteresis_left;
  state_.loss_scale_clean_steps = s.clean_steps;
}

std::string LossScaling::describe() const {
  if (!on_) return {};
  if (!scaler_.dynamic())
    return fmt::format("fp16: static loss scale {:g} (an overflow skips the step)", scale());
  return fmt::format("fp16: dynamic loss scale {:g} ({}), halved on an overflow after "
                     "train.hysteresis = {}, doubled after {} steps without one, at least {:g}",
                     scale(), resumed_ ? "the checkpoint's" : "2^train.initial_scale_power",
                     scaler_.config().hysteresis, scaler_.config().window,
                     scaler_.config().min_scale);
}

LossScaling::Outcome LossScaling::after_step(bool skipped, bool loss_finite) {
  Outcome o;
  if (!on_) return o;
  o.scale_before = scaler_.scale();
  o.overflow = skipped && loss_finite;
  if (!skipped || o.overflow) o.change = scaler_.update(o.overflow);
  o.scale_after = scaler_.scale();
  o.hysteresis_left = scaler_.state().hysteresis_left;
  if (o.overflow) ++state_.overflow_steps;
  save();
  return o;
}

std::string LossScaling::overflow_text(long long step, const Outcome& o) {
  using Change = LossScaler::Change;
  const std::string head = fmt::format(
      "step {} skipped: its fp16 gradients overflowed at loss scale {:g} (parameters and "
      "optimizer state unchanged)", step, o.scale_before);
  switch (o.change) {
    case Change::kHysteresis:
      return head + (o.hysteresis_left == 1
                         ? std::string("; the scale stays (train.hysteresis): the next overflow "
                                       "halves it")
                         : fmt::format("; the scale stays (train.hysteresis): {} more overflows "
                                       "halve it", o.hysteresis_left));
    case Change::kReduced:
      return head + fmt::format("; the scale falls to {:g}", o.scale_after);
    case Change::kStuck:
      return head + "; the scale is at train.min_loss_scale and cannot fall";
    default:
      return head + " (a static train.loss_scale)";
  }
}

}  // namespace qt
