// Softmax cross-entropy over the vocabulary, with ignore index -100.
// targets are already aligned with the logits (row n predicts targets[n]); the data loader does
// the one-token shift that transformers does inside its loss.
#pragma once

#include <cstdint>

namespace qt::cpu {

inline constexpr std::int32_t kIgnoreIndex = -100;

// logits [N, V]; losses [N] = lse - logit[target] (0 for ignored rows); lse [N] saved.
// Returns the sum of losses over counted rows, accumulated in double.
template <typename T>
double cross_entropy_forward(T* losses, T* lse, const T* logits, const std::int32_t* targets,
                             int N, int V);

// dlogits [N, V] = scale * (softmax(logits) - onehot(target)); rows with target -100 get 0.
// dlogits may alias logits.
template <typename T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse,
                            const std::int32_t* targets, T scale, int N, int V);

}  // namespace qt::cpu
