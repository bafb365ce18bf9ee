// Rotary position embedding, non-interleaved (rotate_half). Tables in fp32 as transformers.
#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace qt::cpu {

namespace {

// cos, sin [max_pos, hd/2] of the frequencies inv_freq [hd/2], times `scale`, in fp32.
void fill_table(float* cos, float* sin, int max_pos, const std::vector<float>& inv_freq,
                float scale) {
  const std::size_t half = inv_freq.size();
  for (std::size_t i = 0; i < half; ++i)
    for (int p = 0; p < max_pos; ++p) {
      const float angle = static_cast<float>(p) * inv_freq[i];
      cos[static_cast<std::size_t>(p) * half + i] = cosf(angle) * scale;
      sin[static_cast<std::size_t>(p) * half + i] = sinf(angle) * scale;
    }
}

// theta^(2i / hd) in fp32, in the order transformers computes it. i < hd / 2
float pos_freq(double theta, int i, int hd) {
  return powf(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(hd));
}

}  // namespace

void rope_table(float* cos, float* sin, int max_pos, int hd, double theta) {
  std::vector<float> inv_freq(static_cast<std::size_t>(hd / 2));
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = 1.0f / pos_freq(theta, i, hd);
  fill_table(cos, sin, max_pos, inv_freq, 1.0f);  // x 1.0f: the same bits
}

void rope_table(float* cos, float* sin, int max_pos, const ModelConfig& cfg) {
  if (!cfg.is_yarn()) return rope_table(cos, sin, max_pos, cfg.head_dim, cfg.rope_theta);
  const int dim = cfg.head_dim, half = dim / 2;
  const double base = cfg.rope_theta, L = cfg.rope_original_max_position_embeddings;
  const double pi = 3.14159265358979323846;
  auto correction_dim = [&](double rotations) {  // in double, as Python's math
    return dim * std::log(L / (rotations * 2 * pi)) / (2 * std::log(base));
  };
  const double lo = std::max(std::floor(correction_dim(cfg.rope_beta_fast)), 0.0);
  double hi = std::min(std::ceil(correction_dim(cfg.rope_beta_slow)), static_cast<double>(dim - 1));
  if (lo == hi) hi += 0.001;  // transformers: no division by zero
  const float factor = static_cast<float>(cfg.rope_factor);
  const float flo = static_cast<float>(lo), fspan = static_cast<float>(hi - lo);
  std::vector<float> inv_freq(static_cast<std::size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float p = pos_freq(base, i, dim);
    const float extrapolation = 1.0f / p, interpolation = 1.0f / (factor * p);
    const float ramp = std::clamp((static_cast<float>(i) - flo) / fspan, 0.0f, 1.0f);
    const float keep = 1.0f - ramp;  // transformers' inv_freq_extrapolation_factor
    inv_freq[i] = interpolation * (1.0f - keep) + extrapolation * keep;
  }
  fill_table(cos, sin, max_pos, inv_freq, static_cast<float>(cfg.rope_cos_sin_scale()));
}

namespace {

// Rotates each pair (x[i], x[i + hd/2]) by +angle (sign = 1) or -angle (sign = -1).
template <typename T>
void rope_apply(T* x, const float* cos, const float* sin, const std::int32_t* pos, int B, int Tn,
                int heads, int hd, T sign) {
  const int half = hd / 2;
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < Tn; ++t) {
      const std::size_t bt = static_cast<std::size_t>(b) * Tn + t;
      const std::size_t p = pos != nullptr ? static_cast<std::size_t>(pos[bt]) : t;
      const float* cr = cos + p * half;  // [hd/2]
      const float* sr = sin + p * half;
      T* xt = x + bt * heads * hd;  // [heads, hd]
      for (int h = 0; h < heads; ++h) {
        T* xh = xt + static_cast<std::size_t>(h) * hd;
        for (int i = 0; i < half; ++i) {
          const T c = cr[i];
          const T s = sign * static_cast<T>(sr[i]);
          const T a = xh[i];
          const T b2 = xh[i + half];
          xh[i] = a * c - b2 * s;
          xh[i + half] = b2 * c + a * s;
        }
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_forward(T* x, const float* cos, const float* sin, const std::int32_t* pos, int B, int Tn,
                  int heads, int hd) {
  rope_apply<T>(x, cos, sin, pos, B, Tn, heads, hd, T(1));
}

// The rotation is orthogonal, so its transpose is the rotation by -angle.
template <typename T>
void rope_backward(T* dx, const float* cos, const float* sin, const std::int32_t* pos, int B,
                   int Tn, int heads, int hd) {
  rope_apply<T>(dx, cos, sin, pos, B, Tn, heads, hd, T(-1));
}

template void rope_forward<float>(float*, const float*, const float*, const std::int32_t*, int, int,
                                  int, int);
template void rope_forward<double>(double*, const float*, const float*, const std::int32_t*, int,
                                   int, int, int);
template void rope_backward<float>(float*, const float*, const float*, const std::int32_t*, int,
                                   int, int, int);
template void rope_backward<double>(double*, const float*, const float*, const std::int32_t*, int,
                                    int, int, int);

}  // namespace qt::cpu
