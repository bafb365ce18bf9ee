// GELU in its two forms (transformers' activations):
//   gelu_tanh (gelu_pytorch_tanh): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//   gelu_erf  (nn.GELU()):         0.5 x (1 + erf(x / sqrt(2)))
#pragma once

#include <cstddef>

namespace qt::cpu {

// Forward: y [n] written (may alias x). Backward: dx = dy gelu'(x), written (may alias dy).
template <typename T>
void gelu_tanh_forward(T* y, const T* x, std::size_t n);
template <typename T>
void gelu_tanh_backward(T* dx, const T* dy, const T* x, std::size_t n);

template <typename T>
void gelu_erf_forward(T* y, const T* x, std::size_t n);
template <typename T>
void gelu_erf_backward(T* dx, const T* dy, const T* x, std::size_t n);

}  // namespace qt::cpu
