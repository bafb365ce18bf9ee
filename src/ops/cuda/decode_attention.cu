// Flash-decoding attention over a key/value cache, and the cache write (decode_attention.cuh).
//
// decode_attention_split_kernel: one block of HD threads per (chunk s, kv head, query row i); the
// G = nh / nkv query heads of the kv head are handled together. Per tile of 32 keys:
//   1. scores: HD/8 threads per key row, each a 16-byte vector of the row, dotted with the
//      (scaled) queries in shared memory and reduced over those lanes; keys past the row's end
//      are -inf and never loaded;
//   2. softmax: warp w owns heads w, w + HD/32, ...; lane j holds key j's score: new running max
//      (log2 units), p = 2^(s - m), running sum rescaled by 2^(m_old - m);
//   3. values: thread d owns dimension d of every head: acc = alpha acc + sum_j p_j v[j, d].
// The chunk's acc (unnormalised), max and sum go to the workspace; decode_attention_combine
// merges the chunks of each (row, head) in chunk order and writes bf16.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <string>
#include <utility>

#include "ops/cuda/common.cuh"
#include "ops/cuda/decode_attention.cuh"

namespace qt::cuda {
namespace {

constexpr int kTile = 32;          // keys per tile: one per lane in the softmax step
constexpr int kMaxGroup = 16;      // query heads per kv head
constexpr int kTargetBlocks = 1024;
constexpr int kMinChunkKeys = 64;
constexpr int kMaxSplits = 256;

constexpr std::size_t round_up16(std::size_t bytes) { return (bytes + 15) / 16 * 16; }

struct Plan {
  int splits;  // chunks of keys
  int chunk;   // keys per chunk, a multiple of kTile
};

Plan make_plan(int n, int nkv, int kv_len, int splits) {
  const int tiles = ceil_div(kv_len, kTile);
  if (splits <= 0) splits = decode_attention_splits(n, nkv, kv_len);
  splits = std::clamp(splits, 1, tiles);
  const int chunk = ceil_div(tiles, splits) * kTile;
  return {ceil_div(kv_len, chunk), chunk};  // no chunk that even the last row leaves empty
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// part_acc [n, nh, splits, HD], part_ml [n, nh, splits, 2] (max in log2 units, sum).
template <int HD>
__global__ void __launch_bounds__(HD)
    decode_attention_split_kernel(float* __restrict__ part_acc, float* __restrict__ part_ml,
                                  const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                  const bf16* __restrict__ vc, int start, int nh, int nkv,
                                  int cap, int chunk, int splits, float scale_log2) {
  constexpr int TPK = HD / 8;       // threads per key row in the score step
  constexpr int KPP = HD / TPK;     // key rows per pass (8)
  constexpr int NW = HD / 32;       // warps
  const int s = blockIdx.x, kvh = blockIdx.y, i = blockIdx.z;
  const int G = nh / nkv, h0 = kvh * G;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int k_begin = s * chunk;
  const int k_end = min(k_begin + chunk, start + i + 1);  // row i sees keys [0, start + i]

  __shared__ __align__(16) float sq[kMaxGroup][HD];  // q * scale * log2(e)
  __shared__ float sp[kMaxGroup][kTile];             // scores, then probabilities
  __shared__ float salpha[kMaxGroup];                // rescale of acc for this tile
  __shared__ float sm[kMaxGroup], sl[kMaxGroup];     // running max (log2 units) and sum

  for (int g = 0; g < G; ++g)
    sq[g][t] = __bfloat162float(q[(static_cast<long long>(i) * nh + h0 + g) * HD + t]) * scale_log2;
  if (t < G) {
    sm[t] = -INFINITY;
    sl[t] = 0.f;
  }
  float acc[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) acc[g] = 0.f;
  __syncthreads();

  const bf16* kb = kc + static_cast<long long>(kvh) * cap * HD;
  const bf16* vb = vc + static_cast<long long>(kvh) * cap * HD;
  const int part = t % TPK, kk = t / TPK;
  for (int j0 = k_begin; j0 < k_end; j0 += kTile) {
    const int valid = min(kTile, k_end - j0);  // >= 1
    // 1. scores of keys j0 .. j0 + 31 (-inf past the end)
#pragma unroll
    for (int pass = 0; pass < kTile / KPP; ++pass) {
      const int jj = pass * KPP + kk;
      const bool ok = jj < valid;
      float kf[8];
      if (ok) {
        load_bf16x8(kb + static_cast<long long>(j0 + jj) * HD + part * 8, kf);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < G) {
          const float4 a = *reinterpret_cast<const float4*>(&sq[g][part * 8]);
          const float4 b = *reinterpret_cast<const float4*>(&sq[g][part * 8 + 4]);
          float d = a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] +
                    b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
#pragma unroll
          for (int o = TPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
          if (part == 0) sp[g][jj] = ok ? d : -INFINITY;
        }
      }
    }
    __syncthreads();
    // 2. online softmax, one warp per head (lane = key); the tile has a valid key, so the new
    // max is finite and masked keys get p = 0.
    for (int g = warp; g < G; g += NW) {
      const float x = sp[g][lane];
      const float m_old = sm[g];
      const float m_new = fmaxf(m_old, warp_max(x));
      const float p = exp2f(x - m_new);
      const float sum = warp_sum(p);
      sp[g][lane] = p;
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        salpha[g] = alpha;
        sl[g] = sl[g] * alpha + sum;
        sm[g] = m_new;
      }
    }
    __syncthreads();
    // 3. values: dimension t of every head
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g)
      if (g < G) acc[g] *= salpha[g];
    const bf16* vt = vb + static_cast<long long>(j0) * HD + t;
    if (valid == kTile) {
#pragma unroll
      for (int jj = 0; jj < kTile; ++jj) {
        const float v = __bfloat162float(vt[jj * HD]);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g)
          if (g < G) acc[g] += sp[g][jj] * v;
      }
    } else {
      for (int jj = 0; jj < valid; ++jj) {
        const float v = __bfloat162float(vt[jj * HD]);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g)
          if (g < G) acc[g] += sp[g][jj] * v;
      }
    }
    __syncthreads();  // sp is rewritten by the next tile
  }
  // An empty chunk (past this row's keys) leaves max -inf and sum 0; the merge skips it.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g < G) {
      const long long r = (static_cast<long long>(i) * nh + h0 + g) * splits + s;
      part_acc[r * HD + t] = acc[g];
      if (t == 0) {
        part_ml[2 * r] = sm[g];
        part_ml[2 * r + 1] = sl[g];
      }
    }
  }
}

// One block of HD threads per (row, head) r: out[r, d] = sum_s 2^(m_s - M) acc_s[d] / L.
template <int HD>
__global__ void __launch_bounds__(HD)
    decode_attention_combine_kernel(bf16* __restrict__ out, const float* __restrict__ part_acc,
                                    const float* __restrict__ part_ml, int splits) {
  const long long r = blockIdx.x;
  const int t = threadIdx.x;
  const float* ml = part_ml + r * splits * 2;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s)
    if (ml[2 * s + 1] > 0.f) M = fmaxf(M, ml[2 * s]);
  float L = 0.f, o = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float l = ml[2 * s + 1];
    if (l > 0.f) {
      const float w = exp2f(ml[2 * s] - M);
      L += l * w;
      o += part_acc[(r * splits + s) * HD + t] * w;
    }
  }
  out[r * HD + t] = __float2bfloat16_rn(o / L);
}

// One thread per 16-byte vector: blockIdx.y 0 writes keys, 1 values.
__global__ void kv_cache_write_kernel(bf16* __restrict__ kc, bf16* __restrict__ vc,
                                      const bf16* __restrict__ k, int k_ld,
                                      const bf16* __restrict__ v, int v_ld, int n, int start,
                                      int nkv, int hd, int cap) {
  const int per_row = nkv * hd / 8;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long long>(n) * per_row) return;
  const int i = static_cast<int>(idx / per_row);
  const int c = static_cast<int>(idx % per_row) * 8;  // column in the row of nkv * hd
  const int g = c / hd, d = c % hd;
  const bool is_v = blockIdx.y == 1;
  const bf16* src = (is_v ? v + static_cast<long long>(i) * v_ld : k + static_cast<long long>(i) * k_ld) + c;
  bf16* dst = (is_v ? vc : kc) + (static_cast<long long>(g) * cap + start + i) * hd + d;
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}

void check_aligned(const void* p, const char* op, const char* name) {
  QT_CUDA_REQUIRE(is_aligned16(p), std::string(op) + ": " + name + " must be 16-byte aligned");
}

void check_shape(const char* op, int n, int start, int nh, int nkv, int hd, int cap) {
  QT_CUDA_REQUIRE(hd == 64 || hd == 128,
                  std::string(op) + ": head_dim must be 64 or 128, got " + std::to_string(hd));
  QT_CUDA_REQUIRE(nh > 0 && nkv > 0 && nh % nkv == 0 && nh / nkv <= kMaxGroup,
                  std::string(op) + ": heads " + std::to_string(nh) + " must be a multiple of kv "
                      "heads " + std::to_string(nkv) + ", at most " + std::to_string(kMaxGroup) +
                      " per kv head");
  QT_CUDA_REQUIRE(n >= 1 && n <= 65535 && start >= 0 && start + n <= cap,
                  std::string(op) + ": rows " + std::to_string(n) + " (at most 65535) at " +
                      std::to_string(start) + " in a cache of " + std::to_string(cap));
}

}  // namespace

int decode_attention_splits(int n, int nkv, int kv_len) {
  const long long per_chunk = std::max(1LL, static_cast<long long>(n) * nkv);  // blocks
  const long long want = (kTargetBlocks + per_chunk - 1) / per_chunk;
  const long long most = std::max(1, kv_len / kMinChunkKeys);
  return static_cast<int>(std::clamp<long long>(std::min(want, most), 1, kMaxSplits));
}

std::size_t decode_attention_workspace_bytes(int n, int nh, int nkv, int hd, int kv_len,
                                             int splits) {
  const Plan p = make_plan(n, nkv, std::max(kv_len, 1), splits);
  const std::size_t parts = static_cast<std::size_t>(n) * nh * p.splits;
  return round_up16(parts * hd * sizeof(float)) + parts * 2 * sizeof(float);
}

void decode_attention(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache, int n,
                      int start, int nh, int nkv, int hd, int cap, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream, int splits) {
  const char* op = "decode_attention";
  check_shape(op, n, start, nh, nkv, hd, cap);
  for (auto [p, name] : {std::pair<const void*, const char*>{out, "out"}, {q, "q"},
                         {k_cache, "k_cache"}, {v_cache, "v_cache"}, {workspace, "workspace"}})
    check_aligned(p, op, name);
  QT_CUDA_REQUIRE(static_cast<const void*>(out) != static_cast<const void*>(q),
                  std::string(op) + ": out must not alias q");
  const int kv_len = start + n;
  const std::size_t need = decode_attention_workspace_bytes(n, nh, nkv, hd, kv_len, splits);
  QT_CUDA_REQUIRE(workspace_bytes >= need, std::string(op) + ": workspace of " +
                                               std::to_string(workspace_bytes) + " bytes, needs " +
                                               std::to_string(need));
  const Plan p = make_plan(n, nkv, kv_len, splits);
  const std::size_t parts = static_cast<std::size_t>(n) * nh * p.splits;
  float* part_acc = static_cast<float*>(workspace);
  float* part_ml = reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                            round_up16(parts * hd * sizeof(float)));
  const float scale_log2 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)) *
                                              1.4426950408889634);  // log2(e)
  const dim3 grid(p.splits, nkv, n);
  const unsigned rows = static_cast<unsigned>(n) * nh;
  if (hd == 64) {
    decode_attention_split_kernel<64><<<grid, 64, 0, stream>>>(
        part_acc, part_ml, q, k_cache, v_cache, start, nh, nkv, cap, p.chunk, p.splits, scale_log2);
    QT_CHECK_LAUNCH();
    decode_attention_combine_kernel<64><<<rows, 64, 0, stream>>>(out, part_acc, part_ml, p.splits);
  } else {
    decode_attention_split_kernel<128><<<grid, 128, 0, stream>>>(
        part_acc, part_ml, q, k_cache, v_cache, start, nh, nkv, cap, p.chunk, p.splits, scale_log2);
    QT_CHECK_LAUNCH();
    decode_attention_combine_kernel<128><<<rows, 128, 0, stream>>>(out, part_acc, part_ml,
                                                                  p.splits);
  }
  QT_CHECK_LAUNCH();
}

void kv_cache_write(bf16* k_cache, bf16* v_cache, const bf16* k, int k_ld, const bf16* v, int v_ld,
                    int n, int start, int nkv, int hd, int cap, cudaStream_t stream) {
  const char* op = "kv_cache_write";
  QT_CUDA_REQUIRE(nkv > 0 && hd > 0 && hd % 8 == 0,
                  std::string(op) + ": kv heads " + std::to_string(nkv) + ", head_dim " +
                      std::to_string(hd) + " (a multiple of 8)");
  QT_CUDA_REQUIRE(n >= 0 && start >= 0 && start + n <= cap,
                  std::string(op) + ": rows " + std::to_string(n) + " at " +
                      std::to_string(start) + " in a cache of " + std::to_string(cap));
  QT_CUDA_REQUIRE(k_ld >= nkv * hd && k_ld % 8 == 0 && v_ld >= nkv * hd && v_ld % 8 == 0,
                  std::string(op) + ": row strides " + std::to_string(k_ld) + ", " +
                      std::to_string(v_ld) + " must be multiples of 8 and >= nkv * hd");
  for (auto [p, name] : {std::pair<const void*, const char*>{k_cache, "k_cache"},
                         {v_cache, "v_cache"}, {k, "k"}, {v, "v"}})
    check_aligned(p, op, name);
  if (n == 0) return;
  const long long vecs = static_cast<long long>(n) * nkv * hd / 8;
  const dim3 grid(static_cast<unsigned>(ceil_div<long long>(vecs, 256)), 2);
  kv_cache_write_kernel<<<grid, 256, 0, stream>>>(k_cache, v_cache, k, k_ld, v, v_ld, n, start,
                                                  nkv, hd, cap);
  QT_CHECK_LAUNCH();
}

}  // namespace qt::cuda
