// The attention backward's dK/dV and dQ kernels for sm_90a, warp-specialised: the same equations,
// tiles, order of additions and results as attention_dkdv_sm90_kernel and attention_dq_sm90_kernel
// (attention_sm90_backward.cu, which documents them), with the loads moved to a producer warp.
//
// A block of three warpgroups:
//   warpgroup 0, the producer (24 registers per thread; one warp works): the block's resident
//     tiles once, then per step the streamed tiles with TMA (tensor maps, 128B swizzle, rows >= T
//     read as zero) into one of kStages buffers; it signals the buffer's "full" mbarrier and waits
//     on its "empty" one before reusing it;
//   warpgroups 1 and 2, the consumers (240 registers), each owning 64 rows of the block's tile
//     with their accumulators in fp32 registers: wait for the step's buffer, run the step's
//     products and release the buffer (one arrival per warp).
// dK/dV: 128 kv rows per block (K, V resident), Q, dO, lse, D (and pos) of 64 query rows per step
// (lse, D, pos with plain loads by the producer warp's lanes). dQ: 128 query rows per block
// (Q, dO resident; lse and D in registers), K, V of 64 kv rows per step.
// No block-wide barrier in the loops: the two consumers drift apart, so one's exponentials overlap
// the other's products, and neither issues loads.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <string>

#include "cuda/check.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/attention_sm90_steps.cuh"
#include "ops/cuda/attention_wgmma.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/tma.cuh"

namespace qt::cuda {
namespace {

using namespace attn;

constexpr int kStages = 2;  // buffers of the streamed tiles (3 and 4 measured 1-4% slower)
constexpr int kWsBC = 128;  // dK/dV: kv rows per block (64 per consumer warpgroup)
constexpr int kWsBRQ = 64;  // dK/dV: query rows per step
constexpr int kWsBR = 128;  // dQ: query rows per block
constexpr int kWsBCK = 64;  // dQ: kv rows per step
// 128 x 24 + 256 x 240 <= 65536 (used only by the sm_90a bodies)
[[maybe_unused]] constexpr int kProducerRegs = 24, kConsumerRegs = 240;

template <int HD>
struct WsLayout {  // byte offsets from the 1024-aligned base
  static constexpr int kKV = kWsBC * HD * 2, kQ = kWsBRQ * HD * 2;
  static constexpr int K = 0, V = kKV, Q = 2 * kKV, dO = Q + kStages * kQ;
  static constexpr int L = dO + kStages * kQ, D = L + kStages * kWsBRQ * 4,
                       P = D + kStages * kWsBRQ * 4;
  static constexpr int bars = P + kStages * kWsBRQ * 4;  // kv_full, full[kStages], empty[kStages]
  static constexpr int bytes = bars + (1 + 2 * kStages) * 8 + 1024;  // + alignment slack
};

template <int HD, bool PACKED>
__global__ void __launch_bounds__(384, 1)
    attention_dkdv_ws_kernel(const __grid_constant__ CUtensorMap tm_q,
                             const __grid_constant__ CUtensorMap tm_do,
                             const __grid_constant__ CUtensorMap tm_k,
                             const __grid_constant__ CUtensorMap tm_v, bf16* __restrict__ dk,
                             bf16* __restrict__ dv, const bf16* dq_delta,
                             const float* __restrict__ lse, const int* __restrict__ pos, int T,
                             int nh, int nkv, float scale, float scale_log2) {
#if QT_ATTN_HAS_WGMMA
  using Lay = WsLayout<HD>;
  constexpr int BC = kWsBC, BRQ = kWsBRQ;
  constexpr int PANELS = HD / 64;

  const int kvt = blockIdx.z;  // kv tile 0 sees the most query rows: launched first
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int ratio = nh / nkv;
  const int tid = threadIdx.x, wg = warpgroup_index(), warp = (tid >> 5) & 3, lane = tid & 31;

  extern __shared__ char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  char* sbase = smem_raw + (base - raw);
  const uint32_t aK = base + Lay::K, aV = base + Lay::V;
  const uint32_t kv_full = base + Lay::bars;
  const tma::BufferRing<kStages> ring{kv_full + 8, kv_full + 8 * (1 + kStages)};  // Q, dO, ...
  float* sL = reinterpret_cast<float*>(sbase + Lay::L);
  float* sD = reinterpret_cast<float*>(sbase + Lay::D);
  int* sP = reinterpret_cast<int*>(sbase + Lay::P);

  const int k0 = kvt * BC;
  const int* pb = PACKED ? pos + static_cast<long long>(b) * T : nullptr;
  const QueryTiles tiles = dkdv_query_tiles<PACKED>(pb, T, BRQ, k0, k0 + BC - 1);
  const int i_first = tiles.first, per_head = tiles.count;
  const int steps = ratio * per_head;

  if (tid == 0) {
    tma::mbar_init(kv_full, 1);
    ring.init(32, 8);  // the producer warp's lanes (lane 0 also sets the bytes); consumer warps
    tma::fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer -------------------------------------------------------------------------
    tma::setmaxnreg_dec<kProducerRegs>();
    if (warp != 0) return;
    if (lane == 0) {
      tma::prefetch_map(&tm_q);
      tma::prefetch_map(&tm_do);
      tma::mbar_arrive_expect_tx(kv_full, 2 * Lay::kKV);
#pragma unroll
      for (int p = 0; p < PANELS; ++p) {
        tma::load_4d(aK + p * BC * 128, &tm_k, 64 * p, kvh, k0, b, kv_full);
        tma::load_4d(aV + p * BC * 128, &tm_v, 64 * p, kvh, k0, b, kv_full);
      }
    }
    int hs = 0, is = 0;
    for (int s = 0; s < steps; ++s) {
      const int st = s % kStages;
      ring.wait_empty(s);
      const int h = kvh * ratio + hs;
      const int qrow0 = (i_first + is) * BRQ;
      if (lane == 0) {
        tma::mbar_expect_tx(ring.full(s), 2 * Lay::kQ);
        const uint32_t tQ = base + Lay::Q + st * Lay::kQ, tdO = base + Lay::dO + st * Lay::kQ;
#pragma unroll
        for (int p = 0; p < PANELS; ++p) {
          tma::load_4d(tQ + p * BRQ * 128, &tm_q, 64 * p, h, qrow0, b, ring.full(s));
          tma::load_4d(tdO + p * BRQ * 128, &tm_do, 64 * p, h, qrow0, b, ring.full(s));
        }
      }
      __syncwarp();  // the bytes are expected before any lane's arrival can complete the phase
#pragma unroll
      for (int r = lane; r < BRQ; r += 32) {
        const int t = qrow0 + r;
        const bool ok = t < T;
        sL[st * BRQ + r] = ok ? lse[(static_cast<long long>(b) * nh + h) * T + t] : 0.f;
        sD[st * BRQ + r] = ok ? *delta_ptr(dq_delta, b, t, h, T, nh, HD) : 0.f;
        if constexpr (PACKED) sP[st * BRQ + r] = ok ? pb[t] : 0;
      }
      tma::mbar_arrive(ring.full(s));
      if (++is == per_head) {
        is = 0;
        ++hs;
      }
    }
    return;
  }

  // ---- consumers ------------------------------------------------------------------------------
  tma::setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1;
  const long long ldkv = static_cast<long long>(nkv) * HD;
  const long long kv_off = static_cast<long long>(b) * T * ldkv + kvh * HD;
  float dk_acc[HD / 2], dv_acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk_acc[i] = dv_acc[i] = 0.f;
  const int kv_wg0 = k0 + c * 64;                        // first kv row of this warpgroup
  const int kv_row0 = kv_wg0 + warp * 16 + (lane >> 2);  // kv row of st[4nb], st[4nb+1]; +8
  const int kv_srow = c * 64;                            // this warpgroup's rows in sK, sV

  tma::mbar_wait(kv_full, 0);
  int is = 0;
  for (int s = 0; s < steps; ++s) {
    const int stg = s % kStages;
    const uint32_t tQ = base + Lay::Q + stg * Lay::kQ, tdO = base + Lay::dO + stg * Lay::kQ;
    const float* Lb = sL + stg * BRQ;
    const float* Db = sD + stg * BRQ;
    const int* Pb = sP + stg * BRQ;  // pos of the tile's queries (PACKED)
    const int q_base = (i_first + is) * BRQ;
    if (++is == per_head) is = 0;
    ring.wait_full(s);

    bool skip = q_base + BRQ - 1 < kv_wg0;  // every query of the tile precedes these kv rows
    bool low_mask = false;                  // some query's document starts after a kv row
    if constexpr (PACKED) {
      skip = skip || q_base - Pb[0] > kv_wg0 + 63;  // every query's document starts after them
      const int last = min(BRQ, T - q_base) - 1;
      low_mask = q_base + last - Pb[last] > kv_wg0 + warp * 16;
    }
    if (!skip)
      dkdv_step<HD, BC, BRQ, PACKED>(dk_acc, dv_acc, aK, aV, kv_srow, tQ, tdO, Lb, Db, Pb, q_base,
                                     kv_wg0, kv_row0, low_mask, T, scale_log2, lane, [] {});
    ring.release(s, lane);
  }

  // Epilogue through this warpgroup's own rows of sK and sV (only its wgmmas read them; the
  // barrier makes sure each of its warps is past its last wait).
  warpgroup_barrier(wg);
  const int wrow = kv_srow + warp * 16;
  stage_acc_sw128<BC, HD>(sbase + Lay::K, wrow, dk_acc, scale, scale, lane);
  stage_acc_sw128<BC, HD>(sbase + Lay::V, wrow, dv_acc, 1.f, 1.f, lane);
  __syncwarp();
  store_warp_rows_sw128<BC, HD>(dk + kv_off, ldkv, k0 + wrow, T, sbase + Lay::K, wrow, lane);
  store_warp_rows_sw128<BC, HD>(dv + kv_off, ldkv, k0 + wrow, T, sbase + Lay::V, wrow, lane);
#else
  __trap();  // built without sm_90a: the dispatcher never launches this
#endif
}

template <int HD>
struct WsDqLayout {  // byte offsets from the 1024-aligned base
  static constexpr int kQ = kWsBR * HD * 2, kKV = kWsBCK * HD * 2;
  static constexpr int Q = 0, dO = kQ, K = 2 * kQ, V = K + kStages * kKV;
  static constexpr int bars = V + kStages * kKV;  // qdo_full, full[kStages], empty[kStages]
  static constexpr int bytes = bars + (1 + 2 * kStages) * 8 + 1024;  // + alignment slack
};

template <int HD, bool PACKED>
__global__ void __launch_bounds__(384, 1)
    attention_dq_ws_kernel(const __grid_constant__ CUtensorMap tm_q,
                           const __grid_constant__ CUtensorMap tm_do,
                           const __grid_constant__ CUtensorMap tm_k,
                           const __grid_constant__ CUtensorMap tm_v, bf16* dq,
                           const float* __restrict__ lse, const int* __restrict__ pos, int T,
                           int nh, int nkv, float scale, float scale_log2) {
#if QT_ATTN_HAS_WGMMA
  using Lay = WsDqLayout<HD>;
  constexpr int BR = kWsBR, BCK = kWsBCK;
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
  const uint32_t aQ = base + Lay::Q, adO = base + Lay::dO;
  const uint32_t qdo_full = base + Lay::bars;
  const tma::BufferRing<kStages> ring{qdo_full + 8, qdo_full + 8 * (1 + kStages)};  // K, V

  const int q0 = qt * BR;
  const int q_end = min(q0 + BR, T);
  const int n_kv = (q_end - 1) / BCK + 1;
  const int* pb = PACKED ? pos + static_cast<long long>(b) * T : nullptr;
  int j0 = 0;  // first kv tile any row reads (PACKED: the tile of the first row's document start)
  if constexpr (PACKED) j0 = (q0 - pb[q0]) / BCK;

  if (tid == 0) {
    tma::mbar_init(qdo_full, 1);
    ring.init(1, 8);  // the producer's arrival with the bytes; one arrival per consumer warp
    tma::fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer -------------------------------------------------------------------------
    tma::setmaxnreg_dec<kProducerRegs>();
    if (warp != 0 || lane != 0) return;
    tma::prefetch_map(&tm_k);
    tma::prefetch_map(&tm_v);
    tma::mbar_arrive_expect_tx(qdo_full, 2 * Lay::kQ);
#pragma unroll
    for (int p = 0; p < PANELS; ++p) {
      tma::load_4d(aQ + p * BR * 128, &tm_q, 64 * p, h, q0, b, qdo_full);
      tma::load_4d(adO + p * BR * 128, &tm_do, 64 * p, h, q0, b, qdo_full);
    }
    for (int j = j0; j < n_kv; ++j) {
      const int s = j - j0, st = s % kStages;
      ring.wait_empty(s);
      tma::mbar_arrive_expect_tx(ring.full(s), 2 * Lay::kKV);
      const uint32_t tK = base + Lay::K + st * Lay::kKV, tV = base + Lay::V + st * Lay::kKV;
#pragma unroll
      for (int p = 0; p < PANELS; ++p) {
        tma::load_4d(tK + p * BCK * 128, &tm_k, 64 * p, kvh, j * BCK, b, ring.full(s));
        tma::load_4d(tV + p * BCK * 128, &tm_v, 64 * p, kvh, j * BCK, b, ring.full(s));
      }
    }
    return;
  }

  // ---- consumers ------------------------------------------------------------------------------
  tma::setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1;
  const long long ldq = static_cast<long long>(nh) * HD;
  const long long q_off = static_cast<long long>(b) * T * ldq + h * HD;
  const int q_wg0 = q0 + c * 64;  // first query row of this warpgroup
  const int q_srow = c * 64;      // its rows in sQ, sdO
  const int row_q0 = q_wg0 + warp * 16 + (lane >> 2);

  // Packed: document starts of rows g and g+8 (padded rows: the last row's), their maximum over
  // the warp, and the first kv row this warpgroup reads.
  int ds_row[2] = {0, 0}, ds_warp = 0, ds_wg = 0;
  if constexpr (PACKED) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = min(row_q0 + 8 * r, T - 1);
      ds_row[r] = row - pb[row];
    }
    ds_warp = __shfl_sync(0xffffffffu, ds_row[1], 31);
    const int wrow0 = min(q_wg0, T - 1);
    ds_wg = wrow0 - pb[wrow0];
  }
  float lse2[2], Dr[2];
  dq_row_stats(lse2, Dr, lse, dq, b, h, row_q0, T, nh, HD);
  float dq_acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dq_acc[i] = 0.f;

  tma::mbar_wait(qdo_full, 0);
  for (int j = j0; j < n_kv; ++j) {
    const int s = j - j0, stg = s % kStages;
    const uint32_t tK = base + Lay::K + stg * Lay::kKV, tV = base + Lay::V + stg * Lay::kKV;
    // Skipped: every key of the tile follows this warpgroup's queries, or (PACKED) precedes all
    // their documents.
    bool skip = j * BCK > q_wg0 + 63;
    if constexpr (PACKED) skip = skip || j * BCK + BCK - 1 < ds_wg;
    // Waited for even when skipped: a parity wait must never fall a phase behind.
    ring.wait_full(s);
    if (!skip)
      dq_step<HD, BR, BCK, PACKED>(dq_acc, aQ, adO, q_srow, tK, tV, j * BCK, q_wg0, row_q0, lse2,
                                   Dr, ds_row, ds_warp, lane, scale_log2, [] {});
    ring.release(s, lane);
  }

  // Epilogue through this warpgroup's own rows of sQ (only its wgmmas read them); overwrites the
  // D values read above.
  warpgroup_barrier(wg);
  const int wrow = q_srow + warp * 16;
  stage_acc_sw128<BR, HD>(sbase + Lay::Q, wrow, dq_acc, scale, scale, lane);
  __syncwarp();
  store_warp_rows_sw128<BR, HD>(dq + q_off, ldq, q0 + wrow, T, sbase + Lay::Q, wrow, lane);
#else
  __trap();  // built without sm_90a: the dispatcher never launches this
#endif
}

template <int HD, bool PACKED>
void launch_dq_ws(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                  const float* lse, const int* pos, int B, int T, int nh, int nkv,
                  cudaStream_t stream) {
  const auto [scale, scale_log2] = softmax_scale(HD);
  const CUtensorMap tm_q = make_head_tile_map(q, B, T, nh, HD, kWsBR);
  const CUtensorMap tm_do = make_head_tile_map(dout, B, T, nh, HD, kWsBR);
  const CUtensorMap tm_k = make_head_tile_map(k, B, T, nkv, HD, kWsBCK);
  const CUtensorMap tm_v = make_head_tile_map(v, B, T, nkv, HD, kWsBCK);
  constexpr int smem = WsDqLayout<HD>::bytes;
  auto kernel = attention_dq_ws_kernel<HD, PACKED>;
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid = tiles_last_grid((T + kWsBR - 1) / kWsBR, nh, B);
  kernel<<<grid, 384, smem, stream>>>(tm_q, tm_do, tm_k, tm_v, dq, lse, pos, T, nh, nkv, scale,
                                      scale_log2);
  QT_CHECK_LAUNCH();
}

template <int HD, bool PACKED>
void launch_dkdv_ws(bf16* dk, bf16* dv, const bf16* dq_delta, const bf16* dout, const bf16* q,
                    const bf16* k, const bf16* v, const float* lse, const int* pos, int B, int T,
                    int nh, int nkv, cudaStream_t stream) {
  const auto [scale, scale_log2] = softmax_scale(HD);
  const CUtensorMap tm_q = make_head_tile_map(q, B, T, nh, HD, kWsBRQ);
  const CUtensorMap tm_do = make_head_tile_map(dout, B, T, nh, HD, kWsBRQ);
  const CUtensorMap tm_k = make_head_tile_map(k, B, T, nkv, HD, kWsBC);
  const CUtensorMap tm_v = make_head_tile_map(v, B, T, nkv, HD, kWsBC);
  constexpr int smem = WsLayout<HD>::bytes;
  auto kernel = attention_dkdv_ws_kernel<HD, PACKED>;
  QT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid = tiles_last_grid((T + kWsBC - 1) / kWsBC, nkv, B);
  kernel<<<grid, 384, smem, stream>>>(tm_q, tm_do, tm_k, tm_v, dk, dv, dq_delta, lse, pos, T, nh,
                                      nkv, scale, scale_log2);
  QT_CHECK_LAUNCH();
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    QT_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                   cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      fail_library("CUDA driver", __FILE__, __LINE__, "cudaGetDriverEntryPointByVersion",
                   "cuTensorMapEncodeTiled not found (driver older than CUDA 12.0?)");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

}  // namespace

CUtensorMap make_head_tile_map(const void* base, int B, int T, int heads, int hd, int box_rows) {
  QT_CUDA_REQUIRE(is_aligned16(base) && (hd == 64 || hd == 128) && box_rows >= 1 && box_rows <= 256,
                  "make_head_tile_map: needs a 16-byte aligned base, hd 64 or 128, 1..256 rows");
  CUtensorMap map;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(hd), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(T), static_cast<cuuint64_t>(B)};
  const cuuint64_t row = static_cast<cuuint64_t>(heads) * hd * 2;  // bytes per token
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(hd) * 2, row, row * T};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult rc = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), dims, strides, box, unit,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS)
    fail_library("CUDA driver", __FILE__, __LINE__, "cuTensorMapEncodeTiled",
                 ("error " + std::to_string(static_cast<int>(rc))).c_str());
  return map;
}

void attention_dkdv_ws_sm90(bf16* dk, bf16* dv, const bf16* dq_delta, const bf16* dout,
                            const bf16* q, const bf16* k, const bf16* v, const float* lse,
                            const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                            cudaStream_t stream) {
  with_hd_packed(hd, pos, [&]<int HD, bool PACKED>() {
    launch_dkdv_ws<HD, PACKED>(dk, dv, dq_delta, dout, q, k, v, lse, pos, B, T, nh, nkv, stream);
  });
}

void attention_dq_ws_sm90(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                          const float* lse, const std::int32_t* pos, int B, int T, int nh, int nkv,
                          int hd, cudaStream_t stream) {
  with_hd_packed(hd, pos, [&]<int HD, bool PACKED>() {
    launch_dq_ws<HD, PACKED>(dq, dout, q, k, v, lse, pos, B, T, nh, nkv, stream);
  });
}

}  // namespace qt::cuda
