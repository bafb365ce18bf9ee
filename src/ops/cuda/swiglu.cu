// SwiGLU forward and backward; see swiglu.cuh. One thread per 8 consecutive elements (one
// 16-byte vector of each tensor); the last partial vector, or everything when a pointer is not
// 16-byte aligned, goes element by element. Element e of the [N, I] result is row e / I, column
// e % I; gate and up rows are `ld` apart (ld == I: contiguous). The vector path needs I % 8 == 0
// when ld != I, so that a vector never crosses a row.
#include "ops/cuda/common.cuh"
#include "ops/cuda/swiglu.cuh"

namespace qt::cuda {

static constexpr int kThreads = 256;

static __device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// Loads 8 elements starting at e: a vector when kVec and all 8 exist, else one by one (zeros
// past n). Coherent loads: outputs may alias inputs.
// Position of element e of an [N, I] tensor whose rows are ld apart.
static __device__ __forceinline__ std::size_t at(std::size_t e, std::size_t I, std::size_t ld) {
  return ld == I ? e : (e / I) * ld + e % I;
}

template <bool kVec>
static __device__ __forceinline__ void load8(const bf16* p, std::size_t e, std::size_t n,
                                             std::size_t I, std::size_t ld, float (&f)[8]) {
  if (kVec && e + 8 <= n) {
    load_bf16x8_rw(p + at(e, I, ld), f);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = e + i < n ? __bfloat162float(p[at(e + i, I, ld)]) : 0.0f;
}

template <bool kVec>
static __device__ __forceinline__ void store8(bf16* p, std::size_t e, std::size_t n,
                                              std::size_t I, std::size_t ld, const float (&f)[8]) {
  if (kVec && e + 8 <= n) {
    store_bf16x8(p + at(e, I, ld), f);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (e + i < n) p[at(e + i, I, ld)] = __float2bfloat16_rn(f[i]);
}

template <bool kVec>
static __global__ void swiglu_forward_kernel(bf16* h, const bf16* gate, const bf16* up,
                                             std::size_t n, std::size_t I, std::size_t ld) {
  const std::size_t e = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (e >= n) return;
  float g[8], u[8], o[8];
  load8<kVec>(gate, e, n, I, ld, g);
  load8<kVec>(up, e, n, I, ld, u);
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = round_bf16(silu(g[i])) * u[i];
  store8<kVec>(h, e, n, I, I, o);
}

template <bool kVec>
static __global__ void swiglu_backward_kernel(bf16* dgate, bf16* dup, const bf16* dh,
                                              const bf16* gate, const bf16* up, std::size_t n,
                                              std::size_t I, std::size_t ld) {
  const std::size_t e = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (e >= n) return;
  float d[8], g[8], u[8], dg[8], du[8];
  load8<kVec>(dh, e, n, I, I, d);
  load8<kVec>(gate, e, n, I, ld, g);
  load8<kVec>(up, e, n, I, ld, u);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float s = 1.0f / (1.0f + expf(-g[i]));
    dg[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    du[i] = d[i] * round_bf16(silu(g[i]));
  }
  store8<kVec>(dgate, e, n, I, ld, dg);
  store8<kVec>(dup, e, n, I, ld, du);
}

static void check_shape(const char* op, int N, int I, int ld) {
  QT_CUDA_REQUIRE(N >= 0 && I >= 0 && ld >= I,
                  std::string(op) + ": need N, I >= 0 and ld >= I, got N=" + std::to_string(N) +
                      " I=" + std::to_string(I) + " ld=" + std::to_string(ld));
}

static unsigned int grid_for(std::size_t n) {
  return static_cast<unsigned int>(ceil_div<std::size_t>(ceil_div<std::size_t>(n, 8), kThreads));
}

// Vectors never cross a row of a strided tensor.
static bool rows_vectorisable(int I, int ld) { return ld == I || (I % 8 == 0 && ld % 8 == 0); }

void swiglu_forward_strided(bf16* h, const bf16* gate, const bf16* up, int ld, int N, int I,
                            cudaStream_t stream) {
  check_shape("swiglu_forward", N, I, ld);
  const std::size_t n = static_cast<std::size_t>(N) * I;
  if (n == 0) return;
  if (is_aligned16(h) && is_aligned16(gate) && is_aligned16(up) && rows_vectorisable(I, ld))
    swiglu_forward_kernel<true><<<grid_for(n), kThreads, 0, stream>>>(h, gate, up, n, I, ld);
  else
    swiglu_forward_kernel<false><<<grid_for(n), kThreads, 0, stream>>>(h, gate, up, n, I, ld);
  QT_CHECK_LAUNCH();
}

void swiglu_backward_strided(bf16* dgate, bf16* dup, const bf16* dh, const bf16* gate,
                             const bf16* up, int ld, int N, int I, cudaStream_t stream) {
  check_shape("swiglu_backward", N, I, ld);
  const std::size_t n = static_cast<std::size_t>(N) * I;
  if (n == 0) return;
  if (is_aligned16(dgate) && is_aligned16(dup) && is_aligned16(dh) && is_aligned16(gate) &&
      is_aligned16(up) && rows_vectorisable(I, ld))
    swiglu_backward_kernel<true>
        <<<grid_for(n), kThreads, 0, stream>>>(dgate, dup, dh, gate, up, n, I, ld);
  else
    swiglu_backward_kernel<false>
        <<<grid_for(n), kThreads, 0, stream>>>(dgate, dup, dh, gate, up, n, I, ld);
  QT_CHECK_LAUNCH();
}

void swiglu_forward(bf16* h, const bf16* gate, const bf16* up, int N, int I, cudaStream_t stream) {
  swiglu_forward_strided(h, gate, up, I, N, I, stream);
}

void swiglu_backward(bf16* dgate, bf16* dup, const bf16* dh, const bf16* gate, const bf16* up,
                     int N, int I, cudaStream_t stream) {
  swiglu_backward_strided(dgate, dup, dh, gate, up, I, N, I, stream);
}

}  // namespace qt::cuda
