// Rotary position embedding, default type, non-interleaved ("rotate_half", NeoX style):
//   inv_freq[i] = 1 / theta^(2i / hd)                 (fp32, as transformers)
//   angle       = float(pos) * inv_freq[i]            (fp32)
//   x'[i]       = x[i] cos - x[i + hd/2] sin,  x'[i + hd/2] = x[i + hd/2] cos + x[i] sin,  i < hd/2
#pragma once

#include <cstdint>

namespace qt::cpu {

// cos, sin: [max_pos, hd/2], computed in fp32 exactly as transformers does.
void rope_table(float* cos, float* sin, int max_pos, int hd, double theta);

// In place on x [B, T, heads, hd]. pos [B, T] (null: position = t). Every position < max_pos of
// the table.
template <typename T>
void rope_forward(T* x, const float* cos, const float* sin, const std::int32_t* pos, int B, int Tn,
                  int heads, int hd);

// In place on dx [B, T, heads, hd]: the transpose (inverse) rotation.
template <typename T>
void rope_backward(T* dx, const float* cos, const float* sin, const std::int32_t* pos, int B,
                   int Tn, int heads, int hd);

}  // namespace qt::cpu
