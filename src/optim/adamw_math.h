// AdamW's element math, in one place for every optimizer driver and ZeRO stage (and, for the
// CUDA back end's host offload, bit for bit the same update as the CPU reference's).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "qtrain/deck.h"

namespace qt {

// The per-step constants of one AdamW update.
struct AdamWStep {
  double lr = 0;      // this step's learning rate
  double clip = 1;    // factor on the gradients (1: not clipped)
  double b1 = 0, b2 = 0, eps = 0;
  double bc1 = 1, bc2 = 1;  // bias corrections 1 - beta^t
  float decay = 0;          // lr * weight_decay: the decoupled decay of tensors that decay
};

// t: the 1-based step number of bias correction.
inline AdamWStep adamw_step(const OptimConfig& cfg, double lr, double clip, std::int64_t t) {
  AdamWStep s;
  s.lr = lr;
  s.clip = clip;
  s.b1 = cfg.beta1;
  s.b2 = cfg.beta2;
  s.eps = cfg.eps;
  s.bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(t));
  s.bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(t));
  s.decay = static_cast<float>(lr * cfg.weight_decay);
  return s;
}

// w, m, v [n] updated in place from the gradients g [n]; `decays`: the tensor takes weight decay
// (not the norm weights).
inline void adamw_update(float* w, const float* g, float* m, float* v, std::size_t n,
                         const AdamWStep& s, bool decays) {
  const float decay = decays ? s.decay : 0.0f;
  for (std::size_t j = 0; j < n; ++j) {
    const float gj = static_cast<float>(g[j] * s.clip);
    m[j] = static_cast<float>(s.b1 * m[j] + (1.0 - s.b1) * gj);
    v[j] = static_cast<float>(s.b2 * v[j] + (1.0 - s.b2) * static_cast<double>(gj) * gj);
    const double mhat = m[j] / s.bc1, vhat = v[j] / s.bc2;
    float x = w[j];
    x -= decay * x;  // decoupled weight decay
    x -= static_cast<float>(s.lr * mhat / (std::sqrt(vhat) + s.eps));
    w[j] = x;
  }
}

}  // namespace qt
