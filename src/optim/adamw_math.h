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
  // PyTorch's form of the bias corrections bc = 1 - beta^t: step_size = lr / bc1 on the first
  // moment, inv_sqrt_bc2 = 1 / sqrt(bc2) on sqrt(v) (one division an element, not three).
  double step_size = 0, inv_sqrt_bc2 = 1;
  float decay = 0;  // lr * weight_decay: the decoupled decay of tensors that decay
};

// lr / (1 - b1^t) and 1 / sqrt(1 - b2^t), the same bits wherever computed (both drivers call it).
inline void adamw_bias_terms(double lr, double b1, double b2, std::int64_t t, double* step_size,
                             double* inv_sqrt_bc2) {
  *step_size = lr / (1.0 - std::pow(b1, static_cast<double>(t)));
  *inv_sqrt_bc2 = 1.0 / std::sqrt(1.0 - std::pow(b2, static_cast<double>(t)));
}

// t: the 1-based step number of bias correction.
inline AdamWStep adamw_step(const OptimConfig& cfg, double lr, double clip, std::int64_t t) {
  AdamWStep s;
  s.lr = lr;
  s.clip = clip;
  s.b1 = cfg.beta1;
  s.b2 = cfg.beta2;
  s.eps = cfg.eps;
  adamw_bias_terms(lr, cfg.beta1, cfg.beta2, t, &s.step_size, &s.inv_sqrt_bc2);
  s.decay = static_cast<float>(lr * cfg.weight_decay);
  return s;
}

// w, m, v [n] updated in place from the gradients g [n]; `decays`: the tensor takes weight decay
// (not the norm weights).
inline void adamw_update(float* __restrict w, const float* __restrict g, float* __restrict m,
                         float* __restrict v, std::size_t n, const AdamWStep& s, bool decays) {
  // Locals: no store through w, m or v can change them (lets the loop vectorise).
  const double b1 = s.b1, b2 = s.b2, step_size = s.step_size, inv_sqrt_bc2 = s.inv_sqrt_bc2,
               eps = s.eps, clip = s.clip;
  const float decay = decays ? s.decay : 0.0f;
  for (std::size_t j = 0; j < n; ++j) {
    const float gj = static_cast<float>(g[j] * clip);
    const float mj = static_cast<float>(b1 * m[j] + (1.0 - b1) * gj);
    const float vj = static_cast<float>(b2 * v[j] + (1.0 - b2) * static_cast<double>(gj) * gj);
    m[j] = mj;
    v[j] = vj;
    float x = w[j];
    x -= decay * x;  // decoupled weight decay
    // lr * (m / bc1) / (sqrt(v / bc2) + eps), as PyTorch orders it
    x -= static_cast<float>(step_size * mj / (std::sqrt(static_cast<double>(vj)) * inv_sqrt_bc2 + eps));
    w[j] = x;
  }
}

}  // namespace qt

namespace qt {

// adamw_update compiled also for AVX2 (picked at run time where the CPU has it) and vectorised:
// the same IEEE operations per element (no fused multiply-add), so the same bits, faster. For the
// large host updates of optim.offload.
void adamw_update_host(float* w, const float* g, float* m, float* v, std::size_t n,
                       const AdamWStep& s, bool decays);

}  // namespace qt
