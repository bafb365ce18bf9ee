// Cross-entropy forward (one block per row, online max/sum), backward (elementwise over the
// row) and both in one kernel (a cluster of two blocks per row, Hopper and later); see
// cross_entropy.cuh. Rows are walked in chunks of 8 logits: one 16-byte vector when kVec, else
// 8 scalar loads with bounds checks (V % 8 != 0 or a misaligned pointer).
#include <algorithm>
#include <cmath>

#include <cooperative_groups.h>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cross_entropy.cuh"

namespace cg = cooperative_groups;

namespace qt::cuda {

static constexpr int kFwdThreads = 512;
static constexpr int kFwdUnroll = 4;  // chunks of 8 in flight per thread
static constexpr int kBwdThreads = 256;
static constexpr int kBwdUnroll = 4;
static constexpr int kSumThreads = 1024;
static constexpr int kFusedThreads = 1024;
static constexpr float kLog2e = 1.4426950408889634f;
static constexpr std::int32_t kIgnoreIndex = -100;

// Chunk c of a row of V logits: elements [8c, 8c + 8); past V reads as `fill`.
template <bool kVec>
static __device__ __forceinline__ void load_chunk(const bf16* row, int c, int V, float fill,
                                                  float (&f)[8]) {
  if constexpr (kVec) {
    load_bf16x8_rw(row + static_cast<std::size_t>(c) * 8, f);  // dlogits may alias logits
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = c * 8 + i;
      f[i] = e < V ? __bfloat162float(row[e]) : fill;
    }
  }
}

template <bool kVec>
static __device__ __forceinline__ void store_chunk(bf16* row, int c, int V, const float (&f)[8]) {
  if constexpr (kVec) {
    store_bf16x8(row + static_cast<std::size_t>(c) * 8, f);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (c * 8 + i < V) row[c * 8 + i] = __float2bfloat16_rn(f[i]);
  }
}

namespace {
// Running maximum m and s = sum exp(x - m); m = -inf means empty.
struct MaxSum {
  float m, s;
};
}  // namespace

static __device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * exp2f((a.m - m) * kLog2e) + b.s * exp2f((b.m - m) * kLog2e)};
}

// The block's (max, sum) in a fixed order: xor tree in each warp, then warps 0, 1, ... by
// thread 0, which alone gets the result. Contains the block's barrier.
template <int THREADS>
static __device__ __forceinline__ MaxSum block_combine(MaxSum acc, MaxSum* warp_part) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o)};
    acc = combine(acc, other);
  }
  if ((threadIdx.x & 31) == 0) warp_part[threadIdx.x >> 5] = acc;
  __syncthreads();
  MaxSum total = warp_part[0];
  if (threadIdx.x == 0)
    for (int w = 1; w < THREADS / 32; ++w) total = combine(total, warp_part[w]);
  return total;
}

// Online max and sum of exp over a row, by the block's THREADS threads (block_combine): thread 0
// returns lse = m + log(s); the other threads' results are undefined.
template <bool kVec, int THREADS>
static __device__ __forceinline__ float row_lse(const bf16* row, int V, MaxSum* warp_part) {
  const int chunks = ceil_div(V, 8);
  MaxSum acc{-INFINITY, 0.0f};
  for (int c0 = threadIdx.x; c0 < chunks; c0 += kFwdUnroll * THREADS) {
    float x[kFwdUnroll][8];
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < kFwdUnroll; ++u) {
      const int c = c0 + u * THREADS;
      if (c < chunks) {
        load_chunk<kVec>(row, c, V, -INFINITY, x[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) x[u][i] = -INFINITY;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) mx = fmaxf(mx, x[u][i]);
    }
    // mx is finite: chunk c0 < chunks holds at least one logit.
    // exp(x - m) as exp2((x - m) log2 e): x - m is exact for bf16 logits, so one rounding.
    const float m = fmaxf(acc.m, mx);
    float s = acc.s * exp2f((acc.m - m) * kLog2e);
#pragma unroll
    for (int u = 0; u < kFwdUnroll; ++u)
#pragma unroll
      for (int i = 0; i < 8; ++i) s += exp2f((x[u][i] - m) * kLog2e);
    acc = {m, s};
  }
  const MaxSum total = block_combine<THREADS>(acc, warp_part);
  return total.m + logf(total.s);
}

// d = bf16(scale * (exp(x - l) - onehot(t))) for the 8 logits of chunk c (0 on ignored rows).
static __device__ __forceinline__ void chunk_grad(const float (&x)[8], int c, float l,
                                                  std::int32_t t, float scale, float (&d)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float p = exp2f((x[i] - l) * kLog2e);
    d[i] = t == kIgnoreIndex ? 0.0f : scale * (c * 8 + i == t ? p - 1.0f : p);
  }
}

template <bool kVec>
static __global__ void __launch_bounds__(kFwdThreads)
    cross_entropy_forward_kernel(float* __restrict__ losses, float* __restrict__ lse,
                                 const bf16* __restrict__ logits,
                                 const std::int32_t* __restrict__ targets, int V) {
  __shared__ MaxSum warp_part[32];
  const int n = blockIdx.x;
  const bf16* row = logits + static_cast<std::size_t>(n) * V;
  const float l = row_lse<kVec, kFwdThreads>(row, V, warp_part);
  if (threadIdx.x != 0) return;
  lse[n] = l;
  const std::int32_t t = targets[n];
  losses[n] = t == kIgnoreIndex ? 0.0f : l - __bfloat162float(row[t]);
}

// Vocabulary-parallel pass 1 (cross_entropy.cuh): row n's log-sum-exp over this rank's V
// columns, and the target's logit where this rank holds it.
template <bool kVec>
static __global__ void __launch_bounds__(kFwdThreads)
    cross_entropy_vp_partial_kernel(float* __restrict__ part, const bf16* __restrict__ logits,
                                    const std::int32_t* __restrict__ targets, int N, int V,
                                    int first) {
  __shared__ MaxSum warp_part[32];
  const int n = blockIdx.x;
  const bf16* row = logits + static_cast<std::size_t>(n) * V;
  const float l = row_lse<kVec, kFwdThreads>(row, V, warp_part);
  if (threadIdx.x != 0) return;
  part[n] = l;
  const std::int32_t t = targets[n];
  const bool here = t != kIgnoreIndex && t >= first && t - first < V;
  part[N + n] = here ? __bfloat162float(row[t - first]) : 0.0f;
}

// Vocabulary-parallel pass 2: one thread per row combines the ranks' parts in rank order.
static __global__ void cross_entropy_vp_finish_kernel(float* __restrict__ losses,
                                                      float* __restrict__ lse,
                                                      std::int32_t* __restrict__ local_targets,
                                                      const float* __restrict__ parts, int tp,
                                                      const std::int32_t* __restrict__ targets,
                                                      int N, int V, int first) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const std::size_t stride = 2 * static_cast<std::size_t>(N);
  float m = -INFINITY;
  for (int r = 0; r < tp; ++r) m = fmaxf(m, parts[r * stride + n]);
  float s = 0.0f, target_logit = 0.0f;
  for (int r = 0; r < tp; ++r) {
    s += exp2f((parts[r * stride + n] - m) * kLog2e);
    target_logit += parts[r * stride + N + n];  // one rank's is the logit, the others' 0
  }
  const float l = m + logf(s);
  const std::int32_t t = targets[n];
  lse[n] = l;
  losses[n] = t == kIgnoreIndex ? 0.0f : l - target_logit;
  // A counted row's target outside this rank's columns: -1, which no column matches.
  const bool here = t >= first && t - first < V;
  local_targets[n] = t == kIgnoreIndex ? kIgnoreIndex : (here ? t - first : -1);
}

// Rows of a cluster of two blocks: cluster k takes rows k, k + clusters, ...; block r of it
// keeps chunks [r h, r h + h) of the row (h = fused_half_chunks(V) chunks of 8 logits) in shared
// memory, so each logit is read from memory once. Pass 1 loads the half row and its online max
// and sum; the two halves' (max, sum) are combined through distributed shared memory in a fixed
// order (rank 0's first), so both blocks get the same lse; pass 2 writes the gradient over the
// logits from shared memory. Only for V % 8 == 0 and 16-byte aligned rows (kVec), on devices with
// thread-block clusters (compute capability 9.0 and later; launched with a cluster dimension).
static constexpr int kFusedMaxHalfBytes = 200 * 1024;
static int fused_half_chunks(int V) { return ceil_div(ceil_div(V, 8), 2); }

static __global__ void __launch_bounds__(kFusedThreads, 1)
    cross_entropy_fused_kernel(float* __restrict__ losses, float* __restrict__ lse, bf16* logits,
                               const std::int32_t* __restrict__ targets, float scale, int N,
                               int V) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint4 half_row[];  // [h] chunks of 8 bf16
  __shared__ MaxSum warp_part[32];
  __shared__ MaxSum mine;              // this block's (max, sum), read by the other block too
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const MaxSum* other = cluster.map_shared_rank(&mine, rank ^ 1);
  const int chunks = V / 8, h = ceil_div(chunks, 2);
  const int c_begin = rank * h, c_end = min(chunks, c_begin + h);
  const int clusters = static_cast<int>(gridDim.x) / 2;
  for (int n = static_cast<int>(blockIdx.x) / 2; n < N; n += clusters) {
    bf16* row = logits + static_cast<std::size_t>(n) * V;
    const std::int32_t t = targets[n];
    MaxSum acc{-INFINITY, 0.0f};
    for (int c0 = c_begin + static_cast<int>(threadIdx.x); c0 < c_end;
         c0 += kFwdUnroll * kFusedThreads) {
      uint4 u[kFwdUnroll];  // kFwdUnroll loads in flight before any is used
#pragma unroll
      for (int k = 0; k < kFwdUnroll; ++k) {
        const int c = c0 + k * kFusedThreads;
        if (c < c_end)
          u[k] = *reinterpret_cast<const uint4*>(row + static_cast<std::size_t>(c) * 8);
      }
#pragma unroll
      for (int k = 0; k < kFwdUnroll; ++k) {
        const int c = c0 + k * kFusedThreads;
        if (c >= c_end) break;
        half_row[c - c_begin] = u[k];
        float x[8];
        unpack_bf16x8(u[k], x);
        float mx = x[0];
#pragma unroll
        for (int i = 1; i < 8; ++i) mx = fmaxf(mx, x[i]);
        const float m = fmaxf(acc.m, mx);
        float s = acc.s * exp2f((acc.m - m) * kLog2e);
#pragma unroll
        for (int i = 0; i < 8; ++i) s += exp2f((x[i] - m) * kLog2e);
        acc = {m, s};
      }
    }
    const MaxSum total = block_combine<kFusedThreads>(acc, warp_part);
    if (threadIdx.x == 0) mine = total;
    cluster.sync();  // both halves' (max, sum) written; the half rows loaded
    const MaxSum theirs = *other;
    const MaxSum both = rank == 0 ? combine(mine, theirs) : combine(theirs, mine);
    const float l = both.m + logf(both.s);
    if (threadIdx.x == 0 && rank == 0) lse[n] = l;
    if (threadIdx.x == 0 && t != kIgnoreIndex && t / 8 >= c_begin && t / 8 < c_end) {
      const bf16* lt = reinterpret_cast<const bf16*>(half_row) + (t - c_begin * 8);
      losses[n] = l - __bfloat162float(*lt);
    } else if (threadIdx.x == 0 && rank == 0 && t == kIgnoreIndex) {
      losses[n] = 0.0f;
    }
    for (int c = c_begin + static_cast<int>(threadIdx.x); c < c_end; c += kFusedThreads) {
      float x[8], d[8];
      unpack_bf16x8(half_row[c - c_begin], x);
      chunk_grad(x, c, l, t, scale, d);
      store_bf16x8(row + static_cast<std::size_t>(c) * 8, d);
    }
    cluster.sync();  // `mine` and the half rows are rewritten for the next row
  }
#else
  __trap();  // no clusters before sm_90: the launcher never runs this
#endif
}

// *loss_sum += sum of losses[0, N), in double, in a fixed order. One block.
static __global__ void __launch_bounds__(kSumThreads)
    loss_sum_kernel(double* loss_sum, const float* __restrict__ losses, int N) {
  __shared__ double smem[32];
  double v[1] = {0.0};
  for (int i = threadIdx.x; i < N; i += kSumThreads) v[0] += losses[i];
  block_sum<1>(v, smem);
  if (threadIdx.x == 0) *loss_sum += v[0];
}

// The loss_sum_kernel launch of both entry points; nothing when loss_sum is null.
static void add_loss_sum(double* loss_sum, const float* losses, int N, cudaStream_t stream) {
  if (loss_sum == nullptr) return;
  loss_sum_kernel<<<1, kSumThreads, 0, stream>>>(loss_sum, losses, N);
  QT_CHECK_LAUNCH();
}

// Block (n, y) handles chunks y * kBwdUnroll * kBwdThreads + u * kBwdThreads + threadIdx.x of
// row n.
template <bool kVec>
static __global__ void __launch_bounds__(kBwdThreads)
    cross_entropy_backward_kernel(bf16* dlogits, const bf16* logits, const float* __restrict__ lse,
                                  const std::int32_t* __restrict__ targets, float scale, int V) {
  const int n = blockIdx.x;
  const std::size_t off = static_cast<std::size_t>(n) * V;
  const int chunks = ceil_div(V, 8);
  const std::int32_t t = targets[n];
  const float l = lse[n];
  const int c0 = blockIdx.y * kBwdUnroll * kBwdThreads + threadIdx.x;
  float x[kBwdUnroll][8] = {};
#pragma unroll
  for (int u = 0; u < kBwdUnroll; ++u) {
    const int c = c0 + u * kBwdThreads;
    if (c < chunks && t != kIgnoreIndex) load_chunk<kVec>(logits + off, c, V, 0.0f, x[u]);
  }
#pragma unroll
  for (int u = 0; u < kBwdUnroll; ++u) {
    const int c = c0 + u * kBwdThreads;
    if (c >= chunks) break;
    float d[8];
    chunk_grad(x[u], c, l, t, scale, d);
    store_chunk<kVec>(dlogits + off, c, V, d);
  }
}

static void check_shape(const char* op, int N, int V) {
  QT_CUDA_REQUIRE(N >= 0 && V >= 1, std::string(op) + ": need N >= 0 and V >= 1, got N=" +
                                        std::to_string(N) + " V=" + std::to_string(V));
}

void cross_entropy_forward(float* losses, float* lse, const bf16* logits,
                           const std::int32_t* targets, int N, int V, double* loss_sum,
                           cudaStream_t stream) {
  check_shape("cross_entropy_forward", N, V);
  if (N == 0) return;
  if (V % 8 == 0 && is_aligned16(logits))
    cross_entropy_forward_kernel<true>
        <<<N, kFwdThreads, 0, stream>>>(losses, lse, logits, targets, V);
  else
    cross_entropy_forward_kernel<false>
        <<<N, kFwdThreads, 0, stream>>>(losses, lse, logits, targets, V);
  QT_CHECK_LAUNCH();
  add_loss_sum(loss_sum, losses, N, stream);
}

void cross_entropy_backward(bf16* dlogits, const bf16* logits, const float* lse,
                            const std::int32_t* targets, float scale, int N, int V,
                            cudaStream_t stream) {
  check_shape("cross_entropy_backward", N, V);
  if (N == 0) return;
  const dim3 grid(N, ceil_div(ceil_div(V, 8), kBwdUnroll * kBwdThreads));
  if (V % 8 == 0 && is_aligned16(logits) && is_aligned16(dlogits))
    cross_entropy_backward_kernel<true>
        <<<grid, kBwdThreads, 0, stream>>>(dlogits, logits, lse, targets, scale, V);
  else
    cross_entropy_backward_kernel<false>
        <<<grid, kBwdThreads, 0, stream>>>(dlogits, logits, lse, targets, scale, V);
  QT_CHECK_LAUNCH();
}

void cross_entropy_vp_partial(float* part, const bf16* logits, const std::int32_t* targets,
                              int N, int V, int first, cudaStream_t stream) {
  check_shape("cross_entropy_vp_partial", N, V);
  if (N == 0) return;
  if (V % 8 == 0 && is_aligned16(logits))
    cross_entropy_vp_partial_kernel<true>
        <<<N, kFwdThreads, 0, stream>>>(part, logits, targets, N, V, first);
  else
    cross_entropy_vp_partial_kernel<false>
        <<<N, kFwdThreads, 0, stream>>>(part, logits, targets, N, V, first);
  QT_CHECK_LAUNCH();
}

void cross_entropy_vp_finish(float* losses, float* lse, std::int32_t* local_targets,
                             const float* parts, int tp, const std::int32_t* targets, int N, int V,
                             int first, double* loss_sum, cudaStream_t stream) {
  check_shape("cross_entropy_vp_finish", N, V);
  QT_CUDA_REQUIRE(tp >= 1, "cross_entropy_vp_finish: tp must be >= 1");
  if (N == 0) return;
  cross_entropy_vp_finish_kernel<<<ceil_div(N, 256), 256, 0, stream>>>(
      losses, lse, local_targets, parts, tp, targets, N, V, first);
  QT_CHECK_LAUNCH();
  add_loss_sum(loss_sum, losses, N, stream);
}

// Whether the fused kernel runs on the current device (thread-block clusters, compute capability
// >= 9.0, and a build of the kernel for it rather than the pre-sm_90 body), and its SM count;
// probed once per device and thread, setting the kernel's shared-memory limit on the way.
struct FusedSupport {
  int sms = 0;
  bool clusters = false;
};
static FusedSupport fused_support() {
  static thread_local FusedSupport cached;
  static thread_local int cached_device = -1;
  int d = 0;
  QT_CHECK_CUDA(cudaGetDevice(&d));
  if (d == cached_device) return cached;
  int major = 0;
  QT_CHECK_CUDA(cudaDeviceGetAttribute(&cached.sms, cudaDevAttrMultiProcessorCount, d));
  QT_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d));
  cudaFuncAttributes fa{};
  QT_CHECK_CUDA(cudaFuncGetAttributes(&fa, cross_entropy_fused_kernel));
  cached.clusters = major >= 9 && fa.binaryVersion >= 90;
  if (cached.clusters)
    QT_CHECK_CUDA(cudaFuncSetAttribute(cross_entropy_fused_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kFusedMaxHalfBytes));
  cached_device = d;
  return cached;
}

void cross_entropy_forward_backward(float* losses, float* lse, bf16* logits,
                                    const std::int32_t* targets, float scale, int N, int V,
                                    double* loss_sum, cudaStream_t stream) {
  check_shape("cross_entropy_forward_backward", N, V);
  if (N == 0) return;
  const std::size_t half_bytes = static_cast<std::size_t>(fused_half_chunks(V)) * 16;
  const bool fits = V % 8 == 0 && is_aligned16(logits) && half_bytes <= kFusedMaxHalfBytes;
  const FusedSupport dev = fits ? fused_support() : FusedSupport{};
  if (!dev.clusters) {  // the two kernels
    cross_entropy_forward(losses, lse, logits, targets, N, V, loss_sum, stream);
    cross_entropy_backward(logits, logits, lse, targets, scale, N, V, stream);
    return;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(2 * std::min(N, dev.sms / 2)));  // a block per SM
  config.blockDim = dim3(kFusedThreads);
  config.dynamicSmemBytes = half_bytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  QT_CHECK_CUDA(cudaLaunchKernelEx(&config, cross_entropy_fused_kernel, losses, lse, logits,
                                   targets, scale, N, V));
  add_loss_sum(loss_sum, losses, N, stream);
}

}  // namespace qt::cuda
