// Rotary position embedding, non-interleaved (rotate_half). Tables in fp32 as transformers.
#include "ops/rope.h"

#include <cmath>
#include <cstddef>

namespace qt::cpu {

void rope_table(float* cos, float* sin, int max_pos, int hd, double theta) {
  const int half = hd / 2;
  const float base = static_cast<float>(theta);
  for (int i = 0; i < half; ++i) {
    // Every step in fp32, in the order transformers uses.
    const float inv_freq = 1.0f / powf(base, static_cast<float>(2 * i) / static_cast<float>(hd));
    for (int p = 0; p < max_pos; ++p) {
      const float angle = static_cast<float>(p) * inv_freq;
      cos[static_cast<std::size_t>(p) * half + i] = cosf(angle);
      sin[static_cast<std::size_t>(p) * half + i] = sinf(angle);
    }
  }
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
