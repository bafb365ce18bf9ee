// SwiGLU: h = silu(gate) * up, silu(g) = g * sigmoid(g).
#include "ops/swiglu.h"

#include <cmath>
#include <cstddef>

namespace qt::cpu {
namespace {

// exp(-g) overflows to inf for very negative g, giving sigmoid = 0: still finite.
template <typename T>
T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

}  // namespace

template <typename T>
void swiglu_forward(T* h, const T* gate, const T* up, int N, int I) {
  const std::size_t n = static_cast<std::size_t>(N) * I;
  for (std::size_t k = 0; k < n; ++k) h[k] = gate[k] * sigmoid(gate[k]) * up[k];
}

// d silu / dg = s * (1 + g * (1 - s)), s = sigmoid(g).
template <typename T>
void swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up, int N, int I) {
  const std::size_t n = static_cast<std::size_t>(N) * I;
  for (std::size_t k = 0; k < n; ++k) {
    const T g = gate[k];
    const T s = sigmoid(g);
    const T d = dh[k];
    dgate[k] = d * up[k] * s * (T(1) + g * (T(1) - s));
    dup[k] = d * g * s;
  }
}

template void swiglu_forward<float>(float*, const float*, const float*, int, int);
template void swiglu_forward<double>(double*, const double*, const double*, int, int);
template void swiglu_backward<float>(float*, float*, const float*, const float*, const float*, int,
                                     int);
template void swiglu_backward<double>(double*, double*, const double*, const double*, const double*,
                                      int, int);

}  // namespace qt::cpu
