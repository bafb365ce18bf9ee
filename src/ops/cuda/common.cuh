// Device helpers shared by the memory-bound CUDA ops (include from .cu files only): 16-byte
// vectors of 8 bf16 or 4 fp32, warp and block sums in a fixed order, and the argument check used
// by the host launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.h"

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// A launcher's contract is broken (bad shape, misaligned pointer): a bug in the caller, thrown
// as std::invalid_argument (as the GEMM wrappers do) with the op, the argument and its value in
// `msg` (a std::string expression, built only on failure) and the failed condition.
#define QT_CUDA_REQUIRE(cond, msg)                                                       \
  do {                                                                                   \
    if (!(cond)) throw std::invalid_argument(std::string(msg) + " (failed: " #cond ")"); \
  } while (0)

inline bool is_aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

template <typename I>
__host__ __device__ constexpr I ceil_div(I a, I b) {
  return (a + b - 1) / b;
}

// Rows per block of the column-sum kernel below and the largest grid the deterministic
// reductions use; partial buffers are [kMaxPartials, C].
inline constexpr int kMaxPartials = 1024;

// ---------------------------------------------------------------------------------------------
// 16-byte vectors. Pointers must be 16-byte aligned.

// The 8 bf16 of a 16-byte vector (already loaded) -> 8 floats.
__device__ __forceinline__ void unpack_bf16x8(const uint4& u, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// 8 bf16 at p -> 8 floats (read-only path).
__device__ __forceinline__ void load_bf16x8(const bf16* p, float (&f)[8]) {
  unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p)), f);
}

// 8 bf16 at p -> 8 floats, through the ordinary (coherent) path: for data this kernel may also
// write (an output that aliases an input).
__device__ __forceinline__ void load_bf16x8_rw(const bf16* p, float (&f)[8]) {
  unpack_bf16x8(*reinterpret_cast<const uint4*>(p), f);
}

// 8 floats -> 8 bf16 (round to nearest even) at p.
__device__ __forceinline__ void store_bf16x8(bf16* p, const float (&f)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Rounds a float to the nearest bf16 and back: the rounding points of the transformers forward.
__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

__device__ __forceinline__ void load_f32x8(const float* p, float (&f)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
  f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

__device__ __forceinline__ void store_f32x8(float* p, const float (&f)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// ---------------------------------------------------------------------------------------------
// Reductions in a fixed order (the same bits on every run).

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums each of R values over the whole block; every thread gets the totals. smem holds R * 32
// values of T. Ends with a barrier, so smem may be reused at once. Call from every thread.
template <int R, typename T>
__device__ __forceinline__ void block_sum(T (&v)[R], T* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    v[r] = warp_sum(v[r]);
    if (lane == 0) smem[r * 32 + warp] = v[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r) {
    T s = 0;
    for (int w = 0; w < nwarps; ++w) s += smem[r * 32 + w];
    v[r] = s;
  }
  __syncthreads();
}

// dw[c] += sum over g = 0..G-1 of partial[g, c], in a fixed order: the second pass of every
// deterministic weight-gradient reduction. partial [G, C] fp32, dw [C] fp32. accumulate false:
// dw[c] = the sum (dw is not read).
void column_sum_accumulate(float* dw, const float* partial, int G, int C, cudaStream_t stream,
                           bool accumulate = true);

}  // namespace qt::cuda
