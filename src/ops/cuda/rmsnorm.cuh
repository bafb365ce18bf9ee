// RMSNorm on the GPU, bf16 activations, in the transformers order (qwen3-spec.md 2.2):
//   rstd = 1 / sqrt(mean(float(x)^2) + eps)          (fp32, saved for the backward)
//   y    = bf16(w * bf16(float(x) * rstd))            (normalise, round, then weight multiply)
// Contracts mirror qt::cpu::rmsnorm_* (src/ops/rmsnorm.h), stream last.
// Every row of C bf16 is handled by one block, a 16-byte vector of 8 columns per thread, so:
// C % 8 == 0, C <= 8192, and every pointer 16-byte aligned. Any N >= 0. Violations throw
// std::invalid_argument.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// x, y: [N, C] bf16; w: [C] bf16; rstd: [N] fp32. y and rstd written; y must not alias x.
void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* w, int N, int C, double eps,
                     cudaStream_t stream);

// The pre-norm residual add fused with the next norm, one pass over the rows:
//   residual_out = bf16(residual_in + x)                      [N, C] written
//   y, rstd      = rmsnorm_forward(residual_out, w, eps)      [N, C], [N] written
// residual_out may alias residual_in (the residual stream updated in place); y aliases neither.
void residual_rmsnorm_forward(bf16* residual_out, bf16* y, float* rstd, const bf16* residual_in,
                              const bf16* x, const bf16* w, int N, int C, double eps,
                              cudaStream_t stream);

// Bytes of device scratch that rmsnorm_backward needs for N rows of C (per-block partial sums of
// dw; at most 1024 * 4 * C).
std::size_t rmsnorm_backward_workspace_bytes(int N, int C);

// With xhat = float(x) * rstd (unrounded) and fp32 math:
//   dx = rstd * (w*dy - xhat * mean(w*dy*xhat))     [N, C] bf16 written; dx may alias dy
//   dw += sum_n dy * xhat                            [C] fp32 accumulated; skipped when dw is null
//                                                    (accumulate false: dw = the sum, not read)
// dw is reduced deterministically (fixed-order partial sums per block in `workspace`, then a
// fixed-order sum over blocks): the same bits on every run. No float atomics.
void rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                      const float* rstd, int N, int C, void* workspace, cudaStream_t stream,
                      bool accumulate = true);

// The backward of a pre-norm branch added to the residual stream's gradient in one pass:
//   dres = bf16(float(dres) + rmsnorm_backward's dx)   [N, C] read and written in place
//   dw as rmsnorm_backward.
// One rounding instead of two (rmsnorm_backward into a buffer, then an add). dres must not alias
// dy or x.
void residual_rmsnorm_backward(bf16* dres, float* dw, const bf16* dy, const bf16* x,
                               const bf16* w, const float* rstd, int N, int C, void* workspace,
                               cudaStream_t stream, bool accumulate = true);

}  // namespace qt::cuda
