// GEMM and the bias-free linear layer on the GPU through cuBLASLt: bf16 A and B, fp32 accumulation
// (CUBLAS_COMPUTE_32F), fp32 alpha/beta, output bf16 or fp32. Row-major like qt::cpu::gemm and
// qt::cpu::linear_* (src/ops/gemm.h, src/ops/linear.h), with the stream last.
//
// Alignment: every pointer must be aligned to its element size (2 bytes for bf16, 4 for fp32);
// any M, N, K and leading dimension (>= the row length) is accepted. The fast kernels want 16-byte
// aligned pointers and leading dimensions that are multiples of 8 elements (DeviceArena blocks are
// 256-byte aligned). Bad arguments throw std::invalid_argument naming the argument.
//
// Plans (descriptors and the heuristic's algorithm) are cached per shape, transposes, output type
// and pointer alignment, so after the first call of a shape a GEMM is one cublasLtMatmul. All GEMMs
// of a device share one workspace: issue them on one stream at a time, or order the streams.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

inline constexpr std::size_t kGemmWorkspaceBytes = std::size_t{32} << 20;

// Sets up cuBLASLt on the current device with a caller-owned workspace (e.g. an arena block of
// kGemmWorkspaceBytes) that must outlive every GEMM, or a self-allocated one when `workspace` is
// null; replaces an earlier set-up (synchronising the device first). Call it before the step
// loop: without it, the first GEMM on a device allocates its own 32 MiB workspace.
void gemm_init(void* workspace, std::size_t workspace_bytes);

// C[M,N] = alpha * op(A) * op(B) + beta * C, row-major; op(X) = X or X^T.
// A is [M,K] (or [K,M] if trans_a), B is [K,N] (or [N,K] if trans_b). With beta = 0, C is not read.
void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
          const bf16* B, int ldb, float beta, bf16* C, int ldc, cudaStream_t stream);
void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
          const bf16* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream);

// y[N, out] = x[N, in] * w[out, in]^T                    (y written, bf16)
void linear_forward(bf16* y, const bf16* x, const bf16* w, int N, int in, int out,
                    cudaStream_t stream);

// dx[N, in]   = dy[N, out] * w[out, in]                  (written, bf16; skipped when dx is null)
// dw[out, in] += dy^T[out, N] * x[N, in]                 (accumulated, fp32; skipped when dw is
//                                                         null: a frozen weight; accumulate
//                                                         false: written, dw not read)
void linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w, int N,
                     int in, int out, cudaStream_t stream, bool accumulate = true);

}  // namespace qt::cuda
