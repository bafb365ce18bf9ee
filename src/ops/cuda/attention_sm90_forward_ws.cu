// The attention forward for sm_90a, warp-specialised: the same tiles, online softmax, order of
// operations and results as attention_forward_sm90_kernel (attention_sm90_forward.cu, which
// documents them), with the loads moved to a producer warp (as attention_sm90_backward_ws.cu).
//
// A block of three warpgroups per (query tile of BR = 128 rows, query head, batch):
//   warpgroup 0, the producer (24 registers per thread; one thread works): Q once, then K_j and V_j
//     of each key tile j (BC = 128 rows) with TMA into two K and two V buffers, signalling a
//     buffer's "full" mbarrier and waiting on its "empty" one before reusing it;
//   warpgroups 1 and 2, the consumers (240 registers), each owning 64 query rows. Iteration j:
//     issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}; once S_j is done release K_j (one arrival per
//     warp) and run its online softmax while P V runs; wait for P V, release V_{j-1}, rescale O,
//     convert P_j. So K_{j+1} loads during iteration j, V_{j+1} during iterations j and j + 1.
// No block-wide barrier in the loop: the two consumers drift apart, so one's exponentials overlap
// the other's products, and neither issues loads.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>

#include "cuda/check.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/attention_sm90_steps.cuh"
#include "ops/cuda/attention_wgmma.cuh"
#include "ops/cuda/tma.cuh"

namespace qt::cuda {
namespace {

using namespace attn;

constexpr int kFwdStages = 2;  // K buffers and V buffers (3 measured no faster)
constexpr int kBR = 128, kBC = 128;
// 128 x 24 + 256 x 240 <= 65536 (used only by the sm_90a bodies)
[[maybe_unused]] constexpr int kProducerRegs = 24, kConsumerRegs = 240;

template <int HD>
struct FwdLayout {  // byte offsets from the 1024-aligned base
  static constexpr int kQ = kBR * HD * 2, kKV = kBC * HD * 2;
  static constexpr int Q = 0, K = kQ, V = K + kFwdStages * kKV;
  // q_full, then full and empty of each K buffer, then of each V buffer
  static constexpr int bars = V + kFwdStages * kKV;
  static constexpr int bytes = bars + (1 + 4 * kFwdStages) * 8 + 1024;  // + alignment slack
};

template <int HD, bool PACKED>
__global__ void __launch_bounds__(384, 1)
    attention_forward_ws_kernel(const __grid_constant__ CUtensorMap tm_q,
                                const __grid_constant__ CUtensorMap tm_k,
                                const __grid_constant__ CUtensorMap tm_v, bf16* __restrict__ out,
                                float* __restrict__ lse, const int* __restrict__ pos, int T,
                                int nh, int nkv, float scale_log2) {
#if QT_ATTN_HAS_WGMMA
  using Lay = FwdLayout<HD>;
  constexpr int BR = kBR, BC = kBC;
  constexpr int KT = HD / 16;  // k-steps of S = Q K^T
  constexpr int PT = BC / 16;  // k-steps of O += P V
  constexpr int NS = BC / 2;   // S accumulators per thread
  constexpr int PANELS = HD / 64;

  const int n_qtiles = (T + BR - 1) / BR;
  const int qt = n_qtiles - 1 - static_cast<int>(blockIdx.z);  // longest rows first
  const int h = blockIdx.x, b = blockIdx.y;
  const int kvh = h / (nh / nkv);
  const int tid = threadIdx.x, wg = warpgroup_index(), warp = (tid >> 5) & 3, lane = tid & 31;

  extern __shared__ char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  char* sbase = smem_raw + (base - raw);
  const uint32_t aQ = base + Lay::Q;
  const uint32_t q_full = base + Lay::bars;
  // The K buffers and the V buffers; use u of each is key tile j0 + u.
  const tma::BufferRing<kFwdStages> rings[2] = {
      {q_full + 8, q_full + 8 * (1 + kFwdStages)},
      {q_full + 8 * (1 + 2 * kFwdStages), q_full + 8 * (1 + 3 * kFwdStages)}};

  const int q0 = qt * BR;
  const int q_end = min(q0 + BR, T);
  const int n_kv = (q_end - 1) / BC + 1;
  const int* pb = PACKED ? pos + static_cast<long long>(b) * T : nullptr;
  int j0 = 0;  // first key tile any row reads (PACKED: the tile of the first row's document start)
  if constexpr (PACKED) j0 = (q0 - pb[q0]) / BC;

  if (tid == 0) {
    tma::mbar_init(q_full, 1);
    for (const auto& ring : rings)
      ring.init(1, 8);  // the producer's arrival with the bytes; one arrival per consumer warp
    tma::fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer -------------------------------------------------------------------------
    tma::setmaxnreg_dec<kProducerRegs>();
    if (warp != 0 || lane != 0) return;
    tma::mbar_arrive_expect_tx(q_full, Lay::kQ);
#pragma unroll
    for (int p = 0; p < PANELS; ++p)
      tma::load_4d(aQ + p * BR * 128, &tm_q, 64 * p, h, q0, b, q_full);
    for (int j = j0; j < n_kv; ++j) {
      const int s = j - j0, st = s % kFwdStages;
      for (int kv = 0; kv < 2; ++kv) {
        rings[kv].wait_empty(s);
        tma::mbar_arrive_expect_tx(rings[kv].full(s), Lay::kKV);
        const uint32_t tile = base + (kv ? Lay::V : Lay::K) + st * Lay::kKV;
#pragma unroll
        for (int p = 0; p < PANELS; ++p)
          tma::load_4d(tile + p * BC * 128, kv ? &tm_v : &tm_k, 64 * p, kvh, j * BC, b,
                       rings[kv].full(s));
      }
    }
    return;
  }

  // ---- consumers ------------------------------------------------------------------------------
  tma::setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1;
  const int row_q0 = q0 + c * 64 + warp * 16 + (lane >> 2);  // query of s[4nb], s[4nb+1]; +8
  const int q_row0 = c * 64;                                 // this warpgroup's rows in sQ

  // Packed: document starts of rows g and g+8 (padded rows >= T: the last row's, the largest) and
  // their maximum over this warp (its last row's).
  int ds_row[2] = {0, 0}, ds_warp = 0;
  if constexpr (PACKED) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = min(row_q0 + 8 * r, T - 1);
      ds_row[r] = row - pb[row];
    }
    ds_warp = __shfl_sync(0xffffffffu, ds_row[1], 31);
  }

  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float s[NS];
  uint32_t p[PT][4];
  float m_run[2] = {-INFINITY, -INFINITY};  // rows g and g+8, log2 units (scaled)
  float l_run[2] = {0.f, 0.f};              // this lane's part of the row sums

  // Buffer of tile j's K or V, waiting for it to land, and releasing it (kv: 0 K, 1 V).
  auto stage_of = [&](int j) { return (j - j0) % kFwdStages; };
  auto wait_full = [&](int kv, int j) { rings[kv].wait_full(j - j0); };
  auto release = [&](int kv, int j) { rings[kv].release(j - j0, lane); };
  // S_j = Q K_j^T into s (one commit group).
  auto issue_s = [&](int j) {
    wgmma_ss_kmajor<BC, BR, BC, KT>(s, aQ, q_row0, base + Lay::K + stage_of(j) * Lay::kKV);
    wgmma_commit();
  };
  // O += P V_j (one commit group).
  auto issue_pv = [&](int j) {
    wgmma_rs_mnmajor<HD, BC, PT>(o, p, base + Lay::V + stage_of(j) * Lay::kKV);
    wgmma_commit();
  };
  // Masks and online softmax of S_j (attention_sm90_steps.cuh).
  auto softmax = [&](int j, float(&alpha)[2]) {
    fwd_online_softmax<BC, PACKED>(s, m_run, l_run, alpha, j * BC, q0, row_q0, ds_row, ds_warp,
                                   lane, scale_log2);
  };

  tma::mbar_wait(q_full, 0);
  {  // tile j0 (O is still zero: no P V to overlap with)
    wait_full(0, j0);
    wgmma_fence();
    issue_s(j0);
    wgmma_wait<0>();
    fence_acc(s);
    release(0, j0);
    float alpha[2];
    softmax(j0, alpha);
    acc_to_frags<PT>(p, s);
  }
  for (int j = j0 + 1; j < n_kv; ++j) {
    wait_full(0, j);
    wait_full(1, j - 1);
    wgmma_fence();
    issue_s(j);
    issue_pv(j - 1);
    wgmma_wait<1>();  // S_j
    fence_acc(s);
    release(0, j);
    float alpha[2];
    softmax(j, alpha);  // overlaps O += P_{j-1} V_{j-1}
    wgmma_wait<0>();
    fence_acc(o);
    release(1, j - 1);
    rescale_rows<HD>(o, alpha);
    acc_to_frags<PT>(p, s);
  }
  wait_full(1, n_kv - 1);  // O += P V of the last tile
  wgmma_fence();
  issue_pv(n_kv - 1);
  wgmma_wait<0>();
  fence_acc(o);
  release(1, n_kv - 1);

  // Epilogue: full row sums; O / l staged through this warp's own rows of sQ (only this
  // warpgroup's wgmmas read them, and they are complete).
  float inv[2];
  finish_forward_rows(inv, l_run, m_run, lse + (static_cast<long long>(b) * nh + h) * T, row_q0, T,
                      lane);
  warpgroup_barrier(wg);  // every warp of this warpgroup is past its last wgmma on sQ
  const int wrow = q_row0 + warp * 16;
  stage_acc_sw128<BR, HD>(sbase + Lay::Q, wrow, o, inv[0], inv[1], lane);
  __syncwarp();
  const long long ldq = static_cast<long long>(nh) * HD;
  bf16* ob = out + static_cast<long long>(b) * T * ldq + h * HD;
  store_warp_rows_sw128<BR, HD>(ob, ldq, q0 + wrow, T, sbase + Lay::Q, wrow, lane);
#else
  __trap();  // built without sm_90a: the dispatcher never launches this
#endif
}

template <int HD, bool PACKED>
void launch_forward_ws(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                       const int* pos, int B, int T, int nh, int nkv, cudaStream_t stream) {
  const CUtensorMap tm_q = make_head_tile_map(q, B, T, nh, HD, kBR);
  const CUtensorMap tm_k = make_head_tile_map(k, B, T, nkv, HD, kBC);
  const CUtensorMap tm_v = make_head_tile_map(v, B, T, nkv, HD, kBC);
  constexpr int smem = FwdLayout<HD>::bytes;
  auto kernel = attention_forward_ws_kernel<HD, PACKED>;
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid = tiles_last_grid((T + kBR - 1) / kBR, nh, B);
  const float scale_log2 = softmax_scale(HD).log2;
  kernel<<<grid, 384, smem, stream>>>(tm_q, tm_k, tm_v, out, lse, pos, T, nh, nkv, scale_log2);
  QT_CHECK_LAUNCH();
}

}  // namespace

void attention_forward_ws_sm90(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                               const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                               cudaStream_t stream) {
  with_hd_packed(hd, pos, [&]<int HD, bool PACKED>() {
    launch_forward_ws<HD, PACKED>(out, lse, q, k, v, pos, B, T, nh, nkv, stream);
  });
}

}  // namespace qt::cuda
