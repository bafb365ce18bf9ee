// Causal GQA flash-attention forward for sm_90a: wgmma (bf16 in, fp32 accumulation), tiles brought
// into 128B-swizzled shared memory with cp.async. Same contract and results layout as the mma.sync
// kernel in attention_forward.cu (docs/attention.md).
//
// One block of NWG (1 or 2) warpgroups per (query tile of BR = 64 NWG rows, query head, batch);
// warpgroup wg owns query rows 64 wg .. 64 wg + 63 of the tile. The block walks the key/value tiles
// of BC = 64 NWG rows from 0 to the diagonal (one block of 2 warpgroups per SM, or two blocks of
// one, whose phases then drift apart). Iteration j, per warpgroup:
//   issue S_j = Q K_j^T            (wgmma, A = Q and B = K_j from shared memory)
//   issue O += P_{j-1} V_{j-1}     (wgmma, A = P in registers, B = V MN-major)
//   start the cp.async loads of K_{j+1} and V_j
//   wait for S_j; online softmax of S_j (running max m, partial row sums l) while P V runs;
//   wait for P V; O *= alpha_j; P_j = bf16(exp2(S_j scale log2e - m)).
// After the last tile: O += P V once more, out = O / l (staged through shared memory, 16-byte
// stores), lse = (m + log2 l) ln 2. One barrier per iteration orders the buffers: K_{j+1} goes
// where K_{j-1} was (every warpgroup waited for S_{j-1} before the barrier), V_j where V_{j-2} was
// (P_{j-2} V_{j-2} was waited for in iteration j-1).
// PACKED (pos given): keys below a row's document start ds[t] = t - pos[t] are masked too, and the
// walk starts at the tile of ds[q0] (ds never decreases: earlier tiles hold no key of any row).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>

#include "cuda/check.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/attention_sm90_steps.cuh"
#include "ops/cuda/attention_wgmma.cuh"
#include "ops/cuda/common.cuh"

namespace qt::cuda {
namespace {

using namespace attn;

constexpr int kFwdDefaultWarps = 12;  // warp-specialised (cfg.fwd_warps = 0)

template <int HD, int NWG>
constexpr int fwd_smem_bytes() {
  return 5 * 64 * NWG * HD * 2 + 1024;  // Q + 2 x (K + V), + alignment slack
}

template <int HD, int NWG, bool PACKED>
__global__ void __launch_bounds__(128 * NWG, 3 - NWG)
    attention_forward_sm90_kernel(bf16* __restrict__ out, float* __restrict__ lse,
                                  const bf16* __restrict__ q, const bf16* __restrict__ k,
                                  const bf16* __restrict__ v, const int* __restrict__ pos, int T,
                                  int nh, int nkv, float scale_log2) {
#if QT_ATTN_HAS_WGMMA
  constexpr int BR = 64 * NWG, BC = 64 * NWG, NT = 128 * NWG;
  constexpr int KT = HD / 16;  // k-steps of S = Q K^T
  constexpr int PT = BC / 16;  // k-steps of O += P V
  constexpr int TILE = BC * HD * 2;

  const int n_qtiles = (T + BR - 1) / BR;
  const int qt = n_qtiles - 1 - static_cast<int>(blockIdx.z);  // longest rows first
  const int h = blockIdx.x, b = blockIdx.y;
  const int kvh = h / (nh / nkv);
  const int tid = threadIdx.x, wg = warpgroup_index(), warp = (tid >> 5) & 3, lane = tid & 31;
  const long long ldq = static_cast<long long>(nh) * HD, ldkv = static_cast<long long>(nkv) * HD;
  const bf16* qb = q + static_cast<long long>(b) * T * ldq + h * HD;
  const bf16* kb = k + static_cast<long long>(b) * T * ldkv + kvh * HD;
  const bf16* vb = v + static_cast<long long>(b) * T * ldkv + kvh * HD;

  extern __shared__ char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // swizzled tiles start 1024-aligned
  char* sQ = smem_raw + (base - raw);            // [BR][HD]
  const uint32_t aQ = base, aK = aQ + BR * HD * 2, aV = aK + 2 * TILE;  // K, V: [2][BC][HD]

  const int q0 = qt * BR;
  const int q_end = min(q0 + BR, T);
  const int n_kv = (q_end - 1) / BC + 1;

  // Packed: document starts of rows g and g+8 (padded rows >= T: the last row's, the largest),
  // their maximum over this warp (its last row's), and the first key tile any row reads.
  int j0 = 0, ds_row[2] = {0, 0}, ds_warp = 0;
  if constexpr (PACKED) {
    const int* pb = pos + static_cast<long long>(b) * T;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = min(q0 + wg * 64 + warp * 16 + (lane >> 2) + 8 * r, T - 1);
      ds_row[r] = row - pb[row];
    }
    ds_warp = __shfl_sync(0xffffffffu, ds_row[1], 31);
    j0 = (q0 - pb[q0]) / BC;
  }

  load_tile_sw128<BR, HD, NT>(aQ, qb, q0, ldq, T, tid);
  load_tile_sw128<BC, HD, NT>(aK + (j0 & 1) * TILE, kb, j0 * BC, ldkv, T, tid);
  cp_async_commit();
  cp_async_wait_all();
  fence_proxy_async();
  __syncthreads();

  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float s[BC / 2];  // S_j, then P_j (fp32)
  uint32_t p[PT][4];
  float m_run[2] = {-INFINITY, -INFINITY};                    // rows g and g+8, log2 units (scaled)
  float l_run[2] = {0.f, 0.f};                                // this lane's part of the row sums
  const int row_q0 = q0 + wg * 64 + warp * 16 + (lane >> 2);  // query of s[4nb], s[4nb+1]; +8
  const int q_row0 = wg * 64;                                 // this warpgroup's rows in sQ

  // S_j = Q K_j^T into s (one commit group).
  auto issue_s = [&](int j) {
    const uint32_t tK = aK + (j & 1) * TILE;
    wgmma_ss_kmajor<BC, BR, BC, KT>(s, aQ, q_row0, tK);
    wgmma_commit();
  };
  // O += P V_j (one commit group).
  auto issue_pv = [&](int j) {
    const uint32_t tV = aV + (j & 1) * TILE;
    wgmma_rs_mnmajor<HD, BC, PT>(o, p, tV);
    wgmma_commit();
  };
  // cp.async of K_{j+1} (zero rows past the last tile: branch-free) and V_j (one commit group).
  auto load_kv = [&](int j, int n_kv) {
    load_tile_sw128<BC, HD, NT>(aK + ((j + 1) & 1) * TILE, kb, (j + 1) * BC, ldkv,
                                j + 1 < n_kv ? T : 0, tid);
    load_tile_sw128<BC, HD, NT>(aV + (j & 1) * TILE, vb, j * BC, ldkv, T, tid);
    cp_async_commit();
  };
  // Masks and online softmax of S_j (attention_sm90_steps.cuh).
  auto softmax = [&](int j, float(&alpha)[2]) {
    fwd_online_softmax<BC, PACKED>(s, m_run, l_run, alpha, j * BC, q0, row_q0, ds_row, ds_warp,
                                   lane, scale_log2);
  };

  // Tile j0 (O is still zero: no P V to overlap with).
  {
    wgmma_fence();
    issue_s(j0);
    load_kv(j0, n_kv);
    wgmma_wait<0>();
    fence_acc(s);
    float alpha[2];
    softmax(j0, alpha);
    acc_to_frags<PT>(p, s);
  }
  for (int j = j0 + 1; j < n_kv; ++j) {
    cp_async_wait_all();  // K_j and V_{j-1} have landed (this thread's part) ...
    fence_proxy_async();
    __syncthreads();  // ... everyone's, and every warpgroup is done with K_{j-1}, V_{j-2}
    wgmma_fence();
    issue_s(j);
    issue_pv(j - 1);
    load_kv(j, n_kv);
    wgmma_wait<1>();  // S_j
    fence_acc(s);
    float alpha[2];
    softmax(j, alpha);  // overlaps O += P_{j-1} V_{j-1}
    wgmma_wait<0>();
    fence_acc(o);
    rescale_rows<HD>(o, alpha);
    acc_to_frags<PT>(p, s);
  }
  // O += P V of the last tile.
  cp_async_wait_all();
  fence_proxy_async();
  __syncthreads();
  wgmma_fence();
  issue_pv(n_kv - 1);
  wgmma_wait<0>();
  fence_acc(o);

  // Epilogue: full row sums; O / l staged through this warp's own rows of sQ (only this
  // warpgroup's wgmmas read them, and they are complete).
  float inv[2];
  finish_forward_rows(inv, l_run, m_run, lse + (static_cast<long long>(b) * nh + h) * T, row_q0, T,
                      lane);
  const int wrow = q_row0 + warp * 16;
  stage_acc_sw128<BR, HD>(sQ, wrow, o, inv[0], inv[1], lane);
  __syncwarp();
  bf16* ob = out + static_cast<long long>(b) * T * ldq + h * HD;
  store_warp_rows_sw128<BR, HD>(ob, ldq, q0 + wrow, T, sQ, wrow, lane);
#else
  __trap();  // built without sm_90a: the dispatcher never launches this
#endif
}

template <int HD, int NWG>
void launch_forward_sm90(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                         const int* pos, int B, int T, int nh, int nkv, cudaStream_t stream) {
  constexpr int smem = fwd_smem_bytes<HD, NWG>();
  auto kernel = pos ? attention_forward_sm90_kernel<HD, NWG, true>
                    : attention_forward_sm90_kernel<HD, NWG, false>;
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  const dim3 grid = tiles_last_grid((T + 64 * NWG - 1) / (64 * NWG), nh, B);
  const float scale_log2 = softmax_scale(HD).log2;
  kernel<<<grid, 128 * NWG, smem, stream>>>(out, lse, q, k, v, pos, T, nh, nkv, scale_log2);
  QT_CHECK_LAUNCH();
}

// Has static shared memory only in its sm_90a build: cudaFuncGetAttributes then tells, without a
// launch or a sync, whether the image the driver picked for this device is the sm_90a one.
__global__ void attention_sm90a_probe_kernel(int* sink) {
#if QT_ATTN_HAS_WGMMA
  __shared__ int marker[64];
  marker[threadIdx.x & 63] = static_cast<int>(threadIdx.x);
  __syncthreads();
  if (sink) sink[threadIdx.x] = marker[(threadIdx.x + 1) & 63];
#else
  if (sink) sink[threadIdx.x] = 0;
#endif
}

bool probe_wgmma(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major != 9 || minor != 0) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, attention_sm90a_probe_kernel) != cudaSuccess) {
    cudaGetLastError();  // no image for this device: clear the error, use the mma.sync path
    return false;
  }
  return attr.sharedSizeBytes >= 64 * sizeof(int);
}

}  // namespace

bool attention_wgmma_available() {
  constexpr int kMaxDevices = 64;
  static std::atomic<signed char> cache[kMaxDevices];  // 0 unknown, 1 yes, -1 no
  int device = 0;
  QT_CHECK_CUDA(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return probe_wgmma(device);
  signed char c = cache[device].load(std::memory_order_relaxed);
  if (c == 0) {
    c = probe_wgmma(device) ? 1 : -1;
    cache[device].store(c, std::memory_order_relaxed);
  }
  return c > 0;
}

bool attention_use_wgmma(const AttentionConfig& cfg) {
  switch (cfg.path) {
    case AttentionPath::kMma:
      return false;
    case AttentionPath::kWgmma:
      if (!attention_wgmma_available())
        fail_library("attention", __FILE__, __LINE__, "attention_wgmma_available()",
                     "AttentionPath::kWgmma needs a build for sm_90a and a compute capability "
                     "9.0 device");
      return true;
    case AttentionPath::kAuto:
    default:
      return attention_wgmma_available();
  }
}

void attention_forward_sm90(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                            const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                            int warps, cudaStream_t stream) {
  check_shapes("attention_forward", B, T, nh, nkv, hd);
  const int nwg = (warps ? warps : kFwdDefaultWarps) / 4;  // 3: warp-specialised
  if (nwg == 3 && is_aligned16(q) && is_aligned16(k) && is_aligned16(v)) {
    attention_forward_ws_sm90(out, lse, q, k, v, pos, B, T, nh, nkv, hd, stream);
    return;
  }
  if (hd == 128) {
    if (nwg == 1)
      launch_forward_sm90<128, 1>(out, lse, q, k, v, pos, B, T, nh, nkv, stream);
    else
      launch_forward_sm90<128, 2>(out, lse, q, k, v, pos, B, T, nh, nkv, stream);
  } else {
    if (nwg == 1)
      launch_forward_sm90<64, 1>(out, lse, q, k, v, pos, B, T, nh, nkv, stream);
    else
      launch_forward_sm90<64, 2>(out, lse, q, k, v, pos, B, T, nh, nkv, stream);
  }
}

}  // namespace qt::cuda
