#include "train/loss_spike.h"

#include <cmath>

namespace qt {

bool LossSpikeWatch::observe(double loss) {
  if (factor_ <= 0 || !std::isfinite(loss)) return false;
  mean_before_ = mean_;
  const bool spike = seen_ >= kWarmup && loss > factor_ * mean_;
  // The first loss starts the mean; later ones move it by kWeight (spikes too: a lasting change
  // of level, e.g. new data, stops being reported after a few steps).
  mean_ = seen_ == 0 ? loss : mean_ + kWeight * (loss - mean_);
  ++seen_;
  return spike;
}

}  // namespace qt
