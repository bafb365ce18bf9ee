// LayerNorm with weight and bias over the last dimension C (torch.nn.LayerNorm, biased variance):
//   y = (x - mean) * rstd * w + b,   rstd = 1 / sqrt(var + eps)
#pragma once

namespace qt::cpu {

// x, y [N, C]; mean, rstd [N] (written, for the backward).
template <typename T>
void layernorm_forward(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b, int N,
                       int C, double eps);

// dx [N, C] written (may alias dy); dw, db [C] accumulated (+=).
template <typename T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w,
                        const T* mean, const T* rstd, int N, int C);

}  // namespace qt::cpu
