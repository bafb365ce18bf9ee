// Precision conversions of flat buffers on the GPU: the fp32 master weights to their bf16 compute
// copy (round to nearest even; NaN stays NaN, overflow becomes Inf) and bf16 back to fp32
// (exact). Any n; 16-byte vectors when both pointers are 16-byte aligned, scalar otherwise.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// dst[k] = bf16(src[k]), k < n. dst [n] bf16, src [n] fp32, not overlapping.
void convert_f32_to_bf16(bf16* dst, const float* src, std::size_t n, cudaStream_t stream);

// dst[k] = float(src[k]), k < n. dst [n] fp32, src [n] bf16, not overlapping.
void convert_bf16_to_f32(float* dst, const bf16* src, std::size_t n, cudaStream_t stream);

// dst[k] += src[k], k < n (fp32; accumulates reduced gradient shards over micro-batches).
void add_f32(float* dst, const float* src, std::size_t n, cudaStream_t stream);

// dst[k] = bf16(float(a[k]) + float(b[k])), k < n (a pipeline stage's last residual add; dst may
// alias a or b).
void add_bf16(bf16* dst, const bf16* a, const bf16* b, std::size_t n, cudaStream_t stream);

}  // namespace qt::cuda
