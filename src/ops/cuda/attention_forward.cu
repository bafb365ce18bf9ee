// Causal GQA flash-attention forward (FA2 tiling, mma.sync m16n8k16 bf16, fp32 accumulation).
//
// One block per (query tile of BR = 16 * WARPS rows, query head, batch); warp w owns query rows
// 16w..16w+15 of the tile and keeps their Q fragments in registers. The block walks the key/value
// tiles of BC = 64 rows from the first to the diagonal one, double-buffered with cp.async:
//   S = Q K^T (fp32), scaled into log2 units; masked (key > query) only on the tiles that cross
//   the diagonal; online softmax (running max m and partial sum l per row, the sum reduced over
//   the 4 lanes of a row only at the end); O = alpha O + P V with P rounded to bf16.
// At the end O / l goes out through shared memory (16-byte stores) and lse = (m + log2 l) ln 2.
// PACKED (pos given): row t also masks keys below its document start ds[t] = t - pos[t]; ds never
// decreases, so the walk starts at the tile of ds[q0] (earlier tiles hold no key of any row).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>

#include "cuda/check.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/attention_wgmma.cuh"

namespace qt::cuda {
namespace {

using namespace attn;

constexpr int kFwdBC = 64;  // key/value rows per tile

template <int HD, int WARPS>
constexpr int fwd_smem_bytes() {
  return (16 * WARPS + 4 * kFwdBC) * HD * 2;  // Q tile + 2 x (K tile + V tile)
}

template <int HD, int WARPS, bool PACKED>
__global__ void __launch_bounds__(WARPS * 32)
    attention_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse,
                             const bf16* __restrict__ q, const bf16* __restrict__ k,
                             const bf16* __restrict__ v, const int* __restrict__ pos, int T, int nh,
                             int nkv, float scale_log2) {
  constexpr int BR = 16 * WARPS, BC = kFwdBC, NT = 32 * WARPS;
  constexpr int KT = HD / 16;  // k-steps over the head dimension
  constexpr int NB = BC / 8;   // 8-column blocks of S
  constexpr int TILE = BC * HD * 2;

  const int n_qtiles = (T + BR - 1) / BR;
  const int qt = n_qtiles - 1 - static_cast<int>(blockIdx.z);  // longest rows first
  const int h = blockIdx.x, b = blockIdx.y;
  const int kvh = h / (nh / nkv);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long ldq = static_cast<long long>(nh) * HD, ldkv = static_cast<long long>(nkv) * HD;
  const bf16* qb = q + static_cast<long long>(b) * T * ldq + h * HD;  // row t at qb + t * ldq
  const bf16* kb = k + static_cast<long long>(b) * T * ldkv + kvh * HD;
  const bf16* vb = v + static_cast<long long>(b) * T * ldkv + kvh * HD;

  extern __shared__ __align__(128) char smem[];
  char* sQ = smem;              // [BR][HD]
  char* sK = sQ + BR * HD * 2;  // [2][BC][HD]
  char* sV = sK + 2 * TILE;     // [2][BC][HD]
  const uint32_t aQ = smem_addr(sQ), aK = smem_addr(sK), aV = smem_addr(sV);

  const int q0 = qt * BR;
  const int q_end = min(q0 + BR, T);  // rows q0 .. q_end-1 are real
  const int n_kv = (q_end - 1) / BC + 1;

  // Packed: document starts of rows g and g+8 (padded rows >= T: the last row's, the largest),
  // their maximum over this warp (the last row's), and the first key tile any row reads.
  int j0 = 0, ds_row[2] = {0, 0}, ds_warp = 0;
  if constexpr (PACKED) {
    const int* pb = pos + static_cast<long long>(b) * T;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = min(q0 + warp * 16 + (lane >> 2) + 8 * r, T - 1);
      ds_row[r] = row - pb[row];
    }
    ds_warp = __shfl_sync(0xffffffffu, ds_row[1], 31);
    j0 = (q0 - pb[q0]) / BC;
  }

  load_tile<BR, HD, NT>(aQ, qb, q0, ldq, T, tid);
  load_tile<BC, HD, NT>(aK + (j0 & 1) * TILE, kb, j0 * BC, ldkv, T, tid);
  load_tile<BC, HD, NT>(aV + (j0 & 1) * TILE, vb, j0 * BC, ldkv, T, tid);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  uint32_t qf[KT][4];  // this warp's 16 query rows, A fragments
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) ldmatrix_x4(qf[kk], addr_a<HD>(aQ, warp * 16, kk, lane));

  float o[HD / 8][4];
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nb][e] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};          // rows g and g+8, log2 units
  float l_run[2] = {0.f, 0.f};                      // this lane's part of the row sums
  const int row_q0 = q0 + warp * 16 + (lane >> 2);  // query index of c0/c1; c2/c3: +8

  for (int j = j0; j < n_kv; ++j) {
    if (j > j0) {
      cp_async_wait_all();  // tile j has landed (this thread's part) ...
      __syncthreads();      // ... everyone's part, and nobody still reads tile j-1's buffer
    }
    if (j + 1 < n_kv) {
      const int nbuf = (j + 1) & 1;
      load_tile<BC, HD, NT>(aK + nbuf * TILE, kb, (j + 1) * BC, ldkv, T, tid);
      load_tile<BC, HD, NT>(aV + nbuf * TILE, vb, (j + 1) * BC, ldkv, T, tid);
      cp_async_commit();
    }
    const uint32_t tK = aK + (j & 1) * TILE, tV = aV + (j & 1) * TILE;

    // S = Q K^T  [16 x BC] per warp
    float s[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
      for (int n2 = 0; n2 < NB / 2; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4(bf, addr_b<HD>(tK, n2 * 16, kk, lane));
        mma_16816(s[2 * n2], qf[kk], bf[0], bf[1]);
        mma_16816(s[2 * n2 + 1], qf[kk], bf[2], bf[3]);
      }
    }

    // Scale to log2 units; mask keys above the diagonal (keys >= T are always above it for the
    // real rows; padded rows q >= T are never stored).
    const bool diag = j * BC + BC - 1 > q0;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nb][e] * scale_log2;
        if (diag) {
          const int key = j * BC + nb * 8 + 2 * (lane & 3) + (e & 1);
          if (key > row_q0 + 8 * (e >> 1)) x = -INFINITY;
        }
        s[nb][e] = x;
      }
    if constexpr (PACKED) {
      if (j * BC < ds_warp) {  // some row of this warp starts its document inside this tile
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = j * BC + nb * 8 + 2 * (lane & 3) + (e & 1);
            if (key < ds_row[e >> 1]) s[nb][e] = -INFINITY;
          }
      }
    }

    // Online softmax. Causal: tile 0 always holds key 0 <= q, so m_run is finite from the first
    // tile on and no row ever computes inf - inf. Packed: a row whose document starts after
    // this tile has every key masked (m_new = -inf); it subtracts 0 instead, so its p and alpha
    // are 0 (O and l stay 0) until its first real tile; its own key t is in a later tile.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[r], mx);
      float m_use = m_new;
      if constexpr (PACKED) m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = fast_exp2(m_run[r] - m_use);
      m_run[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const float p0 = fast_exp2(s[nb][2 * r] - m_use);
        const float p1 = fast_exp2(s[nb][2 * r + 1] - m_use);
        s[nb][2 * r] = p0;
        s[nb][2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l_run[r] = l_run[r] * alpha + sum;
#pragma unroll
      for (int nb = 0; nb < HD / 8; ++nb) {
        o[nb][2 * r] *= alpha;
        o[nb][2 * r + 1] *= alpha;
      }
    }

    // O += P V: P (bf16) from the S accumulators, V^T fragments via ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t pa[4];
      c_to_a(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int n2 = 0; n2 < HD / 16; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, addr_bt<HD>(tV, kk * 16, n2, lane));
        mma_16816(o[2 * n2], pa, bf[0], bf[1]);
        mma_16816(o[2 * n2 + 1], pa, bf[2], bf[3]);
      }
    }
  }

  // Epilogue: full row sums, O / l through this warp's own rows of sQ (only this warp read them).
  float inv[2];
  finish_forward_rows(inv, l_run, m_run, lse + (static_cast<long long>(b) * nh + h) * T, row_q0, T,
                      lane);
  stage_acc<HD>(sQ, warp * 16, o, inv[0], inv[1], lane);
  __syncwarp();
  bf16* ob = out + static_cast<long long>(b) * T * ldq + h * HD;
  store_warp_rows<HD>(ob, ldq, q0 + warp * 16, T, sQ, warp * 16, lane);
}

template <int HD, int WARPS>
void launch_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                    const int* pos, int B, int T, int nh, int nkv, cudaStream_t stream) {
  constexpr int BR = 16 * WARPS;
  constexpr int smem = fwd_smem_bytes<HD, WARPS>();
  auto kernel =
      pos ? attention_forward_kernel<HD, WARPS, true> : attention_forward_kernel<HD, WARPS, false>;
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid = tiles_last_grid((T + BR - 1) / BR, nh, B);
  const float scale_log2 = softmax_scale(HD).log2;
  kernel<<<grid, WARPS * 32, smem, stream>>>(out, lse, q, k, v, pos, T, nh, nkv, scale_log2);
  QT_CHECK_LAUNCH();
}

}  // namespace

void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B,
                       int Tn, int nh, int nkv, int hd, const AttentionConfig& cfg,
                       cudaStream_t stream, const std::int32_t* pos) {
  check_shapes("attention_forward", B, Tn, nh, nkv, hd);
  const bool wgmma = attention_use_wgmma(cfg);
  if (cfg.fwd_warps != 0 && cfg.fwd_warps != 4 && cfg.fwd_warps != 8 &&
      !(wgmma && cfg.fwd_warps == 12))
    fail_library("attention", __FILE__, __LINE__, "fwd_warps",
                 "fwd_warps must be 0, 4 or 8 (or 12 on the wgmma path)");
  if (wgmma) {
    attention_forward_sm90(out, lse, q, k, v, pos, B, Tn, nh, nkv, hd, cfg.fwd_warps, stream);
    return;
  }
  const int warps = cfg.fwd_warps ? cfg.fwd_warps : 4;
  if (hd == 128) {
    if (warps == 4)
      launch_forward<128, 4>(out, lse, q, k, v, pos, B, Tn, nh, nkv, stream);
    else
      launch_forward<128, 8>(out, lse, q, k, v, pos, B, Tn, nh, nkv, stream);
  } else {
    if (warps == 4)
      launch_forward<64, 4>(out, lse, q, k, v, pos, B, Tn, nh, nkv, stream);
    else
      launch_forward<64, 8>(out, lse, q, k, v, pos, B, Tn, nh, nkv, stream);
  }
}

void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B,
                       int Tn, int nh, int nkv, int hd, cudaStream_t stream,
                       const std::int32_t* pos) {
  attention_forward(out, lse, q, k, v, B, Tn, nh, nkv, hd, AttentionConfig{}, stream, pos);
}

}  // namespace qt::cuda
