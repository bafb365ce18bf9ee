// The per-step math of the sm_90a attention kernels, shared by the kernels that load with cp.async
// (attention_sm90_forward.cu, attention_sm90_backward.cu) and the warp-specialised ones
// (attention_sm90_forward_ws.cu, attention_sm90_backward_ws.cu): the same products, masks and
// order of operations, so both kinds give the same bits. Each function is one warpgroup's work on
// its 64 rows (register layouts: attention_wgmma.cuh). Included by .cu files only; callers guard
// their bodies with QT_ATTN_HAS_WGMMA.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/attention_wgmma.cuh"

namespace qt::cuda::attn {

#if QT_ATTN_HAS_WGMMA

// Forward: masks S_j = s (the BC keys from key0 on; rows row_q0 and row_q0 + 8 of a block whose
// first query is q0) above the diagonal (keys >= T are above it for every real row) and, PACKED,
// below each row's document start ds_row (ds_warp: the warp's largest); then the online softmax
// in place: s becomes P (fp32), m_run and l_run (this lane's part of the row sums) advance, alpha
// gets the rescale factors of O. A row whose document starts after the tile has every key masked
// (m_new = -inf): it subtracts 0 instead, so its p and alpha are 0 (O and l stay 0) until its
// first real tile; its own key is always in a later, processed tile. The first tile holds key 0
// (or, PACKED, the first row's document start), so m is finite from then on.
template <int BC, bool PACKED>
__device__ __forceinline__ void fwd_online_softmax(float (&s)[BC / 2], float (&m_run)[2],
                                                   float (&l_run)[2], float (&alpha)[2], int key0,
                                                   int q0, int row_q0, const int (&ds_row)[2],
                                                   int ds_warp, int lane, float scale_log2) {
  constexpr int NS = BC / 2;
  if (key0 + BC - 1 > q0) {
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const int key = key0 + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1);
      if (key > row_q0 + 8 * ((i >> 1) & 1)) s[i] = -INFINITY;
    }
  }
  if constexpr (PACKED) {
    if (key0 < ds_warp) {
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        const int key = key0 + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1);
        if (key < ds_row[(i >> 1) & 1]) s[i] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < NS / 4; ++nb)
      mx = fmaxf(mx, fmaxf(s[4 * nb + 2 * r], s[4 * nb + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[r], mx * scale_log2);
    float m_use = m_new;
    if constexpr (PACKED) m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = fast_exp2(m_run[r] - m_use);
    m_run[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nb = 0; nb < NS / 4; ++nb) {
      const float p0 = fast_exp2(fmaf(s[4 * nb + 2 * r], scale_log2, -m_use));
      const float p1 = fast_exp2(fmaf(s[4 * nb + 2 * r + 1], scale_log2, -m_use));
      s[4 * nb + 2 * r] = p0;
      s[4 * nb + 2 * r + 1] = p1;
      sum += p0 + p1;
    }
    l_run[r] = l_run[r] * alpha[r] + sum;
  }
}

// O *= alpha of its row (rows g and g + 8).
template <int HD>
__device__ __forceinline__ void rescale_rows(float (&o)[HD / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb) {
    o[4 * nb] *= alpha[0];
    o[4 * nb + 1] *= alpha[0];
    o[4 * nb + 2] *= alpha[1];
    o[4 * nb + 3] *= alpha[1];
  }
}

// One dK/dV step: for the 64 kv rows at kv_srow of the resident tiles aK, aV (BC rows) and the
// query tile tQ, tdO (BRQ rows from q_base; its lse, D and pos at Lb, Db, Pb in shared memory):
//   S^T = K Q^T, dP^T = V dO^T (issued together; then after_issue() runs, e.g. the next loads)
//   P^T = exp2(S^T scale log2e - lse log2e), zero where query < kv row, query >= T or (PACKED,
//   low_mask: some query's document starts after a kv row of this warp) kv row < ds[query];
//   dV += P^T dO; dS^T = P^T (dP^T - D); dK += dS^T Q.
// kv_wg0: the warpgroup's first kv row; kv_row0: the kv row of this lane's st[4nb], st[4nb+1]
// (+8 for the other two). Every product is complete on return.
template <int HD, int BC, int BRQ, bool PACKED, typename AfterIssue>
__device__ __forceinline__ void dkdv_step(float (&dk_acc)[HD / 2], float (&dv_acc)[HD / 2],
                                          uint32_t aK, uint32_t aV, int kv_srow, uint32_t tQ,
                                          uint32_t tdO, const float* Lb, const float* Db,
                                          const int* Pb, int q_base, int kv_wg0, int kv_row0,
                                          bool low_mask, int T, float scale_log2, int lane,
                                          AfterIssue&& after_issue) {
  constexpr int KT = HD / 16;   // k-steps of S^T and dP^T
  constexpr int QT = BRQ / 16;  // k-steps of dV and dK
  constexpr int NS = BRQ / 2;   // S^T accumulators per thread
  float st[NS], dpt[NS];
  wgmma_fence();
  wgmma_ss_kmajor<BRQ, BC, BRQ, KT>(st, aK, kv_srow, tQ);
  wgmma_commit();
  wgmma_ss_kmajor<BRQ, BC, BRQ, KT>(dpt, aV, kv_srow, tdO);
  wgmma_commit();
  after_issue();

  wgmma_wait<1>();  // S^T
  fence_acc(st);
  const bool need_mask = q_base < kv_wg0 + 63 || q_base + BRQ > T;
#pragma unroll
  for (int nb = 0; nb < NS / 4; ++nb) {
    const int col = nb * 8 + 2 * (lane & 3);
    const float2 l2 = *reinterpret_cast<const float2*>(Lb + col);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float pv = fast_exp2(fmaf(st[4 * nb + e], scale_log2, -(e & 1 ? l2.y : l2.x) * kLog2e));
      if (need_mask) {
        const int qi = q_base + col + (e & 1);
        if (qi < kv_row0 + 8 * (e >> 1) || qi >= T) pv = 0.f;
      }
      st[4 * nb + e] = pv;
    }
  }
  if constexpr (PACKED) {
    // Zero where kv row < ds[query] (queries >= T read pos 0 and are masked above).
    if (low_mask) {
#pragma unroll
      for (int nb = 0; nb < NS / 4; ++nb) {
        const int col = nb * 8 + 2 * (lane & 3);
        const int2 p2 = *reinterpret_cast<const int2*>(Pb + col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ds = q_base + col + (e & 1) - (e & 1 ? p2.y : p2.x);
          if (kv_row0 + 8 * (e >> 1) < ds) st[4 * nb + e] = 0.f;
        }
      }
    }
  }
  uint32_t pa[QT][4];
  acc_to_frags<QT>(pa, st);
  wgmma_fence();
  wgmma_rs_mnmajor<HD, BRQ, QT>(dv_acc, pa, tdO);
  wgmma_commit();

  wgmma_wait<1>();  // dP^T (dV may still run)
  fence_acc(dpt);
#pragma unroll
  for (int nb = 0; nb < NS / 4; ++nb) {  // dS^T = P^T (dP^T - D)
    const int col = nb * 8 + 2 * (lane & 3);
    const float2 d2 = *reinterpret_cast<const float2*>(Db + col);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dpt[4 * nb + e] = st[4 * nb + e] * (dpt[4 * nb + e] - (e & 1 ? d2.y : d2.x));
  }
  uint32_t da[QT][4];
  acc_to_frags<QT>(da, dpt);
  wgmma_fence();
  wgmma_rs_mnmajor<HD, BRQ, QT>(dk_acc, da, tQ);
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc(dk_acc);
  fence_acc(dv_acc);
}

// The dQ kernels' row statistics: lse (log2 units) and D of query rows row_q0 and row_q0 + 8 of
// (b, head h), 0 past T. Read before dq, which holds D, is overwritten (only this warp stores
// these rows, at the end).
__device__ __forceinline__ void dq_row_stats(float (&lse2)[2], float (&Dr)[2], const float* lse,
                                             const bf16* dq, int b, int h, int row_q0, int T,
                                             int nh, int hd) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_q0 + 8 * r;
    const bool ok = row < T;
    lse2[r] = ok ? lse[(static_cast<long long>(b) * nh + h) * T + row] * kLog2e : 0.f;
    Dr[r] = ok ? *delta_ptr(dq, b, row, h, T, nh, hd) : 0.f;
  }
}

// One dQ step: for the 64 query rows at q_srow of the resident tiles aQ, adO (BR rows) and the kv
// tile tK, tV (BCK rows from key0):
//   S = Q K^T, dP = dO V^T (issued together; then after_issue() runs)
//   P = exp2(S scale log2e - lse log2e), zero above the diagonal and (PACKED, key0 < ds_warp)
//   below each row's document start ds_row; dS = P (dP - D); dQ += dS K.
// q_wg0: the warpgroup's first query row; row_q0: the row of this lane's s[4nb], s[4nb+1] (+8 for
// the other two); lse2 (log2 units) and Dr of those two rows. Every product is complete on return.
template <int HD, int BR, int BCK, bool PACKED, typename AfterIssue>
__device__ __forceinline__ void dq_step(float (&dq_acc)[HD / 2], uint32_t aQ, uint32_t adO,
                                        int q_srow, uint32_t tK, uint32_t tV, int key0, int q_wg0,
                                        int row_q0, const float (&lse2)[2], const float (&Dr)[2],
                                        const int (&ds_row)[2], int ds_warp, int lane,
                                        float scale_log2, AfterIssue&& after_issue) {
  constexpr int KT = HD / 16;   // k-steps of S and dP
  constexpr int CT = BCK / 16;  // k-steps of dQ
  constexpr int NS = BCK / 2;   // S accumulators per thread
  float s[NS], dp[NS];
  wgmma_fence();
  wgmma_ss_kmajor<BCK, BR, BCK, KT>(s, aQ, q_srow, tK);
  wgmma_commit();
  wgmma_ss_kmajor<BCK, BR, BCK, KT>(dp, adO, q_srow, tV);
  wgmma_commit();
  after_issue();

  wgmma_wait<1>();  // S
  fence_acc(s);
  const bool diag = key0 + BCK - 1 > q_wg0;
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    const int r = (i >> 1) & 1;
    float pv = fast_exp2(fmaf(s[i], scale_log2, -lse2[r]));
    if (diag) {
      const int key = key0 + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1);
      if (key > row_q0 + 8 * r) pv = 0.f;
    }
    if constexpr (PACKED) {
      if (key0 < ds_warp) {  // some row of this warp starts its document inside the tile
        const int key = key0 + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1);
        if (key < ds_row[r]) pv = 0.f;
      }
    }
    s[i] = pv;
  }
  wgmma_wait<0>();  // dP
  fence_acc(dp);
#pragma unroll
  for (int i = 0; i < NS; ++i) dp[i] = s[i] * (dp[i] - Dr[(i >> 1) & 1]);
  uint32_t da[CT][4];
  acc_to_frags<CT>(da, dp);
  wgmma_fence();
  wgmma_rs_mnmajor<HD, BCK, CT>(dq_acc, da, tK);
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc(dq_acc);
}

#endif  // QT_ATTN_HAS_WGMMA

}  // namespace qt::cuda::attn
