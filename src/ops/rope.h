// Rotary position embedding, non-interleaved ("rotate_half", NeoX style):
//   inv_freq[i] = 1 / theta^(2i / hd)                 (fp32, as transformers)
//   angle       = float(pos) * inv_freq[i]            (fp32)
//   x'[i]       = x[i] cos - x[i + hd/2] sin,  x'[i + hd/2] = x[i + hd/2] cos + x[i] sin,  i < hd/2
// With YaRN (model.rope_type = yarn; transformers 5.17's _compute_yarn_parameters), in fp32 as
// there, with dim = hd, f = rope_factor, L = rope_original_max_position_embeddings:
//   d(r)     = dim ln(L / (2 pi r)) / (2 ln theta)            (the dimension of r rotations in L)
//   lo, hi   = max(floor(d(beta_fast)), 0), min(ceil(d(beta_slow)), dim - 1)  (hi += 0.001 if =)
//   ramp[i]  = clamp((i - lo) / (hi - lo), 0, 1)
//   inv[i]   = inv_freq[i] / f * ramp[i] + inv_freq[i] * (1 - ramp[i])
//   cos, sin = the table's, times rope_cos_sin_scale() (0.1 ln f + 1 by default)
#pragma once

#include <cstdint>

#include "qtrain/model_config.h"

namespace qt::cpu {

// cos, sin: [max_pos, hd/2], computed in fp32 exactly as transformers does: plain RoPE.
void rope_table(float* cos, float* sin, int max_pos, int hd, double theta);
// The model's: plain RoPE, or YaRN's frequencies and scale (cfg.rope_type).
void rope_table(float* cos, float* sin, int max_pos, const ModelConfig& cfg);

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
