// RMSNorm over the last dimension: y = w * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps).
// Row sums are accumulated in double.
#include "ops/rmsnorm.h"

#include <cmath>
#include <cstddef>
#include <vector>

namespace qt::cpu {

template <typename T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* w, int N, int C, double eps) {
  for (int n = 0; n < N; ++n) {
    const T* xr = x + static_cast<std::size_t>(n) * C;
    T* yr = y + static_cast<std::size_t>(n) * C;
    double ss = 0.0;
    for (int c = 0; c < C; ++c) ss += double(xr[c]) * double(xr[c]);
    // The rounded rstd is both used here and saved, so the backward sees the same value.
    const T r = static_cast<T>(1.0 / std::sqrt(ss / C + eps));
    rstd[n] = r;
    // transformers normalises first, then multiplies by the weight.
    for (int c = 0; c < C; ++c) yr[c] = w[c] * (xr[c] * r);
  }
}

// With xhat = x * r:  dx = r * (w*dy - xhat * mean(w*dy*xhat)),  dw += sum_n dy * xhat.
template <typename T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd, int N,
                      int C) {
  std::vector<double> dw_acc(C, 0.0);  // [C] per-call accumulator in double
  for (int n = 0; n < N; ++n) {
    const std::size_t off = static_cast<std::size_t>(n) * C;
    const T* xr = x + off;
    const T* dyr = dy + off;
    T* dxr = dx + off;
    const double r = rstd[n];
    double dot = 0.0;  // sum_c w*dy*xhat
    for (int c = 0; c < C; ++c) dot += double(w[c]) * dyr[c] * (xr[c] * r);
    const double m = dot / C;
    // dx may alias dy: each dy[c] is read before dx[c] is written.
    for (int c = 0; c < C; ++c) {
      const double g = dyr[c];
      const double xhat = xr[c] * r;
      dw_acc[c] += g * xhat;
      dxr[c] = static_cast<T>(r * (double(w[c]) * g - xhat * m));
    }
  }
  if (dw != nullptr)
    for (int c = 0; c < C; ++c) dw[c] += static_cast<T>(dw_acc[c]);
}

template void rmsnorm_forward<float>(float*, float*, const float*, const float*, int, int, double);
template void rmsnorm_forward<double>(double*, double*, const double*, const double*, int, int,
                                      double);
template void rmsnorm_backward<float>(float*, float*, const float*, const float*, const float*,
                                      const float*, int, int);
template void rmsnorm_backward<double>(double*, double*, const double*, const double*,
                                       const double*, const double*, int, int);

}  // namespace qt::cpu
