// The experts' grouped linear layers (grouped_gemm.h) on the device-side grouped GEMM kernels.
#include "cuda/grouped_gemm.h"

#include "ops/cuda/grouped_gemm.cuh"

namespace qt::cuda {

void grouped_linear(bf16* y, const bf16* x, const bf16* w, const int* offsets, int groups,
                    int rows, int in, int out, cudaStream_t stream) {
  grouped_gemm_forward(y, x, w, offsets, groups, rows, in, out, stream);
}

void grouped_linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                             const int* offsets, int groups, int rows, int in, int out,
                             cudaStream_t stream, bool accumulate) {
  if (dx) grouped_gemm_backward_data(dx, dy, w, offsets, groups, rows, in, out, stream);
  if (dw) grouped_gemm_backward_weight(dw, dy, x, offsets, groups, in, out, accumulate, stream);
}

}  // namespace qt::cuda
