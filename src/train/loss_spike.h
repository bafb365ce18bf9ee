// train.loss_spike_factor: which steps' losses stand out against the run's recent losses.
#pragma once

#include <cstdint>

namespace qt {

// An exponential mean of the losses seen (each new loss weighs 1/20, so about the last 20
// steps); a loss above factor x that mean is a spike once kWarmup losses have been seen (the
// first steps of a run fall fast and would all look like changes). Only finite losses count.
class LossSpikeWatch {
 public:
  static constexpr int kWarmup = 10;           // losses seen before any is called a spike
  static constexpr double kWeight = 1.0 / 20;  // a new loss's weight in the mean

  explicit LossSpikeWatch(double factor) : factor_(factor) {}

  // Adds `loss` to the mean; true when it is a spike against the mean before it. A factor of 0
  // watches nothing; a non-finite loss is ignored (false).
  bool observe(double loss);
  // The mean before the last observe(), for the message.
  double mean_before() const { return mean_before_; }

 private:
  double factor_;
  double mean_ = 0, mean_before_ = 0;
  std::int64_t seen_ = 0;
};

}  // namespace qt
