// Per-head RMSNorm of q or k over head_dim (weight [hd] shared by the heads) fused with RoPE
// (rotate_half, not interleaved), as transformers does for Qwen3 (qwen3-spec.md 2.3, 2.4):
//   r     = 1 / sqrt(mean(float(x)^2) + eps)                 per (b, t, head), fp32, saved
//   y     = bf16(w * bf16(float(x) * r))                      the q_norm / k_norm output
//   c, s  = bf16(cos[p, i mod hd/2]), bf16(sin[p, i mod hd/2]) p = pos[b, t] (or t when pos is
//   null) out_i = bf16(bf16(y_i * c) + bf16(rot_i * s)),  rot_i = -y_{i+hd/2} (i < hd/2),
//   y_{i-hd/2} (else)
// The tables are fp32 [max_pos, hd/2] from qt::cpu::rope_table (src/ops/rope.h) copied to the
// device; they are rounded to bf16 here, as transformers rounds cos/sin to the model dtype.
// Shapes: x, out, dout, dx [B, T, heads, hd] bf16; w [hd] bf16; rstd [B * T * heads] fp32;
// pos [B, T] int32 (each < max_pos) or null. hd in {32, 64, 128, 256}; every pointer 16-byte
// aligned. Violations throw std::invalid_argument.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// out and rstd written. Out of place: x is kept for the backward. out may alias x (in place) when
// the caller does not need x afterwards.
void qk_norm_rope_forward(bf16* out, float* rstd, const bf16* x, const bf16* w, const float* cos,
                          const float* sin, const std::int32_t* pos, int B, int Tn, int heads,
                          int hd, double eps, cudaStream_t stream);

// Bytes of device scratch for qk_norm_rope_backward (dw partials, at most 1024 * 4 * hd).
std::size_t qk_norm_rope_backward_workspace_bytes(int B, int Tn, int heads, int hd);

// From dout (the gradient of out) and the forward's x and rstd, in fp32:
//   dy = the inverse rotation of dout (bf16 c, s as in the forward)
//   dx = r * (w*dy - xhat * mean(w*dy*xhat)),  xhat = float(x) * r     bf16 written; may alias dout
//   dw += sum over (b, t, head) of dy * xhat                            [hd] fp32 accumulated
// (skipped when dw is null: a frozen weight; accumulate false: dw = the sum, not read), deterministically (fixed-order partial sums per block, then over blocks). No float atomics.
void qk_norm_rope_backward(bf16* dx, float* dw, const bf16* dout, const bf16* x, const bf16* w,
                           const float* rstd, const float* cos, const float* sin,
                           const std::int32_t* pos, int B, int Tn, int heads, int hd,
                           void* workspace, cudaStream_t stream, bool accumulate = true);

// Strided forms: consecutive tokens of x (and of dx) are `x_ld` (`dx_ld`) elements apart, so q
// and k can be read from, and their gradients written into, one [N, Q + 2 KV] buffer made by one
// GEMM against the adjacent q/k/v_proj weights. out, rstd and dout stay contiguous. Each ld is a
// multiple of 8 and >= heads * hd; a strided dx must not alias dout, a strided x not out.
void qk_norm_rope_forward_strided(bf16* out, float* rstd, const bf16* x, int x_ld, const bf16* w,
                                  const float* cos, const float* sin, const std::int32_t* pos,
                                  int B, int Tn, int heads, int hd, double eps,
                                  cudaStream_t stream);
void qk_norm_rope_backward_strided(bf16* dx, int dx_ld, float* dw, const bf16* dout,
                                   const bf16* x, int x_ld, const bf16* w, const float* rstd,
                                   const float* cos, const float* sin, const std::int32_t* pos,
                                   int B, int Tn, int heads, int hd, void* workspace,
                                   cudaStream_t stream, bool accumulate = true);

}  // namespace qt::cuda
