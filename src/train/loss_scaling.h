// train.precision = fp16 in the training loop: the loss scaler (optim/loss_scaler.h) over the
// run's TrainState (checkpoints carry its state), and what a step's outcome does to it.
#pragma once

#include <string>

#include "optim/loss_scaler.h"
#include "qtrain/checkpoint.h"
#include "qtrain/deck.h"

namespace qt {

class LossScaling {
 public:
  // Off unless train.precision = fp16. A dynamic scaler continues the checkpoint's state when
  // `state` has one (state.loss_scale > 0), else starts at 2^train.initial_scale_power; a static
  // one is the deck's. Other precisions drop a checkpoint's scaler state.
  LossScaling(const TrainConfig& tc, TrainState& state);

  bool on() const { return on_; }
  bool dynamic() const { return on_ && scaler_.dynamic(); }
  // The factor of the next step's gradients (1 when off).
  double scale() const { return on_ ? scaler_.scale() : 1.0; }
  // The start-up line (empty when off).
  std::string describe() const;

  struct Outcome {
    bool overflow = false;  // skipped with a finite loss: the gradients overflowed
    LossScaler::Change change = LossScaler::Change::kNone;
    double scale_before = 1, scale_after = 1;
    int hysteresis_left = 0;  // after the step
  };
  // After a step's optimizer call: `skipped` as it reported, `loss_finite` the step's mean loss.
  // Updates the scaler and `state` (its state and overflow_steps; skipped_steps is the
  // caller's). A step skipped for a non-finite loss leaves the scale alone: no scale mends that.
  Outcome after_step(bool skipped, bool loss_finite);
  // The stderr line for an overflow (without the "qtrain: warning: " prefix).
  static std::string overflow_text(long long step, const Outcome& o);

 private:
  void save();  // the scaler's state into state_ (what a checkpoint writes)

  TrainState& state_;
  bool on_ = false;
  LossScaler scaler_;
  bool resumed_ = false;
};

}  // namespace qt
