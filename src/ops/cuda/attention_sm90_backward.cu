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
#include <cstddef>

#include "cuda/check.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/attention_wgmma.cuh"

namespace qt::cuda {
namespace {

using namespace attn;

constexpr int kQStep = 64;            // query rows per dk/dv step
constexpr int kDkdvDefaultWarps = 8;  // 2 warpgroups per dk/dv block (cfg.dkdv_warps = 0)
constexpr int kDqDefaultWarps = 8;    // 2 warpgroups per dq block (cfg.dq_warps = 0)
// kv rows per dq step. (128, which makes S = Q K^T and dP = dO V^T m64n128 products, measured
// the same on an H100 and spills registers at hd 128: three [64, 128] fp32 accumulators.)
constexpr int kDqKvStep = 64;

// D of row (b, t, h), kept in the first 4 bytes of dq's row (16-byte aligned: hd >= 64).
__device__ __forceinline__ const float* delta_ptr(const bf16* dq, int b, int t, int h, int T,
                                                  int nh, int hd) {
  return reinterpret_cast<const float*>(dq + ((static_cast<long long>(b) * T + t) * nh + h) * hd);
}

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

template <int HD, int NWG, bool PACKED, bool FUSED>
constexpr int dkdv_smem_bytes() {
  // K, V [BC][HD]; Q, dO [2][BRQ][HD]; lse, D (and pos when PACKED) [2][BRQ] 4 bytes; + slack.
  constexpr int tiles = 2 * 64 * NWG * HD * 2 + 4 * kQStep * HD * 2;
  if constexpr (!FUSED) return tiles + (PACKED ? 6 : 4) * kQStep * 4 + 1024;
  // FUSED: lse, D, pos in 2 KB (so that what follows stays 1024-aligned), dS^T [BC][BRQ] bf16
  // and the dQ stages [2][BRQ][HD] fp32.
  return tiles + 2048 + 64 * NWG * kQStep * 2 + 2 * kQStep * HD * 4 + 1024;
}

// FUSED: the block also computes its kv rows' share of dQ for each step's query tile and adds it
// into an fp32 accumulator in global memory, in a fixed order, so that the separate dQ kernel
// (which recomputes S and dP) is not needed:
//   dS^T (bf16, the values dK uses) -> shared memory; after a block barrier, warpgroup wg runs
//   dQ[:, 64 wg .. 64 wg + 63] = dS K[:, 64 wg ..] (A = dS^T MN-major, B = K MN-major, K = the
//   block's 128 kv rows; a skipped warpgroup's rows of dS^T are zeros); the [BRQ, HD] fp32 result
//   goes to one of two shared stages, from which thread 0 writes (first contributor) or adds
//   (fp32, at L2) it to the tile's accumulator with one bulk copy.
// Order: the contributors to query tile i are the kv tiles first(i) .. i / 2 (first = 0, or for
// packed rows the kv tile holding the document start of the tile's first query); kv tile j adds
// after kv tile j - 1, waiting for the tile's counter (dq_order, zeroed before the launch) to
// reach j - first and setting it to j - first + 1 once its add has completed, which it checks
// two steps later (release/acquire at gpu scope). Every block waits only for blocks of lower kv tiles, which start earlier (the grid's
// tile dimension is the slowest), so the chain cannot deadlock, and the fp32 sums are the same on
// every run. The query tiles are visited last first, heads innermost, so that every block of a kv
// head visits each (tile, head) at the same step: a block trails its predecessor by about two
// steps (only blocks that start together wait at all).
// Accumulator tile layout (what dq_from_accum_kernel reads): [B][nh][query tiles] tiles of
// BRQ * HD floats; within a tile, warpgroup wg's half at float offset wg * BRQ * HD / 2, holding
// float4 number nb (its accumulator entries 4 nb .. 4 nb + 3) of the warpgroup's thread t at
// (nb * 128 + t) * 4: consecutive threads write consecutive 16 bytes of the stage.
template <int HD, int NWG, bool PACKED, bool FUSED>
__global__ void __launch_bounds__(128 * NWG, 3 - NWG)
    attention_dkdv_sm90_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* dq_delta,
                               const bf16* __restrict__ dout, const bf16* __restrict__ q,
                               const bf16* __restrict__ k, const bf16* __restrict__ v,
                               const float* __restrict__ lse, const int* __restrict__ pos,
                               float* dq_accum, int* dq_order, int T, int nh, int nkv,
                               float scale, float scale_log2) {
#if QT_ATTN_HAS_WGMMA
  constexpr int BC = 64 * NWG, BRQ = kQStep, NT = 128 * NWG;
  constexpr int KT = HD / 16;   // k-steps of S^T and dP^T
  constexpr int QT = BRQ / 16;  // k-steps of dV and dK
  constexpr int NS = BRQ / 2;   // S^T accumulators per thread
  constexpr int QTILE = BRQ * HD * 2;
  static_assert(NT >= 2 * BRQ, "lse and D rows are loaded one per thread");
  static_assert(!FUSED || (NWG == 2 && HD == 128), "fused dQ: one 64-column panel per warpgroup");

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
  const uint32_t aS = aL + 2048;                // FUSED: dS^T [BC][BRQ] bf16, swizzled
  const uint32_t aStage = aS + BC * BRQ * 2;    // FUSED: dQ stages [2][BRQ * HD] fp32
  const float* sL = reinterpret_cast<const float*>(sK + (aL - aK));
  const float* sD = reinterpret_cast<const float*>(sK + (aD - aK));
  const int* sP = reinterpret_cast<const int*>(sK + (aP - aK));

  const int k0 = kvt * BC;
  const int n_qt = (T + BRQ - 1) / BRQ;
  const int i_first = k0 / BRQ;  // query tiles before it lie wholly above the diagonal
  const int* pb = PACKED ? pos + static_cast<long long>(b) * T : nullptr;
  int i_end = n_qt;  // query tiles from i_end on read none of this tile's keys
  if constexpr (PACKED) i_end = packed_query_tile_end(pb, i_first, n_qt, BRQ, k0 + BC - 1);
  const int steps = ratio * (i_end - i_first);

  // Step s reads query tile i_end - 1 - s / ratio and query head kvh * ratio + s % ratio (kept
  // as counters by the loop: no division per step).
  auto load_step = [&](int hs, int qi, int buf) {
    const int h = kvh * ratio + hs;
    const int qrow0 = qi * BRQ;
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
  load_step(0, i_end - 1, 0);
  cp_async_commit();

  float dk_acc[HD / 2], dv_acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk_acc[i] = dv_acc[i] = 0.f;
  const int kv_wg0 = k0 + wg * 64;                       // first kv row of this warpgroup
  const int kv_row0 = kv_wg0 + warp * 16 + (lane >> 2);  // kv row of st[4nb], st[4nb+1]; +8
  const int kv_srow = wg * 64;                           // this warpgroup's rows in sK, sV
  // FUSED, thread 0 only: step s's dQ share is staged at the end of step s (stage s % 2); in step
  // s + 1, after the barrier that follows dS^T (while the block's dK and dQ products run), thread
  // 0 waits for the tile's counter and issues the bulk add of that stage; early in step s + 2
  // (while S^T and dP^T run, before its cp.async of the step) it sees the add complete and
  // advances the counter. One add is in flight at a time, and a stage is rewritten only after its
  // add completed. The state lives in shared memory (registers are full): the staged share's
  // tile (-1: none), rank and stage buffer; the add in flight's tile (-1: none), its counter's
  // value once done.
  struct DqSync {
    int stage_tile, stage_rank, stage_buf, pend_tile, pend_value;
  };
  DqSync* const sync = reinterpret_cast<DqSync*>(sK + (aL - aK) + 1536);  // after lse, D, pos
  if (FUSED && tid == 0) *sync = DqSync{-1, 0, 0, -1, 0};
  auto dq_release = [&] {  // the add in flight has completed: counter advanced
    const int tile = sync->pend_tile;
    if (tile >= 0) {
      bulk_wait<0>();
      fence_proxy_async_global();
      store_relaxed_gpu(dq_order + tile, sync->pend_value);
      sync->pend_tile = -1;
    }
  };
  auto dq_issue = [&] {  // the staged share, after its predecessor's add: written or added
    const DqSync st = *sync;
    if (st.stage_tile >= 0) {
      const int* counter = dq_order + st.stage_tile;
      while (load_relaxed_gpu(counter) != st.stage_rank) __nanosleep(32);
      fence_proxy_async_global();
      float* dst = dq_accum + static_cast<long long>(st.stage_tile) * (BRQ * HD);
      const uint32_t src = aStage + st.stage_buf * (BRQ * HD * 4);
      if (st.stage_rank == 0)
        bulk_store(dst, src, BRQ * HD * 4);
      else
        bulk_reduce_add_f32(dst, src, BRQ * HD * 4);
      bulk_commit();
      *sync = DqSync{-1, 0, 0, st.stage_tile, st.stage_rank + 1};
    }
  };

  int hs = -1, qi = i_end - 1;  // head (in the group) and query tile of step s, set at its top
  for (int s = 0; s < steps; ++s) {
    if (++hs == ratio) {
      hs = 0;
      --qi;
    }
    const bool last_head = hs + 1 == ratio;  // step s+1 reads the next (lower) query tile
    cp_async_wait_all();  // step s has landed (this thread's part) ...
    fence_proxy_async();
    __syncthreads();  // ... everyone's; every warpgroup finished step s-1
    // Step s+1's loads go out after this step's first products are issued, so that their
    // address arithmetic does not delay them; a skipped step issues them at once.
    auto prefetch = [&] {
      if (s + 1 < steps) {
        load_step(last_head ? 0 : hs + 1, last_head ? qi - 1 : qi, (s + 1) & 1);
        cp_async_commit();
      }
    };
    const int buf = s & 1;
    const int q_base = qi * BRQ;
    const int* Pb = sP + buf * BRQ;  // pos of the tile's queries (PACKED)
    // Skipped: every query of the tile precedes these kv rows, or (PACKED) every query's
    // document starts after them.
    bool skip = q_base + BRQ - 1 < kv_wg0;
    if constexpr (PACKED) skip = skip || q_base - Pb[0] > kv_wg0 + 63;
    if (skip) {
      if constexpr (FUSED)
        if (tid == 0) dq_release();
      prefetch();
    } else {
      bool low_mask = false;  // some query's document starts after a kv row
      if constexpr (PACKED) {
        const int last = min(BRQ, T - q_base) - 1;
        low_mask = q_base + last - Pb[last] > kv_wg0 + warp * 16;
      }
      const uint32_t tQ = aQ + buf * QTILE, tdO = adO + buf * QTILE;
      const float* Lb = sL + buf * BRQ;
      const float* Db = sD + buf * BRQ;

      float st[NS], dpt[NS];
      wgmma_fence();
      wgmma_ss_kmajor<BRQ, BC, BRQ, KT>(st, aK, kv_srow, tQ);
      wgmma_commit();
      wgmma_ss_kmajor<BRQ, BC, BRQ, KT>(dpt, aV, kv_srow, tdO);
      wgmma_commit();
      if constexpr (FUSED)
        if (tid == 0) dq_release();
      prefetch();

      wgmma_wait<1>();  // S^T
      fence_acc(st);
      // P^T = exp2(S^T scale log2e - lse log2e); zero where query < kv row or query >= T.
      const bool need_mask = q_base < kv_wg0 + 63 || q_base + BRQ > T;
#pragma unroll
      for (int nb = 0; nb < NS / 4; ++nb) {
        const int col = nb * 8 + 2 * (lane & 3);
        const float2 l2 = *reinterpret_cast<const float2*>(Lb + col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = fast_exp2(fmaf(st[4 * nb + e], scale_log2, -(e & 1 ? l2.y : l2.x) * kLog2e));
          if (need_mask) {
            const int qi_row = q_base + col + (e & 1);
            if (qi_row < kv_row0 + 8 * (e >> 1) || qi_row >= T) pv = 0.f;
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
      // dS^T = P^T (dP^T - D)
#pragma unroll
      for (int nb = 0; nb < NS / 4; ++nb) {
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
      if constexpr (FUSED) {
        // dS^T into this warpgroup's rows of the shared tile (the A operand of dS K).
        const int r0 = kv_srow + warp * 16 + (lane >> 2);
#pragma unroll
        for (int nb = 0; nb < BRQ / 8; ++nb) {
          st_shared_b32(aS + sw128<BC>(r0, nb) + (lane & 3) * 4, da[nb >> 1][(nb & 1) * 2]);
          st_shared_b32(aS + sw128<BC>(r0 + 8, nb) + (lane & 3) * 4, da[nb >> 1][(nb & 1) * 2 + 1]);
        }
      }
    }
    if constexpr (FUSED) {
      if (skip) {  // zeros for these kv rows of dS^T
        const int twg = tid & 127;
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int idx = twg + it * 128;
          st_shared_v4(aS + sw128<BC>(kv_srow + (idx >> 3), idx & 7), 0, 0, 0, 0);
        }
      }
      fence_proxy_async();
      __syncthreads();  // all of dS^T written; this step's stage is free (its add completed)
      float dqp[HD / 4];  // this warpgroup's 64 columns of the tile's dQ share
      wgmma_fence();
      wgmma_ss_mnmajor_n64<BC, BC / 16>(dqp, aS, aK + wg * (BC * 128));
      wgmma_commit();
      if (tid == 0) dq_issue();  // the previous step's share
      wgmma_wait<0>();
      fence_acc(dqp);
      const int sbuf = s & 1;
      const uint32_t stage = aStage + sbuf * (BRQ * HD * 4) + wg * (BRQ * HD * 2);
#pragma unroll
      for (int nb = 0; nb < HD / 16; ++nb)
        st_shared_v4(stage + (nb * 128 + (tid & 127)) * 16, __float_as_uint(dqp[4 * nb]),
                     __float_as_uint(dqp[4 * nb + 1]), __float_as_uint(dqp[4 * nb + 2]),
                     __float_as_uint(dqp[4 * nb + 3]));
      fence_proxy_async();  // the stage is read by thread 0's bulk add after the next barrier
      if (tid == 0) {
        const int h = kvh * ratio + hs;
        const int first = PACKED ? (q_base - Pb[0]) / BC : 0;  // first contributing kv tile
        sync->stage_tile = (b * nh + h) * n_qt + qi;
        sync->stage_rank = kvt - first;
        sync->stage_buf = sbuf;
      }
    }
    wgmma_wait<0>();
    fence_acc(dk_acc);
    fence_acc(dv_acc);
  }
  // Epilogue through this warp's own rows of sK and sV (only this warpgroup's wgmmas read them;
  // the barrier makes sure every warp of it is past its last wait, and the last stage written).
  __syncthreads();
  if constexpr (FUSED) {
    if (tid == 0) {
      dq_release();
      dq_issue();  // the last step's share
      dq_release();
    }
  }
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

// dq[b, t, h, :] = bf16(scale * accumulated dQ) from the fused kernel's fp32 tiles (layout above;
// HD 128, two warpgroups): one thread per float4 of the accumulator (coalesced reads), whose four
// values are two bf16 pairs of rows r and r + 8.
__global__ void __launch_bounds__(256)
    dq_from_accum_kernel(bf16* __restrict__ dq, const float4* __restrict__ acc, long long n4, int T,
                         int nh, int n_qt, float scale) {
  constexpr int HD = 128, BRQ = kQStep;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n4) return;
  constexpr int kPerTile = BRQ * HD / 4, kPerWg = kPerTile / 2;  // float4s
  const long long tile = idx / kPerTile;
  const int rem = static_cast<int>(idx % kPerTile);
  const int wg = rem / kPerWg, nb = (rem % kPerWg) / 128, t = rem % 128;
  const int qi = static_cast<int>(tile % n_qt);
  const long long bh = tile / n_qt;
  const int h = static_cast<int>(bh % nh);
  const long long b = bh / nh;
  const int lane = t & 31;
  const int row = qi * BRQ + (t >> 5) * 16 + (lane >> 2);
  const int col = wg * 64 + nb * 8 + 2 * (lane & 3);
  const float4 x = acc[idx];
  bf16* dst = dq + ((b * T + row) * nh + h) * HD + col;
  const long long ld8 = 8LL * nh * HD;
  if (row < T) *reinterpret_cast<uint32_t*>(dst) = pack_bf16(x.x * scale, x.y * scale);
  if (row + 8 < T) *reinterpret_cast<uint32_t*>(dst + ld8) = pack_bf16(x.z * scale, x.w * scale);
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
  constexpr int KT = HD / 16;   // k-steps of S and dP
  constexpr int CT = BCK / 16;  // k-steps of dQ
  constexpr int NS = BCK / 2;   // S accumulators per thread
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

  // lse (log2 units) and D of rows g and g+8 of this warp, read before dq is overwritten (only
  // this warp stores these rows, after the barriers below).
  const int row_q0 = q_wg0 + warp * 16 + (lane >> 2);
  float lse2[2], Dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_q0 + 8 * r;
    const bool ok = row < T;
    lse2[r] = ok ? lse[(static_cast<long long>(b) * nh + h) * T + row] * kLog2e : 0.f;
    Dr[r] = ok ? *delta_ptr(dq, b, row, h, T, nh, HD) : 0.f;
  }

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
    const uint32_t tK = aK + (j & 1) * KTILE, tV = aV + (j & 1) * KTILE;

    float s[NS], dp[NS];
    wgmma_fence();
    wgmma_ss_kmajor<BCK, BR, BCK, KT>(s, aQ, q_srow, tK);
    wgmma_commit();
    wgmma_ss_kmajor<BCK, BR, BCK, KT>(dp, adO, q_srow, tV);
    wgmma_commit();
    prefetch();

    wgmma_wait<1>();  // S
    fence_acc(s);
    const bool diag = j * BCK + BCK - 1 > q_wg0;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const int r = (i >> 1) & 1;
      float pv = fast_exp2(fmaf(s[i], scale_log2, -lse2[r]));
      if (diag) {
        const int key = j * BCK + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1);
        if (key > row_q0 + 8 * r) pv = 0.f;
      }
      if constexpr (PACKED) {
        if (j * BCK < ds_warp) {  // some row of this warp starts its document inside the tile
          const int key = j * BCK + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1);
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

// Tiles of the fused kernel's dQ accumulator and the bytes of its workspace (tiles, then one
// ordering counter per tile).
long long fused_dq_tiles(int B, int T, int nh) {
  return static_cast<long long>(B) * nh * ((T + kQStep - 1) / kQStep);
}
std::size_t fused_dq_workspace_bytes(int B, int T, int nh, int hd) {
  const auto tiles = static_cast<std::size_t>(fused_dq_tiles(B, T, nh));
  return tiles * kQStep * hd * 4 + (tiles * 4 + 255) / 256 * 256;
}

template <int HD, int WG_KV, int WG_Q, int BCK, bool PACKED>
void launch_backward_sm90(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                          const bf16* k, const bf16* v, const bf16* out, const float* lse,
                          const int* pos, int B, int T, int nh, int nkv, void* workspace,
                          cudaStream_t stream) {
  const double scale_d = 1.0 / std::sqrt(static_cast<double>(HD));
  const float scale = static_cast<float>(scale_d);
  const float scale_log2 = static_cast<float>(scale_d) * kLog2e;

  const long long rows = static_cast<long long>(B) * T * nh;
  attention_delta_sm90_kernel<HD>
      <<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(dq, dout, out, rows);
  QT_CHECK_LAUNCH();
  const dim3 kv_grid = tiles_last_grid((T + 64 * WG_KV - 1) / (64 * WG_KV), nkv, B);
  if constexpr (HD == 128 && WG_KV == 2) {
    if (workspace != nullptr) {  // fused dK/dV/dQ, then dQ from its fp32 accumulator
      const long long tiles = fused_dq_tiles(B, T, nh);
      float* acc = static_cast<float*>(workspace);
      int* order = reinterpret_cast<int*>(acc + tiles * kQStep * HD);
      QT_CHECK_CUDA(cudaMemsetAsync(order, 0, static_cast<std::size_t>(tiles) * 4, stream));
      constexpr int smem = dkdv_smem_bytes<HD, 2, PACKED, true>();
      auto kernel = attention_dkdv_sm90_kernel<HD, 2, PACKED, true>;
      QT_CHECK_CUDA(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      QT_CHECK_CUDA(
          cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
      kernel<<<kv_grid, 256, smem, stream>>>(dk, dv, dq, dout, q, k, v, lse, pos, acc, order, T,
                                             nh, nkv, scale, scale_log2);
      QT_CHECK_LAUNCH();
      const long long n4 = tiles * kQStep * HD / 4;
      dq_from_accum_kernel<<<static_cast<unsigned>((n4 + 255) / 256), 256, 0, stream>>>(
          dq, reinterpret_cast<const float4*>(acc), n4, T, nh,
          static_cast<int>((T + kQStep - 1) / kQStep), scale);
      QT_CHECK_LAUNCH();
      return;
    }
  }
  {
    constexpr int smem = dkdv_smem_bytes<HD, WG_KV, PACKED, false>();
    auto kernel = attention_dkdv_sm90_kernel<HD, WG_KV, PACKED, false>;
    QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    QT_CHECK_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    kernel<<<kv_grid, 128 * WG_KV, smem, stream>>>(dk, dv, dq, dout, q, k, v, lse, pos, nullptr,
                                                   nullptr, T, nh, nkv, scale, scale_log2);
    QT_CHECK_LAUNCH();
  }
  {
    constexpr int smem = dq_smem_bytes<HD, WG_Q, BCK>();
    auto kernel = attention_dq_sm90_kernel<HD, WG_Q, BCK, PACKED>;
    QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    QT_CHECK_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    const dim3 grid = tiles_last_grid((T + 64 * WG_Q - 1) / (64 * WG_Q), nh, B);
    kernel<<<grid, 128 * WG_Q, smem, stream>>>(dq, dout, q, k, v, lse, pos, T, nh, nkv, scale,
                                               scale_log2);
    QT_CHECK_LAUNCH();
  }
}

template <int HD, bool PACKED>
void dispatch_backward_sm90(int wkv, int wq, bf16* dq, bf16* dk, bf16* dv, const bf16* dout,
                            const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                            const float* lse, const int* pos, int B, int T, int nh, int nkv,
                            void* ws, cudaStream_t stream) {
  constexpr int S = kDqKvStep;
  if (wkv == 1 && wq == 1)
    launch_backward_sm90<HD, 1, 1, S, PACKED>(dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh,
                                              nkv, ws, stream);
  else if (wkv == 1)
    launch_backward_sm90<HD, 1, 2, S, PACKED>(dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh,
                                              nkv, ws, stream);
  else if (wq == 1)
    launch_backward_sm90<HD, 2, 1, S, PACKED>(dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh,
                                              nkv, ws, stream);
  else
    launch_backward_sm90<HD, 2, 2, S, PACKED>(dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh,
                                              nkv, ws, stream);
}

}  // namespace

void attention_backward_sm90(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                             const bf16* k, const bf16* v, const bf16* out, const float* lse,
                             const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                             int dkdv_warps, int dq_warps, void* workspace, cudaStream_t stream) {
  check_shapes("attention_backward", B, T, nh, nkv, hd);
  const int wkv = (dkdv_warps ? dkdv_warps : kDkdvDefaultWarps) / 4;
  const int wq = (dq_warps ? dq_warps : kDqDefaultWarps) / 4;
  if (hd == 128) {
    if (pos)
      dispatch_backward_sm90<128, true>(wkv, wq, dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh,
                                        nkv, workspace, stream);
    else
      dispatch_backward_sm90<128, false>(wkv, wq, dq, dk, dv, dout, q, k, v, out, lse, pos, B, T,
                                         nh, nkv, workspace, stream);
  } else {  // no fused kernel at hd 64: the workspace is not used
    if (pos)
      dispatch_backward_sm90<64, true>(wkv, wq, dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh,
                                       nkv, nullptr, stream);
    else
      dispatch_backward_sm90<64, false>(wkv, wq, dq, dk, dv, dout, q, k, v, out, lse, pos, B, T, nh,
                                        nkv, nullptr, stream);
  }
}

std::size_t attention_backward_sm90_workspace_bytes(int B, int T, int nh, int hd) {
  return hd == 128 ? fused_dq_workspace_bytes(B, T, nh, hd) : 0;
}

}  // namespace qt::cuda
