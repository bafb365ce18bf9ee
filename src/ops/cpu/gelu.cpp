// The two GELUs and their derivatives, evaluated in double, stored in T.
#include "ops/gelu.h"

#include <cmath>

namespace qt::cpu {
namespace {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kCubic = 0.044715;
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1 / sqrt(2 pi)

double tanh_form(double x) { return 0.5 * x * (1 + std::tanh(kSqrt2OverPi * (x + kCubic * x * x * x))); }
double tanh_form_grad(double x) {
  const double u = kSqrt2OverPi * (x + kCubic * x * x * x), t = std::tanh(u);
  const double du = kSqrt2OverPi * (1 + 3 * kCubic * x * x);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du;
}
double erf_form(double x) { return 0.5 * x * (1 + std::erf(x * kInvSqrt2)); }
// d/dx = Phi(x) + x phi(x)
double erf_form_grad(double x) {
  return 0.5 * (1 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
}

}  // namespace

template <typename T>
void gelu_tanh_forward(T* y, const T* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] = static_cast<T>(tanh_form(x[i]));
}
template <typename T>
void gelu_tanh_backward(T* dx, const T* dy, const T* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dx[i] = static_cast<T>(dy[i] * tanh_form_grad(x[i]));
}
template <typename T>
void gelu_erf_forward(T* y, const T* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] = static_cast<T>(erf_form(x[i]));
}
template <typename T>
void gelu_erf_backward(T* dx, const T* dy, const T* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dx[i] = static_cast<T>(dy[i] * erf_form_grad(x[i]));
}

#define QT_GELU_INSTANTIATE(T)                                                   \
  template void gelu_tanh_forward<T>(T*, const T*, std::size_t);                \
  template void gelu_tanh_backward<T>(T*, const T*, const T*, std::size_t);     \
  template void gelu_erf_forward<T>(T*, const T*, std::size_t);                 \
  template void gelu_erf_backward<T>(T*, const T*, const T*, std::size_t);
QT_GELU_INSTANTIATE(float)
QT_GELU_INSTANTIATE(double)
#undef QT_GELU_INSTANTIATE

}  // namespace qt::cpu
