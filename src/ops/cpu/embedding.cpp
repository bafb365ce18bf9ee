// Token embedding lookup and its scatter-add backward.
#include "ops/embedding.h"

#include <algorithm>
#include <cstddef>

namespace qt::cpu {

template <typename T>
void embedding_forward(T* x, const std::int32_t* ids, const T* wte, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const T* row = wte + static_cast<std::size_t>(ids[n]) * C;
    std::copy(row, row + C, x + static_cast<std::size_t>(n) * C);
  }
}

// Tokens are added in order n = 0, 1, ..., so repeated ids sum in a fixed order.
template <typename T>
void embedding_backward(T* dwte, const T* dx, const std::int32_t* ids, int N, int C) {
  for (int n = 0; n < N; ++n) {
    T* row = dwte + static_cast<std::size_t>(ids[n]) * C;
    const T* g = dx + static_cast<std::size_t>(n) * C;
    for (int c = 0; c < C; ++c) row[c] += g[c];
  }
}

template void embedding_forward<float>(float*, const std::int32_t*, const float*, int, int);
template void embedding_forward<double>(double*, const std::int32_t*, const double*, int, int);
template void embedding_backward<float>(float*, const float*, const std::int32_t*, int, int);
template void embedding_backward<double>(double*, const double*, const std::int32_t*, int, int);

}  // namespace qt::cpu
