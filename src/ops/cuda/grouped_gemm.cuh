// Grouped GEMMs of the Qwen3-MoE experts on the GPU, one launch for all groups, with the groups'
// rows read from DEVICE memory (no host synchronisation): bf16 inputs, fp32 accumulation
// (mma.sync m16n8k16), row-major. Group g owns rows [offsets[g], offsets[g + 1]) of the
// row-indexed tensors (offsets [groups + 1] on the device: 0, then the inclusive sums of the
// counts, as moe_route writes them) and its own weight w[g] [out, in].
//
// rows = offsets[groups] (the host knows the total: N k pairs; only the grid's size depends on
// it). Groups may have any number of rows, zero included; any in and out (the fast loads want
// multiples of 8 and 16-byte aligned pointers; otherwise an element-wise path, for small test
// shapes). Bad arguments throw std::invalid_argument.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// Each product is scaled by alpha (fp32, before rounding); accumulate adds it to the output's
// old value (a bf16 output read and summed in fp32, rounded once), else the output is written.

// y [rows, out]: group g's rows = alpha x [rows, in] group g's rows * w[g]^T, w [groups, out, in].
void grouped_gemm_forward(bf16* y, const bf16* x, const bf16* w, const int* offsets, int groups,
                          int rows, int in, int out, cudaStream_t stream, float alpha = 1.f,
                          bool accumulate = false);

// dx [rows, in]: group g's rows = alpha dy [rows, out] group g's rows * w[g].
void grouped_gemm_backward_data(bf16* dx, const bf16* dy, const bf16* w, const int* offsets,
                                int groups, int rows, int in, int out, cudaStream_t stream,
                                float alpha = 1.f, bool accumulate = false);

// dw[g] [out, in] (fp32) = alpha dy group g^T * x group g, the sum over the group's rows;
// accumulate false: a group without rows gets zeros (true: keeps its old value).
void grouped_gemm_backward_weight(float* dw, const bf16* dy, const bf16* x, const int* offsets,
                                  int groups, int in, int out, bool accumulate,
                                  cudaStream_t stream, float alpha = 1.f);

// Which kernel runs the products, for the whole process (tests and benchmarks compare them):
// kAuto (the default) the sm_90a wgmma kernel where the build and the GPU have it and the shapes
// allow it (in, out multiples of 8, 16-byte aligned pointers), else the mma.sync kernel; kMma
// always the latter; kWgmma always the former (throws where it cannot run).
enum class GroupedGemmKernel { kAuto, kMma, kWgmma };
void set_grouped_gemm_kernel(GroupedGemmKernel kernel);

}  // namespace qt::cuda
