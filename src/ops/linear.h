// Linear layer without bias, transformers layout: weight [out, in], y = x W^T.
#pragma once

namespace qt::cpu {

// y[N, out] = x[N, in] * w[out, in]^T            (y written)
template <typename T>
void linear_forward(T* y, const T* x, const T* w, int N, int in, int out);

// dx[N, in]   = dy[N, out] * w[out, in]          (written; skipped when dx is null)
// dw[out, in] += dy^T[out, N] * x[N, in]         (accumulated; skipped when dw is null: frozen)
template <typename T>
void linear_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, int N, int in, int out);

}  // namespace qt::cpu
