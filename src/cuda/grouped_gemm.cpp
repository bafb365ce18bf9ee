// The experts' grouped linear layers as one cuBLASLt GEMM per group with rows (grouped_gemm.h).
#include "cuda/grouped_gemm.h"

#include <cstddef>

#include "cuda/check.h"
#include "ops/cuda/gemm.cuh"
#include "qtrain/error.h"

namespace qt::cuda {

void grouped_linear(bf16* y, const bf16* x, const bf16* w, const int* counts, int groups, int in,
                    int out, cudaStream_t stream) {
  std::size_t row = 0;
  for (int g = 0; g < groups; ++g) {
    const int n = counts[g];
    QT_CHECK(n >= 0, "group {} of {} has {} rows", g, groups, n);
    if (n > 0)
      linear_forward(y + row * out, x + row * in, w + static_cast<std::size_t>(g) * out * in, n,
                     in, out, stream);
    row += static_cast<std::size_t>(n);
  }
}

void grouped_linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                             const int* counts, int groups, int in, int out, cudaStream_t stream,
                             bool accumulate) {
  const std::size_t wsize = static_cast<std::size_t>(out) * in;
  std::size_t row = 0;
  for (int g = 0; g < groups; ++g) {
    const int n = counts[g];
    QT_CHECK(n >= 0, "group {} of {} has {} rows", g, groups, n);
    float* dwg = dw ? dw + static_cast<std::size_t>(g) * wsize : nullptr;
    if (n > 0) {
      linear_backward(dx ? dx + row * in : nullptr, dwg, dy + row * out, x + row * in,
                      w + static_cast<std::size_t>(g) * wsize, n, in, out, stream, accumulate);
    } else if (dwg && !accumulate) {  // written: an expert without tokens has a zero gradient
      QT_CHECK_CUDA(cudaMemsetAsync(dwg, 0, wsize * sizeof(float), stream));
    }
    row += static_cast<std::size_t>(n);
  }
}

}  // namespace qt::cuda
