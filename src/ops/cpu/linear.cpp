// Bias-free linear layer, weight [out, in] as in transformers: y = x W^T.
#include "ops/linear.h"

#include "ops/gemm.h"

namespace qt::cpu {

template <typename T>
void linear_forward(T* y, const T* x, const T* w, int N, int in, int out) {
  // y[N, out] = x[N, in] * w[out, in]^T
  gemm<T>(false, true, N, out, in, T(1), x, in, w, in, T(0), y, out);
}

template <typename T>
void linear_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, int N, int in, int out) {
  // dx[N, in] = dy[N, out] * w[out, in]
  if (dx != nullptr) gemm<T>(false, false, N, in, out, T(1), dy, out, w, in, T(0), dx, in);
  // dw[out, in] += dy[N, out]^T * x[N, in]
  if (dw != nullptr) gemm<T>(true, false, out, in, N, T(1), dy, out, x, in, T(1), dw, in);
}

template void linear_forward<float>(float*, const float*, const float*, int, int, int);
template void linear_forward<double>(double*, const double*, const double*, int, int, int);
template void linear_backward<float>(float*, float*, const float*, const float*, const float*, int,
                                     int, int);
template void linear_backward<double>(double*, double*, const double*, const double*, const double*,
                                      int, int, int);

}  // namespace qt::cpu
