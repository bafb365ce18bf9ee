// SwiGLU: h = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
#pragma once

namespace qt::cpu {

// gate, up, h: [N, I] (h written).
template <typename T>
void swiglu_forward(T* h, const T* gate, const T* up, int N, int I);

// dgate, dup: [N, I] written (=).
template <typename T>
void swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up, int N, int I);

}  // namespace qt::cpu
