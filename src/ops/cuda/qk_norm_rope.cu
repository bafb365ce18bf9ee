// Fused per-head RMSNorm + RoPE, forward and backward; see qk_norm_rope.cuh.
// Layout: L = hd / 8 consecutive lanes own HPT head rows of one token (heads h0 .. h0 + HPT - 1),
// 8 elements (one 16-byte vector) of each; lanes [0, L/2) hold the first half of a row, whose
// rotation partners sit L/2 lanes up, so a partner's values come by one xor shuffle. Row sums are
// xor-shuffle sums over the L lanes. The rows of a token share their cos and sin, which each lane
// loads once for its HPT rows (HPT = 4, 2 or 1, the largest that divides the head count).
#include "ops/cuda/common.cuh"
#include "ops/cuda/qk_norm_rope.cuh"

namespace qt::cuda {

static constexpr int kThreads = 256;
static constexpr int kBwdMaxBlocks = kMaxPartials;

// Sum over the L lanes of a head row (L divides 32; rows start at multiples of L).
template <int L>
static __device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The 8 values of the partner lane (lane ^ L/2). Values must be bf16-exact: they travel packed.
template <int L>
static __device__ __forceinline__ void partner_bf16x8(const float (&v)[8], float (&p)[8]) {
  unsigned int u[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    u[i] = __shfl_xor_sync(0xffffffffu, *reinterpret_cast<unsigned int*>(&h), L / 2);
    const float2 t = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u[i]));
    p[2 * i] = t.x;
    p[2 * i + 1] = t.y;
  }
}

// cos and sin of the 8 frequencies of this lane at position p, rounded to bf16.
template <int L>
static __device__ __forceinline__ void rope_coeffs(const float* cos, const float* sin,
                                                   std::int64_t p, int sub, float (&c)[8],
                                                   float (&s)[8]) {
  constexpr int half = 4 * L;
  const std::size_t off = static_cast<std::size_t>(p) * half + (sub % (L / 2)) * 8;
  load_f32x8(cos + off, c);
  load_f32x8(sin + off, s);
#pragma unroll
  for (int i = 0; i < 8; ++i) c[i] = round_bf16(c[i]), s[i] = round_bf16(s[i]);
}

// HPT head rows per L lanes; rows = B * T * heads, a multiple of HPT. No early exit: every lane
// takes part in the shuffles; lanes past the last row work on zeros and store nothing.
template <int L, int HPT>
static __global__ void qk_norm_rope_forward_kernel(
    bf16* out, float* __restrict__ rstd, const bf16* x, const bf16* __restrict__ w,
    const float* __restrict__ cos, const float* __restrict__ sin,
    const std::int32_t* __restrict__ pos, std::int64_t rows, int Tn, int heads, std::int64_t x_ld,
    float eps) {
  constexpr int hd = 8 * L;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t row0 = t / L * HPT;
  const int sub = threadIdx.x % L;
  const bool valid = row0 < rows;
  const std::int64_t bt = row0 / heads;  // the token
  const std::size_t off = static_cast<std::size_t>(row0) * hd + sub * 8;
  const std::size_t x_off = static_cast<std::size_t>(bt) * x_ld +
                            static_cast<std::size_t>(row0 - bt * heads) * hd + sub * 8;
  // Every load is issued before the first shuffle: the rows, the weight and the tables.
  float v[HPT][8] = {}, wv[8], c[8] = {}, s[8] = {};
  if (valid) {
#pragma unroll
    for (int k = 0; k < HPT; ++k) load_bf16x8_rw(x + x_off + k * hd, v[k]);  // out may alias x
    rope_coeffs<L>(cos, sin, pos != nullptr ? pos[bt] : bt % Tn, sub, c, s);
  }
  load_bf16x8(w + sub * 8, wv);
  const float sign = sub < L / 2 ? -1.0f : 1.0f;  // rotate_half: -x2 in the first half, x1 after
#pragma unroll
  for (int k = 0; k < HPT; ++k) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += v[k][i] * v[k][i];
    const float r = rsqrtf(row_sum<L>(ss) / static_cast<float>(hd) + eps);
    float y[8], p[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = round_bf16(wv[i] * round_bf16(v[k][i] * r));
    partner_bf16x8<L>(y, p);
    if (valid) {  // uniform over the L lanes of the rows
      float o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = round_bf16(y[i] * c[i]) + round_bf16(sign * p[i] * s[i]);
      store_bf16x8(out + off + k * hd, o);
      if (sub == 0) rstd[row0 + k] = r;
    }
  }
}

// Block b handles row groups b, b + gridDim.x, ... of kThreads / L * HPT rows. Its dw
// contribution is kept per lane (8 columns), summed over the block's rows in a fixed order through
// shared memory, and written to partial[b, :].
template <int L, int HPT>
static __global__ void qk_norm_rope_backward_kernel(
    bf16* dx, float* __restrict__ partial, const bf16* dout, const bf16* __restrict__ x,
    const bf16* __restrict__ w, const float* __restrict__ rstd, const float* __restrict__ cos,
    const float* __restrict__ sin, const std::int32_t* __restrict__ pos, std::int64_t rows, int Tn,
    int heads, std::int64_t x_ld, std::int64_t dx_ld) {
  constexpr int hd = 8 * L;
  constexpr int rows_per_iter = kThreads / L * HPT;
  __shared__ float acc[kThreads][9];  // [thread][column], padded against bank conflicts
  const int sub = threadIdx.x % L;
  const float sign = sub < L / 2 ? 1.0f : -1.0f;  // inverse rotation
  float wv[8], dwacc[8] = {};
  load_bf16x8(w + sub * 8, wv);
  for (std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * rows_per_iter; base < rows;
       base += static_cast<std::int64_t>(gridDim.x) * rows_per_iter) {
    const std::int64_t row0 = base + threadIdx.x / L * HPT;
    const bool valid = row0 < rows;
    const std::int64_t bt = row0 / heads;  // the token
    const std::size_t off = static_cast<std::size_t>(row0) * hd + sub * 8;
    const std::size_t in_head = static_cast<std::size_t>(row0 - bt * heads) * hd + sub * 8;
    const std::size_t x_off = static_cast<std::size_t>(bt) * x_ld + in_head;
    float d[HPT][8] = {}, xh[HPT][8] = {}, c[8] = {}, s[8] = {}, r[HPT] = {};
    if (valid) {
#pragma unroll
      for (int k = 0; k < HPT; ++k) {
        load_bf16x8_rw(dout + off + k * hd, d[k]);  // dx may alias dout
        load_bf16x8(x + x_off + k * hd, xh[k]);
        r[k] = rstd[row0 + k];
      }
      const std::int64_t position = pos != nullptr ? pos[bt] : bt % Tn;
      rope_coeffs<L>(cos, sin, position, sub, c, s);
    }
#pragma unroll
    for (int k = 0; k < HPT; ++k) {
      float p[8];
      partner_bf16x8<L>(d[k], p);
      // out_i = y_i c + rot_i s  =>  dy_i = dout_i c + dout_partner s (first half), - (second)
      float dy[8], dot = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        dy[i] = d[k][i] * c[i] + sign * p[i] * s[i];
        xh[k][i] *= r[k];
        dot += wv[i] * dy[i] * xh[k][i];
        dwacc[i] += dy[i] * xh[k][i];
      }
      const float m = row_sum<L>(dot) / static_cast<float>(hd);
      if (valid) {
        float g[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) g[i] = r[k] * (wv[i] * dy[i] - xh[k][i] * m);
        store_bf16x8(dx + static_cast<std::size_t>(bt) * dx_ld + in_head + k * hd, g);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[threadIdx.x][i] = dwacc[i];
  __syncthreads();
  if (threadIdx.x < hd) {
    const int col = threadIdx.x, lane_of_col = col / 8, i = col % 8;
    float sum = 0.0f;
    for (int k = 0; k < kThreads / L; ++k) sum += acc[k * L + lane_of_col][i];
    partial[static_cast<std::size_t>(blockIdx.x) * hd + col] = sum;
  }
}

// Head rows per lane group: the largest of 4, 2, 1 that divides the head count.
static int rows_per_group(int heads) { return heads % 4 == 0 ? 4 : heads % 2 == 0 ? 2 : 1; }

// f.template operator()<L, HPT>() for L = hd / 8 and HPT = rows_per_group(heads).
template <typename F>
static void dispatch(int hd, int heads, F&& f) {
  auto by_hpt = [&]<int L>() {
    switch (rows_per_group(heads)) {
      case 4: f.template operator()<L, 4>(); break;
      case 2: f.template operator()<L, 2>(); break;
      default: f.template operator()<L, 1>(); break;
    }
  };
  switch (hd / 8) {
    case 4: by_hpt.template operator()<4>(); break;
    case 8: by_hpt.template operator()<8>(); break;
    case 16: by_hpt.template operator()<16>(); break;
    default: by_hpt.template operator()<32>(); break;
  }
}

static void check_args(const char* op, int B, int Tn, int heads, int hd) {
  QT_CUDA_REQUIRE(B >= 0 && Tn >= 0 && heads > 0,
                  std::string(op) +
                      ": B, T must be >= 0 and heads > 0, got B=" + std::to_string(B) +
                      " T=" + std::to_string(Tn) + " heads=" + std::to_string(heads));
  QT_CUDA_REQUIRE(
      hd == 32 || hd == 64 || hd == 128 || hd == 256,
      std::string(op) + ": head_dim must be 32, 64, 128 or 256, got " + std::to_string(hd));
}

static void check_aligned(const char* op, const char* name, const void* p) {
  QT_CUDA_REQUIRE(is_aligned16(p), std::string(op) + ": " + name + " must be 16-byte aligned");
}

static void check_ld(const char* op, const char* name, int ld, int heads, int hd) {
  QT_CUDA_REQUIRE(ld >= heads * hd && ld % 8 == 0,
                  std::string(op) + ": the token stride of " + name +
                      " must be a multiple of 8 and >= " + std::to_string(heads * hd) + ", got " +
                      std::to_string(ld));
}

static std::int64_t num_rows(int B, int Tn, int heads) {
  return static_cast<std::int64_t>(B) * Tn * heads;
}

static int backward_blocks(std::int64_t rows, int heads, int hd) {
  const std::int64_t per_iter = kThreads / (hd / 8) * rows_per_group(heads);
  return static_cast<int>(
      std::max<std::int64_t>(1, std::min<std::int64_t>(ceil_div(rows, per_iter), kBwdMaxBlocks)));
}

void qk_norm_rope_forward(bf16* out, float* rstd, const bf16* x, const bf16* w, const float* cos,
                          const float* sin, const std::int32_t* pos, int B, int Tn, int heads,
                          int hd, double eps, cudaStream_t stream) {
  qk_norm_rope_forward_strided(out, rstd, x, heads * hd, w, cos, sin, pos, B, Tn, heads, hd, eps,
                               stream);
}

void qk_norm_rope_forward_strided(bf16* out, float* rstd, const bf16* x, int x_ld, const bf16* w,
                                  const float* cos, const float* sin, const std::int32_t* pos,
                                  int B, int Tn, int heads, int hd, double eps,
                                  cudaStream_t stream) {
  const char* op = "qk_norm_rope_forward";
  check_args(op, B, Tn, heads, hd);
  check_ld(op, "x", x_ld, heads, hd);
  QT_CUDA_REQUIRE(x_ld == heads * hd || static_cast<const void*>(out) != x,
                  std::string(op) + ": a strided x must not alias out");
  check_aligned(op, "out", out);
  check_aligned(op, "x", x);
  check_aligned(op, "w", w);
  check_aligned(op, "cos", cos);
  check_aligned(op, "sin", sin);
  const std::int64_t rows = num_rows(B, Tn, heads);
  if (rows == 0) return;
  const int L = hd / 8;
  const std::int64_t groups = rows / rows_per_group(heads);
  const auto grid = static_cast<unsigned int>(ceil_div<std::int64_t>(groups * L, kThreads));
  const float e = static_cast<float>(eps);
  dispatch(hd, heads, [&]<int LL, int HPT>() {
    qk_norm_rope_forward_kernel<LL, HPT>
        <<<grid, kThreads, 0, stream>>>(out, rstd, x, w, cos, sin, pos, rows, Tn, heads, x_ld, e);
  });
  QT_CHECK_LAUNCH();
}

std::size_t qk_norm_rope_backward_workspace_bytes(int B, int Tn, int heads, int hd) {
  return static_cast<std::size_t>(backward_blocks(num_rows(B, Tn, heads), heads, hd)) * hd *
         sizeof(float);
}

void qk_norm_rope_backward(bf16* dx, float* dw, const bf16* dout, const bf16* x, const bf16* w,
                           const float* rstd, const float* cos, const float* sin,
                           const std::int32_t* pos, int B, int Tn, int heads, int hd,
                           void* workspace, cudaStream_t stream, bool accumulate) {
  qk_norm_rope_backward_strided(dx, heads * hd, dw, dout, x, heads * hd, w, rstd, cos, sin, pos, B,
                                Tn, heads, hd, workspace, stream, accumulate);
}

void qk_norm_rope_backward_strided(bf16* dx, int dx_ld, float* dw, const bf16* dout,
                                   const bf16* x, int x_ld, const bf16* w, const float* rstd,
                                   const float* cos, const float* sin, const std::int32_t* pos,
                                   int B, int Tn, int heads, int hd, void* workspace,
                                   cudaStream_t stream, bool accumulate) {
  const char* op = "qk_norm_rope_backward";
  check_args(op, B, Tn, heads, hd);
  check_ld(op, "x", x_ld, heads, hd);
  check_ld(op, "dx", dx_ld, heads, hd);
  QT_CUDA_REQUIRE(dx_ld == heads * hd || static_cast<const void*>(dx) != dout,
                  std::string(op) + ": a strided dx must not alias dout");
  check_aligned(op, "dx", dx);
  check_aligned(op, "dout", dout);
  check_aligned(op, "x", x);
  check_aligned(op, "w", w);
  check_aligned(op, "cos", cos);
  check_aligned(op, "sin", sin);
  const std::int64_t rows = num_rows(B, Tn, heads);
  if (rows == 0) return;
  const int G = backward_blocks(rows, heads, hd);
  float* partial = static_cast<float*>(workspace);  // [G, hd]
  dispatch(hd, heads, [&]<int L, int HPT>() {
    qk_norm_rope_backward_kernel<L, HPT><<<G, kThreads, 0, stream>>>(
        dx, partial, dout, x, w, rstd, cos, sin, pos, rows, Tn, heads, x_ld, dx_ld);
  });
  QT_CHECK_LAUNCH();
  if (dw != nullptr) column_sum_accumulate(dw, partial, G, hd, stream, accumulate);
}

}  // namespace qt::cuda
