// fp16 loss scaling (train.precision = fp16): the factor every gradient of a step carries, so
// that small fp16 gradients do not underflow, and its dynamic rule, DeepSpeed's
// (runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale) with its fp16 config names:
//   - a step whose gradients overflow (a non-finite gradient norm with a finite loss) is skipped;
//     the scale is halved (never below min_loss_scale), unless `hysteresis` allows a few
//     overflows first: each overflow spends one, the scale falls on the last;
//   - after loss_scale_window clean steps in a row (no overflow) the scale doubles and the
//     hysteresis is refilled (consecutive_hysteresis: refilled by every clean step instead);
//   - an overflow at the minimum scale with no hysteresis left cannot be mended: the run stops.
// A static scale (loss_scale > 0) never changes; its overflows are ordinary skipped steps.
#pragma once

#include <cstdint>

namespace qt {

struct LossScalerConfig {
  double static_scale = 0;         // > 0: this scale for ever; 0: dynamic
  int initial_scale_power = 16;    // dynamic: start at 2^this
  int window = 1000;               // clean steps in a row before the scale doubles
  int hysteresis = 2;              // overflows tolerated before the scale halves (>= 1)
  bool consecutive_hysteresis = false;  // refill the hysteresis after every clean step
  double min_scale = 1;            // the dynamic scale's floor
};

// The scaler's state between steps (checkpoints carry it: TrainState).
struct LossScalerState {
  double scale = 1;                // the factor of the next step's gradients
  int hysteresis_left = 1;         // overflows left before the scale falls (1: the next one)
  std::int64_t clean_steps = 0;    // clean steps since the last overflow (or the start)
};

class LossScaler {
 public:
  explicit LossScaler(const LossScalerConfig& cfg);

  const LossScalerConfig& config() const { return cfg_; }
  bool dynamic() const { return cfg_.static_scale <= 0; }
  double scale() const { return state_.scale; }
  const LossScalerState& state() const { return state_; }
  void restore(const LossScalerState& s) { state_ = s; }

  // What a step's outcome did to the scale.
  enum class Change {
    kNone,        // a clean step, no change (or a static scale)
    kGrown,       // a clean window completed: the scale doubled
    kHysteresis,  // an overflow spent one of the hysteresis: the scale stays
    kReduced,     // an overflow halved the scale (or brought it to the minimum)
    kStuck,       // an overflow at the minimum scale with no hysteresis left: stop the run
  };
  // After a step whose update was decided: overflow = its gradients were not finite (the loss
  // was). A static scaler returns kNone whatever happened.
  Change update(bool overflow);

 private:
  LossScalerConfig cfg_;
  LossScalerState state_;
};

}  // namespace qt
