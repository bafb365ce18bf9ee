// The Qwen3-MoE block's kernels; see moe.cuh. The router runs one warp per token (E <= 1024
// values in shared memory, k <= 32 slots, one per lane); the routing counts each block's pairs
// per expert with warp matches, prefix-sums the block counts per expert and the expert totals,
// then places every pair (no atomics, so the permutation is the same on every run); the row
// kernels run one block per row with 16-byte vectors when H % 8 == 0 and the pointers allow.
#include <cfloat>
#include <cmath>
#include <initializer_list>

#include "ops/cuda/common.cuh"
#include "ops/cuda/moe.cuh"

namespace qt::cuda {

static constexpr int kWarpRows = 8;       // router: tokens (warps) per block
static constexpr int kRoutePairs = 256;   // routing: pairs per block (8 warps)
static constexpr int kRowThreads = 256;   // row kernels
static constexpr int kMaxExperts = 1024;

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---------------------------------------------------------------------------------------------
// Router

static __global__ void moe_router_forward_kernel(float* probs, int* idx, bf16* w,
                                                 const bf16* logits, const float* bias, int N,
                                                 int E, int k, bool norm_topk) {
  extern __shared__ float router_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kWarpRows + warp;
  if (t >= N) return;  // whole warps leave: no block barrier below
  float* p = router_smem + static_cast<std::size_t>(warp) * E;  // [E] this token's probs
  const bf16* x = logits + static_cast<std::size_t>(t) * E;
  float m = -FLT_MAX;
  for (int e = lane; e < E; e += 32) {
    p[e] = __bfloat162float(x[e]);
    m = fmaxf(m, p[e]);
  }
  m = warp_max(m);
  float s = 0;
  for (int e = lane; e < E; e += 32) s += (p[e] = expf(p[e] - m));
  s = warp_sum(s);
  float* pr = probs + static_cast<std::size_t>(t) * E;
  // p becomes the choice's score: the probability, plus the balancing bias when there is one.
  for (int e = lane; e < E; e += 32) {
    pr[e] = (p[e] /= s);
    if (bias) p[e] += bias[e];
  }
  __syncwarp();  // also orders pr's writes before the lanes read each other's below
  // Top-k: k rounds of a warp argmax of the scores (larger value, then lower expert); a pick's
  // score is set to -inf, below any score. Lane j keeps slot j's probability (unbiased: pr).
  float mine = 0, picked = 0;
  for (int j = 0; j < k; ++j) {
    float v = -INFINITY;
    int bi = E;
    for (int e = lane; e < E; e += 32)
      if (p[e] > v) v = p[e], bi = e;  // ascending e: the first of equals stays
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > v || (ov == v && oi < bi)) v = ov, bi = oi;
    }
    const float prob = bias ? pr[bi] : v;  // without a bias the score is the probability
    if (lane == j) {
      mine = prob;
      idx[static_cast<std::size_t>(t) * k + j] = bi;
    }
    picked += prob;  // in slot order, as the CPU reference
    __syncwarp();
    if (lane == (bi & 31)) p[bi] = -INFINITY;
    __syncwarp();
  }
  if (lane < k)
    w[static_cast<std::size_t>(t) * k + lane] = __float2bfloat16_rn(norm_topk ? mine / picked : mine);
}

static __global__ void moe_router_backward_kernel(bf16* dlogits, const float* dw,
                                                  const float* probs, const int* idx,
                                                  const double* balance, float aux_scale, int N,
                                                  int E, int k, bool norm_topk) {
  extern __shared__ float router_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kWarpRows + warp;
  if (t >= N) return;
  float* dp = router_smem + static_cast<std::size_t>(warp) * E;  // [E] d probs
  const float* p = probs + static_cast<std::size_t>(t) * E;
  for (int e = lane; e < E; e += 32)
    dp[e] = balance ? aux_scale * static_cast<float>(balance[e]) : 0.f;
  __syncwarp();
  int e_mine = 0;
  float dw_mine = 0, p_mine = 0;
  if (lane < k) {
    e_mine = idx[static_cast<std::size_t>(t) * k + lane];
    dw_mine = dw[static_cast<std::size_t>(t) * k + lane];
    p_mine = p[e_mine];
  }
  float g = dw_mine;
  if (norm_topk) {  // w_j = p_j / S: dp_j = (dw_j - sum_i dw_i w_i) / S
    const float picked = warp_sum(p_mine);
    const float dot = warp_sum(dw_mine * p_mine / picked);
    g = (dw_mine - dot) / picked;
  }
  if (lane < k) dp[e_mine] += g;  // a token's k experts are distinct
  __syncwarp();
  float dot = 0;
  for (int e = lane; e < E; e += 32) dot += p[e] * dp[e];
  dot = warp_sum(dot);
  bf16* dl = dlogits + static_cast<std::size_t>(t) * E;
  for (int e = lane; e < E; e += 32) dl[e] = __float2bfloat16_rn(p[e] * (dp[e] - dot));
}

static void check_router(const char* op, int N, int E, int k) {
  QT_CUDA_REQUIRE(N >= 0 && E >= 1 && E <= kMaxExperts && k >= 1 && k <= 32 && k <= E,
                  std::string(op) + ": need N >= 0, 1 <= E <= 1024, 1 <= k <= min(32, E), got N=" +
                      std::to_string(N) + " E=" + std::to_string(E) + " k=" + std::to_string(k));
}

void moe_router_forward(float* probs, int* idx, bf16* w, const bf16* logits, int N, int E, int k,
                        bool norm_topk, cudaStream_t stream, const float* bias) {
  check_router("moe_router_forward", N, E, k);
  if (N == 0) return;
  const std::size_t smem = sizeof(float) * kWarpRows * E;
  moe_router_forward_kernel<<<ceil_div(N, kWarpRows), 32 * kWarpRows, smem, stream>>>(
      probs, idx, w, logits, bias, N, E, k, norm_topk);
  QT_CHECK_LAUNCH();
}

void moe_router_backward(bf16* dlogits, const float* dw, const float* probs, const int* idx,
                         const double* balance_count, float aux_scale, int N, int E, int k,
                         bool norm_topk, cudaStream_t stream) {
  check_router("moe_router_backward", N, E, k);
  if (N == 0) return;
  const std::size_t smem = sizeof(float) * kWarpRows * E;
  moe_router_backward_kernel<<<ceil_div(N, kWarpRows), 32 * kWarpRows, smem, stream>>>(
      dlogits, dw, probs, idx, balance_count, aux_scale, N, E, k, norm_topk);
  QT_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------------
// Routing

// rank[i]: pair i's place among its block's earlier pairs of the same expert; block_counts
// [blocks, E] each block's pairs per expert.
static __global__ void moe_route_count_kernel(int* block_counts, int* rank, const int* idx, int n,
                                              int E) {
  extern __shared__ int warp_counts[];  // [warps, E]: counts, then exclusive prefixes over warps
  const int warps = kRoutePairs / 32;
  for (int i = threadIdx.x; i < warps * E; i += blockDim.x) warp_counts[i] = 0;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i = blockIdx.x * kRoutePairs + threadIdx.x;
  const int e = i < n ? idx[i] : -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int before = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && lane == __ffs(peers) - 1) warp_counts[warp * E + e] = __popc(peers);
  __syncthreads();
  for (int x = threadIdx.x; x < E; x += blockDim.x) {
    int s = 0;
    for (int w = 0; w < warps; ++w) {
      const int c = warp_counts[w * E + x];
      warp_counts[w * E + x] = s;
      s += c;
    }
    block_counts[static_cast<std::size_t>(blockIdx.x) * E + x] = s;
  }
  __syncthreads();
  if (e >= 0) rank[i] = warp_counts[warp * E + e] + before;
}

// One block of E threads: block_counts becomes each block's first place within its expert;
// counts (and the balance counts) from the totals, kept = min(counts, capacity), offsets from
// kept.
static __global__ void moe_route_scan_kernel(int* counts, int* kept, int* offsets,
                                             int* block_counts, double* balance, int blocks,
                                             int E, int capacity) {
  extern __shared__ int totals[];  // [E]
  const int e = threadIdx.x;
  if (e < E) {
    int s = 0;
    for (int b = 0; b < blocks; ++b) {
      const int c = block_counts[static_cast<std::size_t>(b) * E + e];
      block_counts[static_cast<std::size_t>(b) * E + e] = s;
      s += c;
    }
    counts[e] = s;
    kept[e] = totals[e] = min(s, capacity);
    if (balance) balance[e] += s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (int x = 0; x < E; ++x) {
      offsets[x] = s;
      s += totals[x];
    }
    offsets[E] = s;
  }
}

// Pair i's place within its expert; past the capacity it is dropped (pos -1).
static __global__ void moe_route_place_kernel(int* pos, int* pair, const int* offsets,
                                              const int* block_first, const int* rank,
                                              const int* idx, int n, int E, int capacity) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int e = idx[i];
  const int in_expert = block_first[static_cast<std::size_t>(i / kRoutePairs) * E + e] + rank[i];
  if (in_expert >= capacity) {
    pos[i] = -1;
    return;
  }
  const int r = offsets[e] + in_expert;
  pos[i] = r;
  pair[r] = i;
}

static std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }

std::size_t moe_route_workspace_bytes(int n_pairs, int E) {
  const std::size_t blocks = ceil_div(static_cast<std::size_t>(n_pairs), std::size_t{kRoutePairs});
  return align256(blocks * E * sizeof(int)) + align256(static_cast<std::size_t>(n_pairs) * sizeof(int));
}

void moe_route(int* counts, int* kept, int* offsets, int* pos, int* pair, double* balance_count,
               const int* idx, int n_pairs, int E, int capacity, void* workspace,
               cudaStream_t stream) {
  QT_CUDA_REQUIRE(n_pairs >= 0 && E >= 1 && E <= kMaxExperts && capacity >= 0,
                  "moe_route: need n_pairs >= 0, 1 <= E <= 1024 and capacity >= 0, got n_pairs=" +
                      std::to_string(n_pairs) + " E=" + std::to_string(E) +
                      " capacity=" + std::to_string(capacity));
  // With drops the rows past the kept ones name no pair (moe_permute zeroes them).
  if (capacity < n_pairs && n_pairs > 0)
    QT_CHECK_CUDA(cudaMemsetAsync(pair, 0xff, sizeof(int) * static_cast<std::size_t>(n_pairs), stream));
  const int blocks = ceil_div(n_pairs, kRoutePairs);
  int* block_counts = static_cast<int*>(workspace);
  int* rank = reinterpret_cast<int*>(static_cast<char*>(workspace) +
                                     align256(static_cast<std::size_t>(blocks) * E * sizeof(int)));
  if (blocks > 0) {
    moe_route_count_kernel<<<blocks, kRoutePairs, sizeof(int) * (kRoutePairs / 32) * E, stream>>>(
        block_counts, rank, idx, n_pairs, E);
    QT_CHECK_LAUNCH();
  }
  moe_route_scan_kernel<<<1, ceil_div(E, 32) * 32, sizeof(int) * E, stream>>>(
      counts, kept, offsets, block_counts, balance_count, blocks, E, capacity);
  QT_CHECK_LAUNCH();
  if (blocks > 0) {
    moe_route_place_kernel<<<ceil_div(n_pairs, kRowThreads), kRowThreads, 0, stream>>>(
        pos, pair, offsets, block_counts, rank, idx, n_pairs, E, capacity);
    QT_CHECK_LAUNCH();
  }
}

static __global__ void moe_load_add_kernel(double* load, const int* counts, int E) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < E) load[e] += counts[e];
}

void moe_load_add(double* load, const int* counts, int E, cudaStream_t stream) {
  if (E <= 0) return;
  moe_load_add_kernel<<<ceil_div(E, 256), 256, 0, stream>>>(load, counts, E);
  QT_CHECK_LAUNCH();
}

// One warp: dropped[0] += the sum of counts - kept, in a fixed order.
static __global__ void moe_dropped_add_kernel(double* dropped, const int* counts, const int* kept,
                                              int E) {
  long long s = 0;
  for (int e = threadIdx.x; e < E; e += 32) s += counts[e] - kept[e];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if (threadIdx.x == 0) dropped[0] += static_cast<double>(s);
}

void moe_dropped_add(double* dropped, const int* counts, const int* kept, int E,
                     cudaStream_t stream) {
  if (E <= 0) return;
  moe_dropped_add_kernel<<<1, 32, 0, stream>>>(dropped, counts, kept, E);
  QT_CHECK_LAUNCH();
}

// psum[e] += sum over t of probs[t, e]: 32 experts a block, 8 row strides, summed in a fixed order.
static __global__ void moe_probs_colsum_kernel(double* psum, const float* probs, int N, int E) {
  __shared__ double part[8][32];
  const int e = blockIdx.x * 32 + threadIdx.x;
  double s = 0;
  if (e < E)
    for (int t = threadIdx.y; t < N; t += 8) s += probs[static_cast<std::size_t>(t) * E + e];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    double total = 0;
    for (int y = 0; y < 8; ++y) total += part[y][threadIdx.x];
    psum[e] += total;
  }
}

void moe_probs_colsum(double* psum, const float* probs, int N, int E, cudaStream_t stream) {
  QT_CUDA_REQUIRE(N >= 0 && E >= 1, "moe_probs_colsum: need N >= 0 and E >= 1, got N=" +
                                        std::to_string(N) + " E=" + std::to_string(E));
  moe_probs_colsum_kernel<<<ceil_div(E, 32), dim3(32, 8), 0, stream>>>(psum, probs, N, E);
  QT_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------------
// Rows: 8 columns a thread-step, a vector when kVec (H % 8 == 0, 16-byte aligned rows).

template <bool kVec>
static __device__ __forceinline__ void load8(const bf16* row, int c, int H, float (&f)[8]) {
  if constexpr (kVec) {
    load_bf16x8_rw(row + c, f);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = c + i < H ? __bfloat162float(row[c + i]) : 0.f;
  }
}

template <bool kVec>
static __device__ __forceinline__ void store8(bf16* row, int c, int H, const float (&f)[8]) {
  if constexpr (kVec) {
    store_bf16x8(row + c, f);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (c + i < H) row[c + i] = __float2bfloat16_rn(f[i]);
  }
}

template <bool kVec>
static __global__ void moe_permute_kernel(bf16* x_perm, const bf16* x, const int* pair, int k,
                                          int H) {
  const int r = blockIdx.x, p = pair[r];
  const bf16* src = x + static_cast<std::size_t>(p < 0 ? 0 : p / k) * H;
  bf16* dst = x_perm + static_cast<std::size_t>(r) * H;
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (p >= 0) load8<kVec>(src, c, H, f);  // a row past the kept ones (capacity): zeros
    store8<kVec>(dst, c, H, f);
  }
}

template <bool kVec>
static __global__ void moe_unpermute_kernel(bf16* y, const bf16* out_perm, const bf16* w,
                                            const int* pos, int k, int H) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < k; ++j) {
      const std::size_t i = static_cast<std::size_t>(t) * k + j;
      if (pos[i] < 0) continue;  // dropped by the capacity
      const float wj = __bfloat162float(w[i]);
      float o[8];
      load8<kVec>(out_perm + static_cast<std::size_t>(pos[i]) * H, c, H, o);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] += round_bf16(wj * o[q]);
    }
    store8<kVec>(y + static_cast<std::size_t>(t) * H, c, H, acc);
  }
}

template <bool kVec>
static __global__ void moe_unpermute_backward_kernel(bf16* dout_perm, float* dw, const bf16* dy,
                                                     const bf16* out_perm, const bf16* w,
                                                     const int* pos, int k, int H) {
  __shared__ float smem[32];
  const int i = blockIdx.x, t = i / k;
  if (pos[i] < 0) {  // dropped by the capacity: no row, no weight gradient (block-uniform)
    if (threadIdx.x == 0) dw[i] = 0.f;
    return;
  }
  const float wi = __bfloat162float(w[i]);
  const std::size_t r = static_cast<std::size_t>(pos[i]) * H;
  float dot[1] = {0.f};
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float d[8], o[8], g[8];
    load8<kVec>(dy + static_cast<std::size_t>(t) * H, c, H, d);
    load8<kVec>(out_perm + r, c, H, o);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      g[q] = wi * d[q];
      dot[0] += o[q] * d[q];
    }
    store8<kVec>(dout_perm + r, c, H, g);
  }
  block_sum<1>(dot, smem);
  if (threadIdx.x == 0) dw[i] = dot[0];
}

template <bool kVec>
static __global__ void moe_permute_backward_kernel(bf16* dx, const bf16* dx_perm, const bf16* add,
                                                   const int* pos, int k, int H) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, f[8];
    for (int j = 0; j < k; ++j) {
      const int r = pos[static_cast<std::size_t>(t) * k + j];
      if (r < 0) continue;  // dropped by the capacity
      load8<kVec>(dx_perm + static_cast<std::size_t>(r) * H, c, H, f);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] += f[q];
    }
    if (add) {
      load8<kVec>(add + static_cast<std::size_t>(t) * H, c, H, f);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] += f[q];
    }
    store8<kVec>(dx + static_cast<std::size_t>(t) * H, c, H, acc);
  }
}

static void check_rows(const char* op, int rows, int k, int H) {
  QT_CUDA_REQUIRE(rows >= 0 && k >= 1 && H >= 1, std::string(op) +
                                                     ": need rows >= 0, k >= 1, H >= 1, got rows=" +
                                                     std::to_string(rows) + " k=" +
                                                     std::to_string(k) + " H=" + std::to_string(H));
}

static unsigned int row_threads(int H) {
  return static_cast<unsigned int>(std::min(kRowThreads, ceil_div(ceil_div(H, 8), 32) * 32));
}

// The vector path for rows of H elements of these tensors (null ones ignored).
static bool rows_vec(int H, std::initializer_list<const void*> ps) {
  if (H % 8 != 0) return false;
  for (const void* p : ps)
    if (p && !is_aligned16(p)) return false;
  return true;
}

void moe_permute(bf16* x_perm, const bf16* x, const int* pair, int n_pairs, int k, int H,
                 cudaStream_t stream) {
  check_rows("moe_permute", n_pairs, k, H);
  if (n_pairs == 0) return;
  if (rows_vec(H, {x_perm, x}))
    moe_permute_kernel<true><<<n_pairs, row_threads(H), 0, stream>>>(x_perm, x, pair, k, H);
  else
    moe_permute_kernel<false><<<n_pairs, row_threads(H), 0, stream>>>(x_perm, x, pair, k, H);
  QT_CHECK_LAUNCH();
}

void moe_unpermute(bf16* y, const bf16* out_perm, const bf16* w, const int* pos, int N, int k,
                   int H, cudaStream_t stream) {
  check_rows("moe_unpermute", N, k, H);
  if (N == 0) return;
  if (rows_vec(H, {y, out_perm}))
    moe_unpermute_kernel<true><<<N, row_threads(H), 0, stream>>>(y, out_perm, w, pos, k, H);
  else
    moe_unpermute_kernel<false><<<N, row_threads(H), 0, stream>>>(y, out_perm, w, pos, k, H);
  QT_CHECK_LAUNCH();
}

void moe_unpermute_backward(bf16* dout_perm, float* dw, const bf16* dy, const bf16* out_perm,
                            const bf16* w, const int* pos, int N, int k, int H,
                            cudaStream_t stream) {
  check_rows("moe_unpermute_backward", N, k, H);
  if (N == 0) return;
  const int n = N * k;
  if (rows_vec(H, {dout_perm, dy, out_perm}))
    moe_unpermute_backward_kernel<true>
        <<<n, row_threads(H), 0, stream>>>(dout_perm, dw, dy, out_perm, w, pos, k, H);
  else
    moe_unpermute_backward_kernel<false>
        <<<n, row_threads(H), 0, stream>>>(dout_perm, dw, dy, out_perm, w, pos, k, H);
  QT_CHECK_LAUNCH();
}

void moe_permute_backward(bf16* dx, const bf16* dx_perm, const bf16* add, const int* pos, int N,
                          int k, int H, cudaStream_t stream) {
  check_rows("moe_permute_backward", N, k, H);
  if (N == 0) return;
  if (rows_vec(H, {dx, dx_perm, add}))
    moe_permute_backward_kernel<true><<<N, row_threads(H), 0, stream>>>(dx, dx_perm, add, pos, k, H);
  else
    moe_permute_backward_kernel<false>
        <<<N, row_threads(H), 0, stream>>>(dx, dx_perm, add, pos, k, H);
  QT_CHECK_LAUNCH();
}

}  // namespace qt::cuda
