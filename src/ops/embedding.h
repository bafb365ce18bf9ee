// Token embedding lookup.
#pragma once

#include <cstdint>

namespace qt::cpu {

// x[N, C] = wte[ids[n], :]   (written). ids must be in [0, V); checked by the caller.
template <typename T>
void embedding_forward(T* x, const std::int32_t* ids, const T* wte, int N, int C);

// dwte[ids[n], :] += dx[n, :]  (accumulated, in token order: deterministic).
template <typename T>
void embedding_backward(T* dwte, const T* dx, const std::int32_t* ids, int N, int C);

}  // namespace qt::cpu
