// The experts' linear layers of a Qwen3-MoE block over expert-ordered rows (ops/cuda/moe.cuh's
// routing): group g is rows [offsets[g], offsets[g + 1]) of x and y, multiplied by its own
// weight w[g] [out, in]. The contract of qt::cuda::linear_* (src/ops/cuda/gemm.cuh) per group.
//
// The offsets ([groups + 1], device memory, as moe_route writes them) stay on the GPU: each
// product is one launch of ops/cuda/grouped_gemm.cuh's kernels over all groups, with no host
// synchronisation; rows = offsets[groups] is the total the caller knows (N k pairs). Host code
// only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// y [rows, out] group g = alpha x [rows, in] group g * w[g]^T, w [groups, out, in]; y written,
// or with accumulate added to (LoRA's terms on the experts' outputs).
void grouped_linear(bf16* y, const bf16* x, const bf16* w, const int* offsets, int groups,
                    int rows, int in, int out, cudaStream_t stream, float alpha = 1.f,
                    bool accumulate = false);

// dx [rows, in] group g = alpha dy group g * w[g] (written, or added to with accumulate_dx;
// skipped when dx is null); dw[g] [out, in] += alpha dy group g^T * x group g (fp32; skipped
// when dw is null; accumulate false: written, a group without rows gets zeros).
void grouped_linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                             const int* offsets, int groups, int rows, int in, int out,
                             cudaStream_t stream, bool accumulate, float alpha = 1.f,
                             bool accumulate_dx = false);

}  // namespace qt::cuda
