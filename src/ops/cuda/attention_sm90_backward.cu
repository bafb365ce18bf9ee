// Causal GQA flash-attention backward for sm_90a: wgmma (bf16 in, fp32 accumulation), tiles in
// 128B-swizzled shared memory via cp.async. Same equations, kernels and determinism as the mma.sync
// path in attention_backward.cu (docs/attention.md): no atomics, every output element summed by
// one thread in a fixed order.
//
//  1. delta: D_i = sum_d dout[i, d] out[i, d] (fp32), kept in the first 4 bytes of dq's row i.
//  2. dk/dv: a block of NWG warpgroups per (kv tile of BC = 64 NWG rows, kv head, batch); warpgroup
//  wg
//     owns kv rows 64 wg .. 64 wg + 63 with their dK and dV in fp32 registers. The block loops over
//     the query heads of the group and, for each, over the query tiles of BRQ = 64 rows at or after
//     the diagonal (Q, dO, lse, D double-buffered), per warpgroup:
//       S^T = K Q^T, dP^T = V dO^T          (wgmma, A and B from shared memory, issued together)
//       P^T = exp2(S^T scale log2e - lse log2e)        (registers, masked)
//       dV += P^T dO                         (wgmma, A = P^T in registers, B = dO MN-major)
//       dS^T = P^T (dP^T - D);  dK += dS^T Q (wgmma, A = dS^T in registers, B = Q MN-major)
//     A warpgroup whose rows all lie after the query tile skips the tile (it would add zeros).
//  3. dq: a block of NWG warpgroups per (query tile of 64 NWG rows, query head, batch); warpgroup
//  wg
//     owns 64 query rows, loops over the kv tiles of BCK = 64 rows up to its diagonal:
//       S = Q K^T, dP = dO V^T (issued together), P, dS = P (dP - D), dQ += dS K (K MN-major).
// Every step ends with all its wgmmas complete, so one barrier per step orders the double buffers.
// NWG is 1 or 2: one block of two warpgroups per SM, or two blocks of one (whose phases drift
// apart, so one block's exponentials overlap the other's products).
// PACKED (pos given): key j is also masked for query t when j < ds[t] = t - pos[t]. ds never
// decreases, so dk/dv stops at the first query tile whose first row starts its document after the
// kv tile's last row (and a warpgroup skips tiles whose first query starts after its last kv
// row), and dq starts at the kv tile holding ds of its first row (a warpgroup skips kv tiles
// before its own first row's ds).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

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

constexpr int kQStep = 64;            // query rows per dk/dv step
constexpr int kDkdvDefaultWarps = 12;  // warp-specialised dK/dV (cfg.dkdv_warps = 0)
constexpr int kDqDefaultWarps = 12;    // warp-specialised dQ (cfg.dq_warps = 0)
// kv rows per dq step. (128, which makes S = Q K^T and dP = dO V^T m64n128 products, measured
// the same on an H100 and spills registers at hd 128: three [64, 128] fp32 accumulators.)
constexpr int kDqKvStep = 64;

// One warp per (b, t, head) row (the same kernel as attention_backward.cu's; kernels are static
// to their file).
template <int HD>
__global__ void __launch_bounds__(256)
    attention_delta_sm90_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout,
                                const bf16* __restrict__ out, long long rows) {
  const long long row = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  constexpr int PER = HD / 32;
  const bf16* a = dout + row * HD + lane * PER;
  const bf16* o = out + row * HD + lane * PER;
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < PER; e += 2) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(a + e));
    const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + e));
    sum += x.x * y.x + x.y * y.y;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) *reinterpret_cast<float*>(dq + row * HD) = sum;
}

template <int HD, int NWG, bool PACKED>
constexpr int dkdv_smem_bytes() {
  // K, V [BC][HD]; Q, dO [2][BRQ][HD]; lse, D (and pos when PACKED) [2][BRQ] 4 bytes; + slack
  return 2 * 64 * NWG * HD * 2 + 4 * kQStep * HD * 2 + (PACKED ? 6 : 4) * kQStep * 4 + 1024;
}

template <int HD, int NWG, bool PACKED>
__global__ void __launch_bounds__(128 * NWG, 3 - NWG)
    attention_dkdv_sm90_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* dq_delta,
                               const bf16* __restrict__ dout, const bf16* __restrict__ q,
                               const bf16* __restrict__ k, const bf16* __restrict__ v,
                               const float* __restrict__ lse, const int* __restrict__ pos, int T,
                               int nh, int nkv, float scale, float scale_log2) {
#if QT_ATTN_HAS_WGMMA
  constexpr int BC = 64 * NWG, BRQ = kQStep, NT = 128 * NWG;
  constexpr int QTILE = BRQ * HD * 2;
  static_assert(NT >= 2 * BRQ, "lse and D rows are loaded one per thread");

  const int kvt = blockIdx.z;  // kv tile 0 sees the most query rows: launched first
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int ratio = nh / nkv;
  const int tid = threadIdx.x, wg = warpgroup_index(), warp = (tid >> 5) & 3, lane = tid & 31;
  const long long ldq = static_cast<long long>(nh) * HD, ldkv = static_cast<long long>(nkv) * HD;
  const long long kv_off = static_cast<long long>(b) * T * ldkv + kvh * HD;

  extern __shared__ char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  char* sK = smem_raw + (base - raw);                                      // [BC][HD]
  char* sV = sK + BC * HD * 2;                                             // [BC][HD]
  const uint32_t aK = base, aV = aK + BC * HD * 2, aQ = aV + BC * HD * 2;  // Q: [2][BRQ][HD]
  const uint32_t adO = aQ + 2 * QTILE;                                     // dO: [2][BRQ][HD]
  const uint32_t aL = adO + 2 * QTILE, aD = aL + 2 * BRQ * 4;              // lse, D: [2][BRQ]
  const uint32_t aP = aD + 2 * BRQ * 4;                                    // pos: [2][BRQ]
  const float* sL = reinterpret_cast<const float*>(sK + (aL - aK));
  const float* sD = reinterpret_cast<const float*>(sK + (aD - aK));
  const int* sP = reinterpret_cast<const int*>(sK + (aP - aK));

  const int k0 = kvt * BC;
  const int* pb = PACKED ? pos + static_cast<long long>(b) * T : nullptr;
  const QueryTiles tiles = dkdv_query_tiles<PACKED>(pb, T, BRQ, k0, k0 + BC - 1);
  const int i_first = tiles.first, per_head = tiles.count;
  const int steps = ratio * per_head;

  // Step s reads query head kvh * ratio + hs and query tile i_first + is, where hs = s / per_head
  // and is = s % per_head (kept as counters by the loop: no division per step).
  auto load_step = [&](int hs, int is, int buf) {
    const int h = kvh * ratio + hs;
    const int qrow0 = (i_first + is) * BRQ;
    const long long q_off = static_cast<long long>(b) * T * ldq + h * HD;
    load_tile_sw128<BRQ, HD, NT>(aQ + buf * QTILE, q + q_off, qrow0, ldq, T, tid);
    load_tile_sw128<BRQ, HD, NT>(adO + buf * QTILE, dout + q_off, qrow0, ldq, T, tid);
    if (tid < BRQ) {
      const int t = qrow0 + tid;
      const float* src = lse + (static_cast<long long>(b) * nh + h) * T + min(t, T - 1);
      cp_async_4(aL + (buf * BRQ + tid) * 4, src, t < T);
      if constexpr (PACKED) cp_async_4(aP + (buf * BRQ + tid) * 4, pb + min(t, T - 1), t < T);
    } else if (tid < 2 * BRQ) {
      const int t = qrow0 + tid - BRQ;
      cp_async_4(aD + (buf * BRQ + tid - BRQ) * 4,
                 delta_ptr(dq_delta, b, min(t, T - 1), h, T, nh, HD), t < T);
    }
  };

  load_tile_sw128<BC, HD, NT>(aK, k + kv_off, k0, ldkv, T, tid);
  load_tile_sw128<BC, HD, NT>(aV, v + kv_off, k0, ldkv, T, tid);
  load_step(0, 0, 0);
  cp_async_commit();

  float dk_acc[HD / 2], dv_acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk_acc[i] = dv_acc[i] = 0.f;
  const int kv_wg0 = k0 + wg * 64;                       // first kv row of this warpgroup
  const int kv_row0 = kv_wg0 + warp * 16 + (lane >> 2);  // kv row of st[4nb], st[4nb+1]; +8
  const int kv_srow = wg * 64;                           // this warpgroup's rows in sK, sV

  int hs = 0, is = -1;  // s / per_head and s % per_head of step s, advanced at its top
  for (int s = 0; s < steps; ++s) {
    if (++is == per_head) {
      is = 0;
      ++hs;
    }
    const bool last_tile = is + 1 == per_head;  // step s+1 starts the next head
    cp_async_wait_all();  // step s has landed (this thread's part) ...
    fence_proxy_async();
    __syncthreads();  // ... everyone's; every warpgroup finished step s-1
    // Step s+1's loads go out after this step's first products are issued, so that their
    // address arithmetic does not delay them; a skipped step issues them at once.
    auto prefetch = [&] {
      if (s + 1 < steps) {
        load_step(hs + last_tile, last_tile ? 0 : is + 1, (s + 1) & 1);
        cp_async_commit();
      }
    };
    const int buf = s & 1;
    const int q_base = (i_first + is) * BRQ;
    if (q_base + BRQ - 1 < kv_wg0) {  // every query of the tile precedes these kv rows
      prefetch();
      continue;
    }
    const int* Pb = sP + buf * BRQ;  // pos of the tile's queries (PACKED)
    bool low_mask = false;           // some query's document starts after a kv row
    if constexpr (PACKED) {
      if (q_base - Pb[0] > kv_wg0 + 63) {  // every query's document starts after them
        prefetch();
        continue;
      }
      const int last = min(BRQ, T - q_base) - 1;
      low_mask = q_base + last - Pb[last] > kv_wg0 + warp * 16;
    }
    dkdv_step<HD, BC, BRQ, PACKED>(dk_acc, dv_acc, aK, aV, kv_srow, aQ + buf * QTILE,
                                   adO + buf * QTILE, sL + buf * BRQ, sD + buf * BRQ, Pb, q_base,
                                   kv_wg0, kv_row0, low_mask, T, scale_log2, lane, prefetch);
  }

  // Epilogue through this warp's own rows of sK and sV (only this warpgroup's wgmmas read them;
  // the barrier makes sure every warp of it is past its last wait).
  __syncthreads();
  const int wrow = kv_srow + warp * 16;
  stage_acc_sw128<BC, HD>(sK, wrow, dk_acc, scale, scale, lane);
  stage_acc_sw128<BC, HD>(sV, wrow, dv_acc, 1.f, 1.f, lane);
  __syncwarp();
  store_warp_rows_sw128<BC, HD>(dk + kv_off, ldkv, k0 + wrow, T, sK, wrow, lane);
  store_warp_rows_sw128<BC, HD>(dv + kv_off, ldkv, k0 + wrow, T, sV, wrow, lane);
#else
  __trap();  // built without sm_90a: the dispatcher never launches this
#endif
}

template <int HD, int NWG, int BCK>
constexpr int dq_smem_bytes() {
  // Q, dO [BR][HD]; K, V [2][BCK][HD]; + alignment slack
  return 2 * 64 * NWG * HD * 2 + 4 * BCK * HD * 2 + 1024;
}

template <int HD, int NWG, int BCK, bool PACKED>
__global__ void __launch_bounds__(128 * NWG, 3 - NWG)
    attention_dq_sm90_kernel(bf16* dq, const bf16* __restrict__ dout, const bf16* __restrict__ q,
                             const bf16* __restrict__ k, const bf16* __restrict__ v,
                             const float* __restrict__ lse, const int* __restrict__ pos, int T,
                             int nh, int nkv, float scale, float scale_log2) {
#if QT_ATTN_HAS_WGMMA
  constexpr int BR = 64 * NWG, NT = 128 * NWG;
  constexpr int KTILE = BCK * HD * 2;

  const int n_qtiles = (T + BR - 1) / BR;
  const int qt = n_qtiles - 1 - static_cast<int>(blockIdx.z);  // longest rows first
  const int h = blockIdx.x, b = blockIdx.y;
  const int kvh = h / (nh / nkv);
  const int tid = threadIdx.x, wg = warpgroup_index(), warp = (tid >> 5) & 3, lane = tid & 31;
  const long long ldq = static_cast<long long>(nh) * HD, ldkv = static_cast<long long>(nkv) * HD;
  const long long q_off = static_cast<long long>(b) * T * ldq + h * HD;
  const bf16* kb = k + static_cast<long long>(b) * T * ldkv + kvh * HD;
  const bf16* vb = v + static_cast<long long>(b) * T * ldkv + kvh * HD;

  extern __shared__ char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  char* sQ = smem_raw + (base - raw);                                        // [BR][HD]
  const uint32_t aQ = base, adO = aQ + BR * HD * 2, aK = adO + BR * HD * 2;  // K: [2][BCK][HD]
  const uint32_t aV = aK + 2 * KTILE;                                        // V: [2][BCK][HD]

  const int q0 = qt * BR;
  const int q_end = min(q0 + BR, T);
  const int n_kv = (q_end - 1) / BCK + 1;
  const int q_wg0 = q0 + wg * 64;  // first query row of this warpgroup
  const int q_srow = wg * 64;      // its rows in sQ, sdO

  // Packed: document starts of rows g and g+8 (padded rows: the last row's), their maximum over
  // the warp, the first kv row this warpgroup reads, and the first kv tile the block reads.
  int j0 = 0, ds_row[2] = {0, 0}, ds_warp = 0, ds_wg = 0;
  if constexpr (PACKED) {
    const int* pb = pos + static_cast<long long>(b) * T;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = min(q_wg0 + warp * 16 + (lane >> 2) + 8 * r, T - 1);
      ds_row[r] = row - pb[row];
    }
    ds_warp = __shfl_sync(0xffffffffu, ds_row[1], 31);
    const int wrow0 = min(q_wg0, T - 1);
    ds_wg = wrow0 - pb[wrow0];
    j0 = (q0 - pb[q0]) / BCK;
  }

  load_tile_sw128<BR, HD, NT>(aQ, q + q_off, q0, ldq, T, tid);
  load_tile_sw128<BR, HD, NT>(adO, dout + q_off, q0, ldq, T, tid);
  load_tile_sw128<BCK, HD, NT>(aK + (j0 & 1) * KTILE, kb, j0 * BCK, ldkv, T, tid);
  load_tile_sw128<BCK, HD, NT>(aV + (j0 & 1) * KTILE, vb, j0 * BCK, ldkv, T, tid);
  cp_async_commit();

  const int row_q0 = q_wg0 + warp * 16 + (lane >> 2);
  float lse2[2], Dr[2];
  dq_row_stats(lse2, Dr, lse, dq, b, h, row_q0, T, nh, HD);

  float dq_acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dq_acc[i] = 0.f;

  for (int j = j0; j < n_kv; ++j) {
    cp_async_wait_all();  // K_j, V_j (and Q, dO) have landed (this thread's part) ...
    fence_proxy_async();
    __syncthreads();  // ... everyone's; every warpgroup finished step j-1
    // K, V of tile j+1 go out after this tile's first products are issued (a skipped tile
    // issues them at once), as in the dK/dV kernel.
    auto prefetch = [&] {
      if (j + 1 < n_kv) {
        const int nbuf = (j + 1) & 1;
        load_tile_sw128<BCK, HD, NT>(aK + nbuf * KTILE, kb, (j + 1) * BCK, ldkv, T, tid);
        load_tile_sw128<BCK, HD, NT>(aV + nbuf * KTILE, vb, (j + 1) * BCK, ldkv, T, tid);
        cp_async_commit();
      }
    };
    // Skipped: every key of the tile follows this warpgroup's queries, or (PACKED) precedes all
    // their documents.
    bool skip = j * BCK > q_wg0 + 63;
    if constexpr (PACKED) skip = skip || j * BCK + BCK - 1 < ds_wg;
    if (skip) {
      prefetch();
      continue;
    }
    dq_step<HD, BR, BCK, PACKED>(dq_acc, aQ, adO, q_srow, aK + (j & 1) * KTILE,
                                 aV + (j & 1) * KTILE, j * BCK, q_wg0, row_q0, lse2, Dr, ds_row,
                                 ds_warp, lane, scale_log2, prefetch);
  }

  // Epilogue through this warp's own rows of sQ (after every warp's last wgmma wait); overwrites
  // the D values read above.
  __syncthreads();
  const int wrow = q_srow + warp * 16;
  stage_acc_sw128<BR, HD>(sQ, wrow, dq_acc, scale, scale, lane);
  __syncwarp();
  store_warp_rows_sw128<BR, HD>(dq + q_off, ldq, q0 + wrow, T, sQ, wrow, lane);
#else
  __trap();  // built without sm_90a: the dispatcher never launches this
#endif
}

template <int HD, int WG, bool PACKED>
void launch_dkdv_sm90(bf16* dk, bf16* dv, const bf16* dq, const bf16* dout, const bf16* q,
                      const bf16* k, const bf16* v, const float* lse, const int* pos, int B, int T,
                      int nh, int nkv, float scale, float scale_log2, cudaStream_t stream) {
  constexpr int smem = dkdv_smem_bytes<HD, WG, PACKED>();
  auto kernel = attention_dkdv_sm90_kernel<HD, WG, PACKED>;
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  const dim3 grid = tiles_last_grid((T + 64 * WG - 1) / (64 * WG), nkv, B);
  kernel<<<grid, 128 * WG, smem, stream>>>(dk, dv, dq, dout, q, k, v, lse, pos, T, nh, nkv, scale,
                                           scale_log2);
  QT_CHECK_LAUNCH();
}

template <int HD, int WG, bool PACKED>
void launch_dq_sm90(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                    const float* lse, const int* pos, int B, int T, int nh, int nkv, float scale,
                    float scale_log2, cudaStream_t stream) {
  constexpr int smem = dq_smem_bytes<HD, WG, kDqKvStep>();
  auto kernel = attention_dq_sm90_kernel<HD, WG, kDqKvStep, PACKED>;
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  const dim3 grid = tiles_last_grid((T + 64 * WG - 1) / (64 * WG), nh, B);
  kernel<<<grid, 128 * WG, smem, stream>>>(dq, dout, q, k, v, lse, pos, T, nh, nkv, scale,
                                           scale_log2);
  QT_CHECK_LAUNCH();
}

// The three kernels; wkv, wq: warpgroups per dK/dV and dQ block, 3 = warp-specialised
// (attention_sm90_backward_ws.cu).
template <int HD, bool PACKED>
void backward_sm90(int wkv, int wq, bf16* dq, bf16* dk, bf16* dv, const bf16* dout,
                   const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                   const int* pos, int B, int T, int nh, int nkv, cudaStream_t stream) {
  const auto [scale, scale_log2] = softmax_scale(HD);

  const long long rows = static_cast<long long>(B) * T * nh;
  attention_delta_sm90_kernel<HD>
      <<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(dq, dout, out, rows);
  QT_CHECK_LAUNCH();
  if (wkv == 3)
    attention_dkdv_ws_sm90(dk, dv, dq, dout, q, k, v, lse, pos, B, T, nh, nkv, HD, stream);
  else if (wkv == 1)
    launch_dkdv_sm90<HD, 1, PACKED>(dk, dv, dq, dout, q, k, v, lse, pos, B, T, nh, nkv, scale,
                                    scale_log2, stream);
  else
    launch_dkdv_sm90<HD, 2, PACKED>(dk, dv, dq, dout, q, k, v, lse, pos, B, T, nh, nkv, scale,
                                    scale_log2, stream);
  if (wq == 3)
    attention_dq_ws_sm90(dq, dout, q, k, v, lse, pos, B, T, nh, nkv, HD, stream);
  else if (wq == 1)
    launch_dq_sm90<HD, 1, PACKED>(dq, dout, q, k, v, lse, pos, B, T, nh, nkv, scale, scale_log2,
                                  stream);
  else
    launch_dq_sm90<HD, 2, PACKED>(dq, dout, q, k, v, lse, pos, B, T, nh, nkv, scale, scale_log2,
                                  stream);
}

}  // namespace

void attention_backward_sm90(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                             const bf16* k, const bf16* v, const bf16* out, const float* lse,
                             const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                             int dkdv_warps, int dq_warps, cudaStream_t stream) {
  check_shapes("attention_backward", B, T, nh, nkv, hd);
  int wkv = (dkdv_warps ? dkdv_warps : kDkdvDefaultWarps) / 4;  // 3: warp-specialised
  int wq = (dq_warps ? dq_warps : kDqDefaultWarps) / 4;
  // The tensor maps of the warp-specialised kernels need 16-byte aligned bases.
  if (!(is_aligned16(q) && is_aligned16(dout) && is_aligned16(k) && is_aligned16(v))) {
    wkv = wkv == 3 ? 2 : wkv;
    wq = wq == 3 ? 2 : wq;
  }
  with_hd_packed(hd, pos, [&]<int HD, bool PACKED>() {
    backward_sm90<HD, PACKED>(wkv, wq, dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh, nkv,
                              stream);
  });
}

}  // namespace qt::cuda
