// Linear layer with bias, transformers layout: weight [out, in], y = x W^T + b.
#pragma once

namespace qt::cpu {

// y[N, out] = x[N, in] w[out, in]^T + b[out]     (y written)
template <typename T>
void linear_bias_forward(T* y, const T* x, const T* w, const T* b, int N, int in, int out);

// dx[N, in] = dy w (written; skipped when null); dw[out, in] += dy^T x; db[out] += sum_n dy[n]
template <typename T>
void linear_bias_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int N, int in,
                          int out);

}  // namespace qt::cpu
