// RMSNorm over the last dimension (no mean subtraction, weight starts at ones, not 1+w):
//   y = w * x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps)
// Also used for q_norm/k_norm with rows = B*T*heads and C = head_dim (weight shared by heads).
#pragma once

namespace qt::cpu {

// x, y: [N, C]; w: [C]; rstd: [N] (saved for backward). y may not alias x.
template <typename T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* w, int N, int C, double eps);

// dx[N, C] written; dw[C] accumulated (+=), skipped when dw is null (frozen). rstd from the
// forward. dx may alias dy.
template <typename T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd, int N,
                      int C);

}  // namespace qt::cpu
