// Linear with bias: the bias-free linear of linear.cpp plus the bias row.
#include "ops/linear_bias.h"

#include <cstddef>

#include "ops/linear.h"

namespace qt::cpu {

template <typename T>
void linear_bias_forward(T* y, const T* x, const T* w, const T* b, int N, int in, int out) {
  linear_forward<T>(y, x, w, N, in, out);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < out; ++o) y[static_cast<std::size_t>(n) * out + o] += b[o];
}

template <typename T>
void linear_bias_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int N, int in,
                          int out) {
  linear_backward<T>(dx, dw, dy, x, w, N, in, out);
  if (db == nullptr) return;
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < out; ++o) db[o] += dy[static_cast<std::size_t>(n) * out + o];
}

template void linear_bias_forward<float>(float*, const float*, const float*, const float*, int,
                                         int, int);
template void linear_bias_forward<double>(double*, const double*, const double*, const double*,
                                          int, int, int);
template void linear_bias_backward<float>(float*, float*, float*, const float*, const float*,
                                          const float*, int, int, int);
template void linear_bias_backward<double>(double*, double*, double*, const double*,
                                           const double*, const double*, int, int, int);

}  // namespace qt::cpu
