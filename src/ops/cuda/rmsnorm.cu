// RMSNorm forward (plain and fused with the residual add) and backward; see rmsnorm.cuh.
// Layout: one block per group of rows; thread t owns columns [8t, 8t + 8) of every row (one
// 16-byte vector), so the block is C/8 threads rounded up to a warp. Row sums are block sums in a
// fixed order.
#include "ops/cuda/common.cuh"
#include "ops/cuda/rmsnorm.cuh"

namespace qt::cuda {

// Rows per block (forward) or per iteration (backward), R: 4 keeps 4 rows of loads in flight;
// rows of more than 4096 columns take blocks of more than 512 threads, whose registers allow
// only R = 1 (the launch bounds cap the registers so that such a block fits an SM).
static constexpr int kMaxC = 8192;
static constexpr int kWideC = 4096;

static int block_threads(int C) { return ceil_div(C / 8, 32) * 32; }
static int rows_per_block(int C) { return C > kWideC ? 1 : 4; }
static constexpr int max_threads(int R) { return R == 1 ? 1024 : 512; }

// The backward grid, also the rows of the dw partials: about one wave of resident blocks on a
// 132-SM Hopper. The R = 4 kernel takes 128 registers a thread, so an SM's 64K registers hold
// 512 threads (4 blocks of 128 threads for C = 1024, 2 of 256 for C = 2048, ...), and
// 65536 / threads blocks fill 132 SMs about once. A function of N and C only, so dw has the same
// bits on every run.
static int backward_blocks(int N, int C) {
  const int wave = std::clamp(65536 / block_threads(C), 128, 512);
  return std::max(1, std::min(ceil_div(N, rows_per_block(C)), wave));
}

static void check_shape(const char* op, int N, int C) {
  QT_CUDA_REQUIRE(N >= 0, std::string(op) + ": N must be >= 0, got " + std::to_string(N));
  QT_CUDA_REQUIRE(C > 0 && C % 8 == 0 && C <= kMaxC,
                  std::string(op) + ": C must be a positive multiple of 8 up to 8192, got " +
                      std::to_string(C));
}

static void check_aligned(const char* op, const char* name, const void* p) {
  QT_CUDA_REQUIRE(is_aligned16(p), std::string(op) + ": " + name + " must be 16-byte aligned");
}

// y = w * bf16(x * rstd); with kResidual, x is first replaced by bf16(residual_in + x), which is
// also stored to residual_out. Block b handles rows [b R, b R + R).
template <int R, bool kResidual>
static __global__ void __launch_bounds__(max_threads(R))
    rmsnorm_forward_kernel(bf16* __restrict__ y, float* __restrict__ rstd, bf16* residual_out,
                           const bf16* residual_in, const bf16* __restrict__ x,
                           const bf16* __restrict__ w, int N, int C, float eps) {
  __shared__ float smem[R * 32];
  const int c8 = threadIdx.x * 8;
  const bool active = c8 < C;
  const int row0 = blockIdx.x * R;
  float xv[R][8];
  float ss[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    ss[r] = 0.0f;
    const int row = row0 + r;
    if (active && row < N) {
      const std::size_t off = static_cast<std::size_t>(row) * C + c8;
      if constexpr (kResidual) {
        float a[8];
        load_bf16x8_rw(residual_in + off, a);
        load_bf16x8(x + off, xv[r]);
#pragma unroll
        for (int i = 0; i < 8; ++i) xv[r][i] = round_bf16(a[i] + xv[r][i]);
        store_bf16x8(residual_out + off, xv[r]);
      } else {
        load_bf16x8(x + off, xv[r]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) ss[r] += xv[r][i] * xv[r][i];
    }
  }
  block_sum<R>(ss, smem);
  float wv[8];
  if (active) load_bf16x8(w + c8, wv);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r;
    if (row >= N) break;
    const float rs = rsqrtf(ss[r] / static_cast<float>(C) + eps);
    if (threadIdx.x == 0) rstd[row] = rs;
    if (active) {
      float o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = wv[i] * round_bf16(xv[r][i] * rs);
      store_bf16x8(y + static_cast<std::size_t>(row) * C + c8, o);
    }
  }
}

// Block b handles row groups b, b + gridDim.x, ... (R rows each), keeps its dw contribution in
// registers (8 columns per thread) and writes it to partial[b, :] at the end. kAdd: dx is the
// residual stream's gradient, read and written as bf16(dx + the norm's input gradient).
template <int R, bool kAdd>
static __global__ void __launch_bounds__(max_threads(R))
    rmsnorm_backward_kernel(bf16* dx, float* __restrict__ partial, const bf16* dy,
                            const bf16* __restrict__ x, const bf16* __restrict__ w,
                            const float* __restrict__ rstd, int N, int C) {
  __shared__ float smem[R * 32];
  const int c8 = threadIdx.x * 8;
  const bool active = c8 < C;
  float wv[8], dwacc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) wv[i] = 0.0f, dwacc[i] = 0.0f;
  if (active) load_bf16x8(w + c8, wv);
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int row0 = blockIdx.x * R; row0 < N; row0 += gridDim.x * R) {  // uniform in the block
    float g[R][8], xh[R][8], dot[R], rs[R];
    uint4 prev[R];  // kAdd: dx's 8 bf16 of each row, loaded with the rest (not after the sum)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      rs[r] = row < N ? rstd[row] : 0.0f;
      dot[r] = 0.0f;
      if (active && row < N) {
        const std::size_t off = static_cast<std::size_t>(row) * C + c8;
        load_bf16x8_rw(dy + off, g[r]);  // dx may alias dy (not when kAdd)
        load_bf16x8(x + off, xh[r]);
        if constexpr (kAdd) prev[r] = *reinterpret_cast<const uint4*>(dx + off);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) g[r][i] = 0.0f, xh[r][i] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xh[r][i] *= rs[r];
        dot[r] += wv[i] * g[r][i] * xh[r][i];
        dwacc[i] += g[r][i] * xh[r][i];
      }
    }
    block_sum<R>(dot, smem);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (!active || row >= N) continue;
      const float m = dot[r] * inv_c;
      float d[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) d[i] = rs[r] * (wv[i] * g[r][i] - xh[r][i] * m);
      bf16* out = dx + static_cast<std::size_t>(row) * C + c8;
      if constexpr (kAdd) {
        float p[8];
        unpack_bf16x8(prev[r], p);
#pragma unroll
        for (int i = 0; i < 8; ++i) d[i] += p[i];
      }
      store_bf16x8(out, d);
    }
  }
  if (active) store_f32x8(partial + static_cast<std::size_t>(blockIdx.x) * C + c8, dwacc);
}

template <bool kResidual>
static void launch_forward(const char* op, bf16* residual_out, bf16* y, float* rstd,
                           const bf16* residual_in, const bf16* x, const bf16* w, int N, int C,
                           double eps, cudaStream_t stream) {
  check_shape(op, N, C);
  check_aligned(op, "x", x);
  check_aligned(op, "w", w);
  check_aligned(op, "y", y);
  if (kResidual) {
    check_aligned(op, "residual_in", residual_in);
    check_aligned(op, "residual_out", residual_out);
  }
  if (N == 0) return;
  const float e = static_cast<float>(eps);
  if (rows_per_block(C) == 4)
    rmsnorm_forward_kernel<4, kResidual><<<ceil_div(N, 4), block_threads(C), 0, stream>>>(
        y, rstd, residual_out, residual_in, x, w, N, C, e);
  else
    rmsnorm_forward_kernel<1, kResidual>
        <<<N, block_threads(C), 0, stream>>>(y, rstd, residual_out, residual_in, x, w, N, C, e);
  QT_CHECK_LAUNCH();
}

void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* w, int N, int C, double eps,
                     cudaStream_t stream) {
  launch_forward<false>("rmsnorm_forward", nullptr, y, rstd, nullptr, x, w, N, C, eps, stream);
}

void residual_rmsnorm_forward(bf16* residual_out, bf16* y, float* rstd, const bf16* residual_in,
                              const bf16* x, const bf16* w, int N, int C, double eps,
                              cudaStream_t stream) {
  launch_forward<true>("residual_rmsnorm_forward", residual_out, y, rstd, residual_in, x, w, N, C,
                       eps, stream);
}

std::size_t rmsnorm_backward_workspace_bytes(int N, int C) {
  return static_cast<std::size_t>(backward_blocks(N, C)) * C * sizeof(float);
}

template <bool kAdd>
static void launch_backward(const char* op, bf16* dx, float* dw, const bf16* dy, const bf16* x,
                            const bf16* w, const float* rstd, int N, int C, void* workspace,
                            cudaStream_t stream, bool accumulate) {
  check_shape(op, N, C);
  check_aligned(op, kAdd ? "dres" : "dx", dx);
  check_aligned(op, "dy", dy);
  check_aligned(op, "x", x);
  check_aligned(op, "w", w);
  check_aligned(op, "workspace", workspace);
  if (N == 0) return;
  const int G = backward_blocks(N, C);
  float* partial = static_cast<float*>(workspace);  // [G, C]
  if (rows_per_block(C) == 4)
    rmsnorm_backward_kernel<4, kAdd>
        <<<G, block_threads(C), 0, stream>>>(dx, partial, dy, x, w, rstd, N, C);
  else
    rmsnorm_backward_kernel<1, kAdd>
        <<<G, block_threads(C), 0, stream>>>(dx, partial, dy, x, w, rstd, N, C);
  QT_CHECK_LAUNCH();
  if (dw != nullptr) column_sum_accumulate(dw, partial, G, C, stream, accumulate);
}

void rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                      const float* rstd, int N, int C, void* workspace, cudaStream_t stream,
                      bool accumulate) {
  launch_backward<false>("rmsnorm_backward", dx, dw, dy, x, w, rstd, N, C, workspace, stream,
                         accumulate);
}

void residual_rmsnorm_backward(bf16* dres, float* dw, const bf16* dy, const bf16* x,
                               const bf16* w, const float* rstd, int N, int C, void* workspace,
                               cudaStream_t stream, bool accumulate) {
  QT_CUDA_REQUIRE(dres != dy && dres != x,
                  "residual_rmsnorm_backward: dres must not alias dy or x");
  launch_backward<true>("residual_rmsnorm_backward", dres, dw, dy, x, w, rstd, N, C, workspace,
                        stream, accumulate);
}

}  // namespace qt::cuda
