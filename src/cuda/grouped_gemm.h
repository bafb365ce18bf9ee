// The experts' linear layers of a Qwen3-MoE block over expert-ordered rows (ops/cuda/moe.cuh's
// routing): group g is rows [sum of counts[0..g), + counts[g]) of x and y, multiplied by its own
// weight w[g] [out, in]. The contract of qt::cuda::linear_* (src/ops/cuda/gemm.cuh) per group.
//
// This first version is a loop of cuBLASLt GEMMs, one per group with rows, which needs the
// counts on the host (the MoE op copies them there once per layer's forward: one stream
// synchronisation). A device-side grouped GEMM that reads the counts on the GPU can replace it
// behind these two functions without touching their callers. Host code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// y [rows, out] group g = x [rows, in] group g * w[g]^T, w [groups, out, in]; rows = the sum of
// counts (host [groups]). y written (groups without rows: nothing).
void grouped_linear(bf16* y, const bf16* x, const bf16* w, const int* counts, int groups, int in,
                    int out, cudaStream_t stream);

// dx [rows, in] group g = dy group g * w[g] (written; skipped when dx is null);
// dw[g] [out, in] += dy group g^T * x group g (fp32; accumulate false: written, a group without
// rows gets zeros).
void grouped_linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                             const int* counts, int groups, int in, int out, cudaStream_t stream,
                             bool accumulate);

}  // namespace qt::cuda
