// Elementwise bf16 addition for the residual stream's gradients.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// y[k] = bf16(float(y[k]) + float(x[k])), k < n (fp32 add, one rounding). y and x do not overlap.
void add_inplace(bf16* y, const bf16* x, std::size_t n, cudaStream_t stream);

}  // namespace qt::cuda
