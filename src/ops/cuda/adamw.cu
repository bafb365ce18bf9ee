// Fused AdamW and the gradient sum of squares; see adamw.cuh. The element update, bit for bit the
// CPU optimizer's, is in adamw_math.cuh.
#include <cmath>

#include "ops/cuda/adamw.cuh"
#include "ops/cuda/adamw_math.cuh"
#include "ops/cuda/common.cuh"
#include "optim/adamw_math.h"

namespace qt::cuda {

static constexpr int kThreads = 256;
static constexpr int kNormThreads = 256;
static constexpr int kNormMaxBlocks = kMaxPartials;
static constexpr int kNormFinalThreads = 1024;  // >= kNormMaxBlocks

// Index of the last segment with begin <= i, or -1.
static __device__ __forceinline__ int find_segment(const AdamWSegment* seg, int ns,
                                                   std::uint64_t i) {
  int lo = 0, hi = ns;  // answer in [lo - 1, hi - 1]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (seg[mid].begin <= i)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo - 1;
}

// Thread t updates elements [4t, 4t + 4): float4 / 4 x bf16 vectors when kVec and all 4 exist.
template <bool kVec>
static __global__ void adamw_step_kernel(float* params, bf16* params_bf16, float* m, float* v,
                                         const float* __restrict__ grads, std::size_t n,
                                         std::size_t offset,
                                         const AdamWSegment* __restrict__ segments, int ns,
                                         AdamWConsts k) {
  const std::size_t e = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (e >= n) return;
  float p4[4], m4[4], v4[4], g4[4];
  const bool vec = kVec && e + 4 <= n;
  if (vec) {
    const float4 a = *reinterpret_cast<const float4*>(params + e);
    const float4 b = *reinterpret_cast<const float4*>(m + e);
    const float4 c = *reinterpret_cast<const float4*>(v + e);
    const float4 d = __ldg(reinterpret_cast<const float4*>(grads + e));
    p4[0] = a.x, p4[1] = a.y, p4[2] = a.z, p4[3] = a.w;
    m4[0] = b.x, m4[1] = b.y, m4[2] = b.z, m4[3] = b.w;
    v4[0] = c.x, v4[1] = c.y, v4[2] = c.z, v4[3] = c.w;
    g4[0] = d.x, g4[1] = d.y, g4[2] = d.z, g4[3] = d.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool in = e + i < n;
      p4[i] = in ? params[e + i] : 0.0f;
      m4[i] = in ? m[e + i] : 0.0f;
      v4[i] = in ? v[e + i] : 0.0f;
      g4[i] = in ? grads[e + i] : 0.0f;
    }
  }
  const std::uint64_t g0 = offset + e;
  int s = find_segment(segments, ns, g0);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::uint64_t gi = g0 + i;
    while (s + 1 < ns && segments[s + 1].begin <= gi) ++s;
    const bool decay = s >= 0 && gi < segments[s].end && segments[s].decay != 0;
    adamw_element(p4[i], m4[i], v4[i], g4[i], decay, k);
  }
  if (vec) {
    *reinterpret_cast<float4*>(params + e) = make_float4(p4[0], p4[1], p4[2], p4[3]);
    *reinterpret_cast<float4*>(m + e) = make_float4(m4[0], m4[1], m4[2], m4[3]);
    *reinterpret_cast<float4*>(v + e) = make_float4(v4[0], v4[1], v4[2], v4[3]);
    if (params_bf16 != nullptr) {
      uint2 u;
      reinterpret_cast<__nv_bfloat162*>(&u)[0] = __floats2bfloat162_rn(p4[0], p4[1]);
      reinterpret_cast<__nv_bfloat162*>(&u)[1] = __floats2bfloat162_rn(p4[2], p4[3]);
      *reinterpret_cast<uint2*>(params_bf16 + e) = u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (e + i >= n) break;
      params[e + i] = p4[i];
      m[e + i] = m4[i];
      v[e + i] = v4[i];
      if (params_bf16 != nullptr) params_bf16[e + i] = __float2bfloat16_rn(p4[i]);
    }
  }
}

void adamw_step(float* params, bf16* params_bf16, float* m, float* v, const float* grads,
                std::size_t n, std::size_t offset, const AdamWSegment* segments, int num_segments,
                const AdamWStepArgs& a, cudaStream_t stream) {
  QT_CUDA_REQUIRE(
      num_segments >= 0 && (num_segments == 0 || segments != nullptr),
      "adamw_step: segments must hold num_segments entries, got " + std::to_string(num_segments));
  QT_CUDA_REQUIRE(a.step >= 1, "adamw_step: step is 1-based, got " + std::to_string(a.step));
  if (n == 0) return;
  AdamWConsts k;
  k.b1 = a.beta1;
  k.b2 = a.beta2;
  k.one_minus_b1 = 1.0 - a.beta1;
  k.one_minus_b2 = 1.0 - a.beta2;
  k.eps = a.eps;
  k.clip = a.clip_scale;
  qt::adamw_bias_terms(a.lr, a.beta1, a.beta2, a.step, &k.step_size, &k.inv_sqrt_bc2);
  k.decay = static_cast<float>(a.lr * a.weight_decay);
  const bool vec = is_aligned16(params) && is_aligned16(m) && is_aligned16(v) &&
                   is_aligned16(grads) && (reinterpret_cast<std::uintptr_t>(params_bf16) & 7u) == 0;
  const auto grid =
      static_cast<unsigned int>(ceil_div<std::size_t>(ceil_div<std::size_t>(n, 4), kThreads));
  if (vec)
    adamw_step_kernel<true><<<grid, kThreads, 0, stream>>>(params, params_bf16, m, v, grads, n,
                                                           offset, segments, num_segments, k);
  else
    adamw_step_kernel<false><<<grid, kThreads, 0, stream>>>(params, params_bf16, m, v, grads, n,
                                                            offset, segments, num_segments, k);
  QT_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------------
// Sum of squares

static int norm_blocks(std::size_t n) {
  return static_cast<int>(std::max<std::size_t>(
      1, std::min<std::size_t>(ceil_div<std::size_t>(n, kNormThreads * 8), kNormMaxBlocks)));
}

// Block b sums chunks of 8 elements c = b * kNormThreads + t, then every gridDim.x *
// kNormThreads chunks, into partial[b] (double; a float product is exact in double).
template <bool kVec>
static __global__ void __launch_bounds__(kNormThreads)
    sum_squares_kernel(double* __restrict__ partial, const float* __restrict__ x, std::size_t n) {
  __shared__ double smem[32];
  double acc[1] = {0.0};
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kNormThreads * 8;
  for (std::size_t e = (static_cast<std::size_t>(blockIdx.x) * kNormThreads + threadIdx.x) * 8;
       e < n; e += stride) {
    float f[8];
    if (kVec && e + 8 <= n) {
      load_f32x8(x + e, f);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = e + i < n ? x[e + i] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[0] += static_cast<double>(f[i]) * f[i];
  }
  block_sum<1>(acc, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc[0];
}

static __global__ void __launch_bounds__(kNormFinalThreads)
    sum_partials_kernel(double* out, const double* __restrict__ partial, int G) {
  __shared__ double smem[32];
  double acc[1] = {threadIdx.x < G ? partial[threadIdx.x] : 0.0};
  block_sum<1>(acc, smem);
  if (threadIdx.x == 0) *out = acc[0];
}

std::size_t grad_norm_workspace_bytes() { return (kNormMaxBlocks + 2) * sizeof(double); }

void grad_norm_squared(double* out, const float* x, std::size_t n, void* workspace,
                       cudaStream_t stream) {
  QT_CUDA_REQUIRE(workspace != nullptr && (reinterpret_cast<std::uintptr_t>(workspace) & 7u) == 0,
                  std::string("grad_norm_squared: workspace must be 8-byte aligned device memory"));
  double* partial = static_cast<double*>(workspace);
  const int G = norm_blocks(n);
  if (is_aligned16(x))
    sum_squares_kernel<true><<<G, kNormThreads, 0, stream>>>(partial, x, n);
  else
    sum_squares_kernel<false><<<G, kNormThreads, 0, stream>>>(partial, x, n);
  QT_CHECK_LAUNCH();
  sum_partials_kernel<<<1, kNormFinalThreads, 0, stream>>>(out, partial, G);
  QT_CHECK_LAUNCH();
}

double grad_norm_squared_sync(const float* x, std::size_t n, void* workspace, cudaStream_t stream) {
  double* result = static_cast<double*>(workspace) + kNormMaxBlocks;
  grad_norm_squared(result, x, n, workspace, stream);
  double host = 0.0;
  QT_CHECK_CUDA(cudaMemcpyAsync(&host, result, sizeof(double), cudaMemcpyDeviceToHost, stream));
  QT_CHECK_CUDA(cudaStreamSynchronize(stream));
  return host;
}

}  // namespace qt::cuda
