// Causal GQA flash-attention backward (FA2 equations, mma.sync m16n8k16 bf16, fp32 accumulation),
// deterministic: no atomics, every sum is taken in a fixed order by one thread.
//
// Three kernels on the caller's stream:
//  1. delta:  D_i = sum_d dout[i, d] * out[i, d] (fp32), one warp per (b, t, head) row, stored in
//             the first 4 bytes of that row of dq (dq is written only by kernel 3, which reads the
//             D of its own rows before overwriting them), so no workspace is needed.
//  2. dk/dv:  one block per (kv tile of BC = 16 * WARPS rows, kv head, batch); warp w owns kv rows
//             16w..16w+15 and keeps their dK and dV in fp32 registers. The block loops over the
//             query heads of its group and, for each, over the query tiles at or after the
//             diagonal (double-buffered Q, dO, lse, D), recomputing
//               P^T = exp(K Q^T scale - lse),  dV += P^T dO,  dP^T = V dO^T,
//               dS^T = P^T (dP^T - D),         dK += dS^T Q          (dK scaled at the end),
//             so the group's query heads are summed into dK/dV in registers, in a fixed order.
//  3. dq:     one block per (query tile of BR = 16 * WARPS rows, query head, batch); warp w owns 16
//             query rows with Q and dO fragments in registers, loops over the kv tiles up to the
//             diagonal: S, P from lse, dP = dO V^T, dS = P (dP - D), dQ += dS K.
// Kernel 3 recomputes S and dP once more (7 tile products instead of FA2's 5 with atomic dQ):
// the price of determinism without a [T, T]-sized or per-tile dQ workspace.
// PACKED (pos given): key j is also masked for query t when j < ds[t] = t - pos[t]. ds never
// decreases in t, so kernel 2 stops at the first query tile whose first row starts its document
// after the kv tile's last row, and kernel 3 starts at the kv tile holding ds of its first row.
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

// Query rows per step of the dk/dv kernel, kv rows per step of the dq kernel: small for hd 128 so
// that the score fragments fit in registers beside the [16, hd] accumulators.
template <int HD>
constexpr int kStepRows = HD == 128 ? 32 : 64;

template <int HD>
__global__ void __launch_bounds__(256)
    attention_delta_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout,
                           const bf16* __restrict__ out, long long rows) {
  const long long row = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  constexpr int PER = HD / 32;  // 2 or 4 elements per lane
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

template <int HD, int WARPS, bool PACKED>
constexpr int dkdv_smem_bytes() {  // + [2][BRQ] pos when PACKED
  return 2 * 16 * WARPS * HD * 2 + 4 * kStepRows<HD> * HD * 2 +
         (PACKED ? 6 : 4) * kStepRows<HD> * 4;
}

template <int HD, int WARPS, bool PACKED>
__global__ void __launch_bounds__(WARPS * 32)
    attention_dkdv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* dq_delta,
                          const bf16* __restrict__ dout, const bf16* __restrict__ q,
                          const bf16* __restrict__ k, const bf16* __restrict__ v,
                          const float* __restrict__ lse, const int* __restrict__ pos, int T, int nh,
                          int nkv, float scale, float scale_log2) {
  constexpr int BC = 16 * WARPS, BRQ = kStepRows<HD>, NT = 32 * WARPS;
  constexpr int KT = HD / 16, NBQ = BRQ / 8;
  constexpr int QTILE = BRQ * HD * 2;
  static_assert(NT >= 2 * BRQ, "lse and D rows are loaded one per thread");

  const int kvt = blockIdx.z;  // kv tile 0 sees the most query rows: launched first
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int ratio = nh / nkv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long ldq = static_cast<long long>(nh) * HD, ldkv = static_cast<long long>(nkv) * HD;
  const long long kv_off = static_cast<long long>(b) * T * ldkv + kvh * HD;

  extern __shared__ __align__(128) char smem[];
  char* sK = smem;                                        // [BC][HD]
  char* sV = sK + BC * HD * 2;                            // [BC][HD]
  char* sQ = sV + BC * HD * 2;                            // [2][BRQ][HD]
  char* sdO = sQ + 2 * QTILE;                             // [2][BRQ][HD]
  float* sL = reinterpret_cast<float*>(sdO + 2 * QTILE);  // [2][BRQ] lse
  float* sD = sL + 2 * BRQ;                               // [2][BRQ] D
  int* sP = reinterpret_cast<int*>(sD + 2 * BRQ);         // [2][BRQ] pos (PACKED only)
  const uint32_t aK = smem_addr(sK), aV = smem_addr(sV), aQ = smem_addr(sQ), adO = smem_addr(sdO),
                 aL = smem_addr(sL), aD = smem_addr(sD), aP = smem_addr(sP);

  const int k0 = kvt * BC;
  const int* pb = PACKED ? pos + static_cast<long long>(b) * T : nullptr;
  const QueryTiles tiles = dkdv_query_tiles<PACKED>(pb, T, BRQ, k0, k0 + BC - 1);
  const int i_first = tiles.first, per_head = tiles.count;
  const int steps = ratio * per_head;

  // Step s: query head kvh * ratio + s / per_head, query tile i_first + s % per_head.
  auto load_step = [&](int s, int buf) {
    const int h = kvh * ratio + s / per_head;
    const int qrow0 = (i_first + s % per_head) * BRQ;
    const long long q_off = static_cast<long long>(b) * T * ldq + h * HD;
    load_tile<BRQ, HD, NT>(aQ + buf * QTILE, q + q_off, qrow0, ldq, T, tid);
    load_tile<BRQ, HD, NT>(adO + buf * QTILE, dout + q_off, qrow0, ldq, T, tid);
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

  load_tile<BC, HD, NT>(aK, k + kv_off, k0, ldkv, T, tid);
  load_tile<BC, HD, NT>(aV, v + kv_off, k0, ldkv, T, tid);
  load_step(0, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[nb][e] = dv_acc[nb][e] = 0.f;
  const int kv_row0 = k0 + warp * 16 + (lane >> 2);  // kv index of c0/c1; c2/c3: +8

  for (int s = 0; s < steps; ++s) {
    if (s > 0) {
      cp_async_wait_all();
      __syncthreads();
    }
    if (s + 1 < steps) {
      load_step(s + 1, (s + 1) & 1);
      cp_async_commit();
    }
    const int buf = s & 1;
    const uint32_t tQ = aQ + buf * QTILE, tdO = adO + buf * QTILE;
    const float* Lb = sL + buf * BRQ;
    const float* Db = sD + buf * BRQ;
    const int q_base = (i_first + s % per_head) * BRQ;

    // S^T = K Q^T  [16 kv x BRQ] per warp
    float st[NBQ][4];
#pragma unroll
    for (int nb = 0; nb < NBQ; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nb][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      uint32_t ka[4];
      ldmatrix_x4(ka, addr_a<HD>(aK, warp * 16, kk, lane));
#pragma unroll
      for (int n2 = 0; n2 < NBQ / 2; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4(bf, addr_b<HD>(tQ, n2 * 16, kk, lane));
        mma_16816(st[2 * n2], ka, bf[0], bf[1]);
        mma_16816(st[2 * n2 + 1], ka, bf[2], bf[3]);
      }
    }

    // P^T = exp2(S^T scale log2e - lse log2e); zero where query < kv row or query >= T.
    const bool need_mask = q_base < k0 + BC - 1 || q_base + BRQ > T;
#pragma unroll
    for (int nb = 0; nb < NBQ; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nb * 8 + 2 * (lane & 3) + (e & 1);
        float p = fast_exp2(fmaf(st[nb][e], scale_log2, -Lb[col] * kLog2e));
        if (need_mask) {
          const int qi = q_base + col;
          if (qi < kv_row0 + 8 * (e >> 1) || qi >= T) p = 0.f;
        }
        st[nb][e] = p;
      }
    if constexpr (PACKED) {
      // Zero where kv row < ds[query]; needed only if the tile's last real query starts its
      // document after this warp's first kv row. (Queries >= T read pos 0: masked above.)
      const int* Pb = sP + buf * BRQ;
      const int last = min(BRQ, T - q_base) - 1;
      if (q_base + last - Pb[last] > k0 + warp * 16) {
#pragma unroll
        for (int nb = 0; nb < NBQ; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = nb * 8 + 2 * (lane & 3) + (e & 1);
            if (kv_row0 + 8 * (e >> 1) < q_base + col - Pb[col]) st[nb][e] = 0.f;
          }
      }
    }

    // dV += P^T dO
#pragma unroll
    for (int kk = 0; kk < BRQ / 16; ++kk) {
      uint32_t pa[4];
      c_to_a(pa, st[2 * kk], st[2 * kk + 1]);
#pragma unroll
      for (int n2 = 0; n2 < HD / 16; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, addr_bt<HD>(tdO, kk * 16, n2, lane));
        mma_16816(dv_acc[2 * n2], pa, bf[0], bf[1]);
        mma_16816(dv_acc[2 * n2 + 1], pa, bf[2], bf[3]);
      }
    }

    // dP^T = V dO^T
    float dpt[NBQ][4];
#pragma unroll
    for (int nb = 0; nb < NBQ; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[nb][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      uint32_t va[4];
      ldmatrix_x4(va, addr_a<HD>(aV, warp * 16, kk, lane));
#pragma unroll
      for (int n2 = 0; n2 < NBQ / 2; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4(bf, addr_b<HD>(tdO, n2 * 16, kk, lane));
        mma_16816(dpt[2 * n2], va, bf[0], bf[1]);
        mma_16816(dpt[2 * n2 + 1], va, bf[2], bf[3]);
      }
    }

    // dS^T = P^T (dP^T - D)
#pragma unroll
    for (int nb = 0; nb < NBQ; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nb * 8 + 2 * (lane & 3) + (e & 1);
        dpt[nb][e] = st[nb][e] * (dpt[nb][e] - Db[col]);
      }

      // dK += dS^T Q
#pragma unroll
    for (int kk = 0; kk < BRQ / 16; ++kk) {
      uint32_t da[4];
      c_to_a(da, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
      for (int n2 = 0; n2 < HD / 16; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, addr_bt<HD>(tQ, kk * 16, n2, lane));
        mma_16816(dk_acc[2 * n2], da, bf[0], bf[1]);
        mma_16816(dk_acc[2 * n2 + 1], da, bf[2], bf[3]);
      }
    }
  }

  // Epilogue through this warp's own rows of sK and sV (no other warp reads them).
  stage_acc<HD>(sK, warp * 16, dk_acc, scale, scale, lane);
  stage_acc<HD>(sV, warp * 16, dv_acc, 1.f, 1.f, lane);
  __syncwarp();
  store_warp_rows<HD>(dk + kv_off, ldkv, k0 + warp * 16, T, sK, warp * 16, lane);
  store_warp_rows<HD>(dv + kv_off, ldkv, k0 + warp * 16, T, sV, warp * 16, lane);
}

template <int HD, int WARPS>
constexpr int dq_smem_bytes() {
  return 2 * 16 * WARPS * HD * 2 + 4 * kStepRows<HD> * HD * 2;
}

template <int HD, int WARPS, bool PACKED>
__global__ void __launch_bounds__(WARPS * 32)
    attention_dq_kernel(bf16* dq, const bf16* __restrict__ dout, const bf16* __restrict__ q,
                        const bf16* __restrict__ k, const bf16* __restrict__ v,
                        const float* __restrict__ lse, const int* __restrict__ pos, int T, int nh,
                        int nkv, float scale, float scale_log2) {
  constexpr int BR = 16 * WARPS, BCK = kStepRows<HD>, NT = 32 * WARPS;
  constexpr int KT = HD / 16, NBK = BCK / 8;
  constexpr int KTILE = BCK * HD * 2;

  const int n_qtiles = (T + BR - 1) / BR;
  const int qt = n_qtiles - 1 - static_cast<int>(blockIdx.z);  // longest rows first
  const int h = blockIdx.x, b = blockIdx.y;
  const int kvh = h / (nh / nkv);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long ldq = static_cast<long long>(nh) * HD, ldkv = static_cast<long long>(nkv) * HD;
  const long long q_off = static_cast<long long>(b) * T * ldq + h * HD;
  const bf16* kb = k + static_cast<long long>(b) * T * ldkv + kvh * HD;
  const bf16* vb = v + static_cast<long long>(b) * T * ldkv + kvh * HD;

  extern __shared__ __align__(128) char smem[];
  char* sQ = smem;               // [BR][HD]
  char* sdO = sQ + BR * HD * 2;  // [BR][HD]
  char* sK = sdO + BR * HD * 2;  // [2][BCK][HD]
  char* sV = sK + 2 * KTILE;     // [2][BCK][HD]
  const uint32_t aQ = smem_addr(sQ), adO = smem_addr(sdO), aK = smem_addr(sK), aV = smem_addr(sV);

  const int q0 = qt * BR;
  const int q_end = min(q0 + BR, T);
  const int n_kv = (q_end - 1) / BCK + 1;

  // Packed: document starts of rows g and g+8 (padded rows: the last row's), their maximum over
  // the warp, and the first kv tile any row of the block reads.
  int j0 = 0, ds_row[2] = {0, 0}, ds_warp = 0;
  if constexpr (PACKED) {
    const int* pb = pos + static_cast<long long>(b) * T;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = min(q0 + warp * 16 + (lane >> 2) + 8 * r, T - 1);
      ds_row[r] = row - pb[row];
    }
    ds_warp = __shfl_sync(0xffffffffu, ds_row[1], 31);
    j0 = (q0 - pb[q0]) / BCK;
  }

  load_tile<BR, HD, NT>(aQ, q + q_off, q0, ldq, T, tid);
  load_tile<BR, HD, NT>(adO, dout + q_off, q0, ldq, T, tid);
  load_tile<BCK, HD, NT>(aK + (j0 & 1) * KTILE, kb, j0 * BCK, ldkv, T, tid);
  load_tile<BCK, HD, NT>(aV + (j0 & 1) * KTILE, vb, j0 * BCK, ldkv, T, tid);
  cp_async_commit();

  // lse (log2 units) and D of rows g and g+8 of this warp, read before dq is overwritten.
  const int row_q0 = q0 + warp * 16 + (lane >> 2);
  float lse2[2], Dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_q0 + 8 * r;
    const bool ok = row < T;
    lse2[r] = ok ? lse[(static_cast<long long>(b) * nh + h) * T + row] * kLog2e : 0.f;
    Dr[r] = ok ? *delta_ptr(dq, b, row, h, T, nh, HD) : 0.f;
  }

  cp_async_wait_all();
  __syncthreads();

  uint32_t qf[KT][4], dof[KT][4];
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    ldmatrix_x4(qf[kk], addr_a<HD>(aQ, warp * 16, kk, lane));
    ldmatrix_x4(dof[kk], addr_a<HD>(adO, warp * 16, kk, lane));
  }

  float dq_acc[HD / 8][4];
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq_acc[nb][e] = 0.f;

  for (int j = j0; j < n_kv; ++j) {
    if (j > j0) {
      cp_async_wait_all();
      __syncthreads();
    }
    if (j + 1 < n_kv) {
      const int nbuf = (j + 1) & 1;
      load_tile<BCK, HD, NT>(aK + nbuf * KTILE, kb, (j + 1) * BCK, ldkv, T, tid);
      load_tile<BCK, HD, NT>(aV + nbuf * KTILE, vb, (j + 1) * BCK, ldkv, T, tid);
      cp_async_commit();
    }
    const uint32_t tK = aK + (j & 1) * KTILE, tV = aV + (j & 1) * KTILE;

    // S = Q K^T, then P = exp2(S scale log2e - lse log2e), zero above the diagonal.
    float s[NBK][4];
#pragma unroll
    for (int nb = 0; nb < NBK; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
      for (int n2 = 0; n2 < NBK / 2; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4(bf, addr_b<HD>(tK, n2 * 16, kk, lane));
        mma_16816(s[2 * n2], qf[kk], bf[0], bf[1]);
        mma_16816(s[2 * n2 + 1], qf[kk], bf[2], bf[3]);
      }
    }
    const bool diag = j * BCK + BCK - 1 > q0;
#pragma unroll
    for (int nb = 0; nb < NBK; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = fast_exp2(fmaf(s[nb][e], scale_log2, -lse2[e >> 1]));
        if (diag) {
          const int key = j * BCK + nb * 8 + 2 * (lane & 3) + (e & 1);
          if (key > row_q0 + 8 * (e >> 1)) p = 0.f;
        }
        s[nb][e] = p;
      }
    if constexpr (PACKED) {
      if (j * BCK < ds_warp) {  // some row of this warp starts its document inside this tile
#pragma unroll
        for (int nb = 0; nb < NBK; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = j * BCK + nb * 8 + 2 * (lane & 3) + (e & 1);
            if (key < ds_row[e >> 1]) s[nb][e] = 0.f;
          }
      }
    }

    // dP = dO V^T, dS = P (dP - D)
    float dp[NBK][4];
#pragma unroll
    for (int nb = 0; nb < NBK; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[nb][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
      for (int n2 = 0; n2 < NBK / 2; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4(bf, addr_b<HD>(tV, n2 * 16, kk, lane));
        mma_16816(dp[2 * n2], dof[kk], bf[0], bf[1]);
        mma_16816(dp[2 * n2 + 1], dof[kk], bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int nb = 0; nb < NBK; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] * (dp[nb][e] - Dr[e >> 1]);

        // dQ += dS K
#pragma unroll
    for (int kk = 0; kk < BCK / 16; ++kk) {
      uint32_t da[4];
      c_to_a(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int n2 = 0; n2 < HD / 16; ++n2) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, addr_bt<HD>(tK, kk * 16, n2, lane));
        mma_16816(dq_acc[2 * n2], da, bf[0], bf[1]);
        mma_16816(dq_acc[2 * n2 + 1], da, bf[2], bf[3]);
      }
    }
  }

  // Epilogue through this warp's own rows of sQ; overwrites the D values read above (the
  // __syncwarp orders every lane's read of them before any lane's store).
  stage_acc<HD>(sQ, warp * 16, dq_acc, scale, scale, lane);
  __syncwarp();
  store_warp_rows<HD>(dq + q_off, ldq, q0 + warp * 16, T, sQ, warp * 16, lane);
}

template <int HD, int WARPS_KV, int WARPS_Q, bool PACKED>
void launch_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                     const bf16* v, const bf16* out, const float* lse, const int* pos, int B, int T,
                     int nh, int nkv, cudaStream_t stream) {
  const auto [scale, scale_log2] = softmax_scale(HD);

  const long long rows = static_cast<long long>(B) * T * nh;
  attention_delta_kernel<HD>
      <<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(dq, dout, out, rows);
  QT_CHECK_LAUNCH();

  {
    constexpr int smem = dkdv_smem_bytes<HD, WARPS_KV, PACKED>();
    auto kernel = attention_dkdv_kernel<HD, WARPS_KV, PACKED>;
    QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid = tiles_last_grid((T + 16 * WARPS_KV - 1) / (16 * WARPS_KV), nkv, B);
    kernel<<<grid, WARPS_KV * 32, smem, stream>>>(dk, dv, dq, dout, q, k, v, lse, pos, T, nh, nkv,
                                                  scale, scale_log2);
    QT_CHECK_LAUNCH();
  }
  {
    constexpr int smem = dq_smem_bytes<HD, WARPS_Q>();
    auto kernel = attention_dq_kernel<HD, WARPS_Q, PACKED>;
    QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid = tiles_last_grid((T + 16 * WARPS_Q - 1) / (16 * WARPS_Q), nh, B);
    kernel<<<grid, WARPS_Q * 32, smem, stream>>>(dq, dout, q, k, v, lse, pos, T, nh, nkv, scale,
                                                 scale_log2);
    QT_CHECK_LAUNCH();
  }
}

template <int HD, bool PACKED>
void dispatch_backward(int wkv, int wq, bf16* dq, bf16* dk, bf16* dv, const bf16* dout,
                       const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                       const float* lse, const int* pos, int B, int T, int nh, int nkv,
                       cudaStream_t stream) {
  if (wkv == 4 && wq == 4)
    launch_backward<HD, 4, 4, PACKED>(dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh, nkv,
                                      stream);
  else if (wkv == 4 && wq == 8)
    launch_backward<HD, 4, 8, PACKED>(dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh, nkv,
                                      stream);
  else if (wkv == 8 && wq == 4)
    launch_backward<HD, 8, 4, PACKED>(dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh, nkv,
                                      stream);
  else
    launch_backward<HD, 8, 8, PACKED>(dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh, nkv,
                                      stream);
}

}  // namespace

void attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                        const bf16* k, const bf16* v, const bf16* out, const float* lse, int B,
                        int Tn, int nh, int nkv, int hd, const AttentionConfig& cfg,
                        cudaStream_t stream, const std::int32_t* pos) {
  check_shapes("attention_backward", B, Tn, nh, nkv, hd);
  const int wkv = cfg.dkdv_warps ? cfg.dkdv_warps : 4;
  const int wq = cfg.dq_warps ? cfg.dq_warps : 4;
  const bool wgmma = attention_use_wgmma(cfg);
  auto valid = [&](int w) { return w == 4 || w == 8 || (wgmma && w == 12); };
  if (!valid(wkv) || !valid(wq))
    fail_library("attention", __FILE__, __LINE__, "dkdv_warps, dq_warps",
                 "attention_backward: warps must be 0, 4 or 8 (or 12 on the wgmma path)");
  if (wgmma) {
    attention_backward_sm90(dq, dk, dv, dout, q, k, v, out, lse, pos, B, Tn, nh, nkv, hd,
                            cfg.dkdv_warps, cfg.dq_warps, stream);
    return;
  }
  with_hd_packed(hd, pos, [&]<int HD, bool PACKED>() {
    dispatch_backward<HD, PACKED>(wkv, wq, dq, dk, dv, dout, q, k, v, out, lse, pos, B, Tn, nh, nkv,
                                  stream);
  });
}

void attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                        const bf16* k, const bf16* v, const bf16* out, const float* lse, int B,
                        int Tn, int nh, int nkv, int hd, cudaStream_t stream,
                        const std::int32_t* pos) {
  attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B, Tn, nh, nkv, hd, AttentionConfig{},
                     stream, pos);
}

}  // namespace qt::cuda
