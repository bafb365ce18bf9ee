// LayerNorm with bias: statistics accumulated in double, stored in T.
#include "ops/layernorm.h"

#include <cmath>
#include <cstddef>

namespace qt::cpu {

template <typename T>
void layernorm_forward(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b, int N, int C,
                       double eps) {
  for (int n = 0; n < N; ++n) {
    const T* xr = x + static_cast<std::size_t>(n) * C;
    T* yr = y + static_cast<std::size_t>(n) * C;
    double s = 0;
    for (int c = 0; c < C; ++c) s += xr[c];
    const double mu = s / C;
    double v = 0;
    for (int c = 0; c < C; ++c) v += (xr[c] - mu) * (xr[c] - mu);
    const double r = 1.0 / std::sqrt(v / C + eps);
    mean[n] = static_cast<T>(mu);
    rstd[n] = static_cast<T>(r);
    for (int c = 0; c < C; ++c) yr[c] = static_cast<T>((xr[c] - mu) * r * w[c] + b[c]);
  }
}

// With xhat = (x - mean) rstd and g = dy w:
//   dx = rstd (g - mean(g) - xhat mean(g xhat)),  dw += dy xhat,  db += dy
template <typename T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const T* mean,
                        const T* rstd, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const std::size_t r0 = static_cast<std::size_t>(n) * C;
    const double mu = mean[n], r = rstd[n];
    double sg = 0, sgx = 0;
    for (int c = 0; c < C; ++c) {
      const double xh = (x[r0 + c] - mu) * r, g = double(dy[r0 + c]) * w[c];
      sg += g;
      sgx += g * xh;
      dw[c] += static_cast<T>(dy[r0 + c] * xh);
      db[c] += dy[r0 + c];
    }
    sg /= C;
    sgx /= C;
    for (int c = 0; c < C; ++c) {
      const double xh = (x[r0 + c] - mu) * r, g = double(dy[r0 + c]) * w[c];
      dx[r0 + c] = static_cast<T>(r * (g - sg - xh * sgx));
    }
  }
}

template void layernorm_forward<float>(float*, float*, float*, const float*, const float*,
                                       const float*, int, int, double);
template void layernorm_forward<double>(double*, double*, double*, const double*, const double*,
                                        const double*, int, int, double);
template void layernorm_backward<float>(float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*, int, int);
template void layernorm_backward<double>(double*, double*, double*, const double*, const double*,
                                         const double*, const double*, const double*, int, int);

}  // namespace qt::cpu
