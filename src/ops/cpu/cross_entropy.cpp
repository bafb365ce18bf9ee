// Softmax cross-entropy with ignore index. Max-subtracted log-sum-exp, sums in double.
#include "ops/cross_entropy.h"

#include <cmath>
#include <cstddef>

namespace qt::cpu {

template <typename T>
double cross_entropy_forward(T* losses, T* lse, const T* logits, const std::int32_t* targets, int N,
                             int V) {
  double total = 0.0;
  for (int n = 0; n < N; ++n) {
    const T* row = logits + static_cast<std::size_t>(n) * V;
    double m = row[0];
    for (int v = 1; v < V; ++v) m = row[v] > m ? double(row[v]) : m;
    double sum = 0.0;
    for (int v = 0; v < V; ++v) sum += std::exp(double(row[v]) - m);
    const double l = m + std::log(sum);  // sum >= 1: the max term contributes exp(0)
    lse[n] = static_cast<T>(l);
    const std::int32_t t = targets[n];
    if (t == kIgnoreIndex) {
      losses[n] = T(0);
      continue;
    }
    const double loss = l - double(row[t]);
    losses[n] = static_cast<T>(loss);
    total += loss;
  }
  return total;
}

template <typename T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const std::int32_t* targets,
                            T scale, int N, int V) {
  for (int n = 0; n < N; ++n) {
    const std::size_t off = static_cast<std::size_t>(n) * V;
    const T* row = logits + off;
    T* drow = dlogits + off;
    const std::int32_t t = targets[n];
    if (t == kIgnoreIndex) {
      for (int v = 0; v < V; ++v) drow[v] = T(0);
      continue;
    }
    const double l = lse[n];
    const double s = scale;
    // dlogits may alias logits: row[v] is read before drow[v] is written.
    for (int v = 0; v < V; ++v) {
      const double p = std::exp(double(row[v]) - l);
      drow[v] = static_cast<T>(s * (v == t ? p - 1.0 : p));
    }
  }
}

template double cross_entropy_forward<float>(float*, float*, const float*, const std::int32_t*, int,
                                             int);
template double cross_entropy_forward<double>(double*, double*, const double*, const std::int32_t*,
                                              int, int);
template void cross_entropy_backward<float>(float*, const float*, const float*, const std::int32_t*,
                                            float, int, int);
template void cross_entropy_backward<double>(double*, const double*, const double*,
                                             const std::int32_t*, double, int, int);

}  // namespace qt::cpu
