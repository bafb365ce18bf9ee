// The experts' grouped linear layers (grouped_gemm.h) on the device-side grouped GEMM kernels.
#include "cuda/grouped_gemm.h"

#include "ops/cuda/grouped_gemm.cuh"

namespace qt::cuda {

void grouped_linear(bf16* y, const bf16* x, const bf16* w, const int* offsets, int groups,
                    int rows, int in, int out, cudaStream_t stream, float alpha, bool accumulate) {
  grouped_gemm_forward(y, x, w, offsets, groups, rows, in, out, stream, alpha, accumulate);
}

void grouped_linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                             const int* offsets, int groups, int rows, int in, int out,
                             cudaStream_t stream, bool accumulate, float alpha,
                             bool accumulate_dx) {
  if (dx)
    grouped_gemm_backward_data(dx, dy, w, offsets, groups, rows, in, out, stream, alpha,
                               accumulate_dx);
  if (dw)
    grouped_gemm_backward_weight(dw, dy, x, offsets, groups, in, out, accumulate, stream, alpha);
}

}  // namespace qt::cuda
