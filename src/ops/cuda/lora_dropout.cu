// LoRA dropout masks on the GPU; see lora_dropout.cuh. The counter-based generator is
// src/runtime/rng.h's, operation for operation: 64-bit integer mixing, then the uniform in double
// with explicitly rounded operations (no contraction), so the keep test is the CPU's bit for bit;
// the backward's multiply-add is rounded twice in fp32 as the CPU's is.
// One thread per 8 consecutive elements of a row.
#include "ops/cuda/common.cuh"
#include "ops/cuda/lora_dropout.cuh"

namespace qt::cuda {

namespace {

constexpr int kThreads = 256;

// rng::mix, rng::hash_combine and rng::uniform.
__device__ __forceinline__ std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ double uniform(std::uint64_t stream, std::uint64_t i) {
  const std::uint64_t bits = mix(stream ^ mix(i + 0x632BE59BD9B4E019ull));
  return __dmul_rn(__dadd_rn(static_cast<double>(bits >> 11), 0.5), 0x1.0p-53);
}

// The mask values of the 8 elements of row `row` starting at column c (of the input; mask
// column k.col0 + c of a mask row of `width` elements).
__device__ __forceinline__ void mask8(const LoraDropoutKey& k, int row, int c, int width,
                                      float (&m)[8]) {
  const std::uint64_t first =
      (static_cast<std::uint64_t>(k.first_row) + static_cast<std::uint64_t>(row)) *
          static_cast<std::uint64_t>(width) + static_cast<std::uint64_t>(k.col0) +
      static_cast<std::uint64_t>(c);
#pragma unroll
  for (int i = 0; i < 8; ++i) m[i] = uniform(k.stream, first + i) >= k.p ? k.keep_scale : 0.0f;
}

template <bool kBackward>
__global__ void __launch_bounds__(kThreads)
    lora_dropout_kernel(bf16* out, const bf16* in_ptr, int N, int in, LoraDropoutKey key) {
  const int vecs = in / 8, width = key.row_width > 0 ? key.row_width : in;
  const std::size_t total = static_cast<std::size_t>(N) * vecs;
  for (std::size_t v = blockIdx.x * static_cast<std::size_t>(kThreads) + threadIdx.x; v < total;
       v += static_cast<std::size_t>(gridDim.x) * kThreads) {
    const int row = static_cast<int>(v / vecs), c = static_cast<int>(v % vecs) * 8;
    const std::size_t off = static_cast<std::size_t>(row) * in + c;
    float m[8], x[8];
    mask8(key, row, c, width, m);
    load_bf16x8(in_ptr + off, x);
    if (kBackward) {
      float y[8];
      load_bf16x8_rw(out + off, y);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = __fadd_rn(y[i], __fmul_rn(x[i], m[i]));  // no FMA
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] *= m[i];
    }
    store_bf16x8(out + off, x);
  }
}

template <bool kBackward>
void launch(const char* op, bf16* out, const bf16* x, int N, int in, const LoraDropoutKey& key,
            cudaStream_t stream) {
  QT_CUDA_REQUIRE(N >= 0 && in > 0 && in % 8 == 0,
                  std::string(op) + ": in = " + std::to_string(in) + ", N = " + std::to_string(N));
  QT_CUDA_REQUIRE(is_aligned16(out) && is_aligned16(x),
                  std::string(op) + ": pointers must be 16-byte aligned");
  QT_CUDA_REQUIRE(key.p >= 0 && key.p < 1, std::string(op) + ": p = " + std::to_string(key.p));
  QT_CUDA_REQUIRE(key.row_width == 0 || (key.col0 >= 0 && key.col0 + in <= key.row_width),
                  std::string(op) + ": columns [" + std::to_string(key.col0) + ", +" +
                      std::to_string(in) + ") of mask rows of " + std::to_string(key.row_width));
  if (N == 0) return;
  const std::size_t vecs = static_cast<std::size_t>(N) * (in / 8);
  const int blocks = static_cast<int>(std::min<std::size_t>(ceil_div<std::size_t>(vecs, kThreads),
                                                            132 * 16));
  lora_dropout_kernel<kBackward><<<blocks, kThreads, 0, stream>>>(out, x, N, in, key);
  QT_CHECK_LAUNCH();
}

}  // namespace

void lora_dropout_forward(bf16* xd, const bf16* x, int N, int in, const LoraDropoutKey& key,
                          cudaStream_t stream) {
  launch<false>("lora_dropout_forward", xd, x, N, in, key, stream);
}

void lora_dropout_backward(bf16* dx, const bf16* d, int N, int in, const LoraDropoutKey& key,
                           cudaStream_t stream) {
  launch<true>("lora_dropout_backward", dx, d, N, in, key, stream);
}

}  // namespace qt::cuda
