// fp32 <-> bf16 conversions; see convert.cuh. One thread per 8 elements (two float4 and one
// 16-byte bf16 vector); the last partial chunk, or a misaligned buffer, element by element.
#include "ops/cuda/common.cuh"
#include "ops/cuda/convert.cuh"

namespace qt::cuda {

static constexpr int kThreads = 256;

template <bool kVec>
static __global__ void convert_f32_to_bf16_kernel(bf16* __restrict__ dst,
                                                  const float* __restrict__ src, std::size_t n) {
  const std::size_t e = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (e >= n) return;
  if (kVec && e + 8 <= n) {
    float f[8];
    load_f32x8(src + e, f);
    store_bf16x8(dst + e, f);
    return;
  }
  for (std::size_t i = e; i < e + 8 && i < n; ++i) dst[i] = __float2bfloat16_rn(src[i]);
}

template <bool kVec>
static __global__ void convert_bf16_to_f32_kernel(float* __restrict__ dst,
                                                  const bf16* __restrict__ src, std::size_t n) {
  const std::size_t e = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (e >= n) return;
  if (kVec && e + 8 <= n) {
    float f[8];
    load_bf16x8(src + e, f);
    store_f32x8(dst + e, f);
    return;
  }
  for (std::size_t i = e; i < e + 8 && i < n; ++i) dst[i] = __bfloat162float(src[i]);
}

template <bool kVec>
static __global__ void add_f32_kernel(float* __restrict__ dst, const float* __restrict__ src,
                                      std::size_t n) {
  const std::size_t e = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (e >= n) return;
  if (kVec && e + 8 <= n) {
    float a[8], b[8];
    load_f32x8(dst + e, a);
    load_f32x8(src + e, b);
    for (int i = 0; i < 8; ++i) a[i] += b[i];
    store_f32x8(dst + e, a);
    return;
  }
  for (std::size_t i = e; i < e + 8 && i < n; ++i) dst[i] += src[i];
}

static unsigned int grid_for(std::size_t n) {
  return static_cast<unsigned int>(ceil_div<std::size_t>(ceil_div<std::size_t>(n, 8), kThreads));
}

void convert_f32_to_bf16(bf16* dst, const float* src, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (is_aligned16(dst) && is_aligned16(src))
    convert_f32_to_bf16_kernel<true><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  else
    convert_f32_to_bf16_kernel<false><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  QT_CHECK_LAUNCH();
}

void convert_bf16_to_f32(float* dst, const bf16* src, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (is_aligned16(dst) && is_aligned16(src))
    convert_bf16_to_f32_kernel<true><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  else
    convert_bf16_to_f32_kernel<false><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  QT_CHECK_LAUNCH();
}

// One thread per 8 elements: dst = bf16(float(a) + float(b)), as residual_rmsnorm_forward's sum.
static __global__ void add_bf16_kernel(bf16* dst, const bf16* a, const bf16* b, std::size_t n) {
  const std::size_t e = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  for (std::size_t i = e; i < e + 8 && i < n; ++i)
    dst[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

void add_bf16(bf16* dst, const bf16* a, const bf16* b, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(dst, a, b, n);
  QT_CHECK_LAUNCH();
}

void add_f32(float* dst, const float* src, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (is_aligned16(dst) && is_aligned16(src))
    add_f32_kernel<true><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  else
    add_f32_kernel<false><<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  QT_CHECK_LAUNCH();
}

}  // namespace qt::cuda
