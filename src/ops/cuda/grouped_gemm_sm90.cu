// The experts' grouped GEMMs on sm_90a (grouped_gemm_tiles.cuh: the three products and their
// scheduling): output tiles of 128 x BN (BN = 128 or 256), two warpgroups of 64 rows each, k-steps
// of 64 through a STAGES-deep cp.async ring into 128B-swizzled shared memory (attention_wgmma.cuh's
// layout; zero-filled past a group's rows, past out / in and past the reduction's end) and
// wgmma with both operands from shared memory: K-major where the operand's k runs along its rows
// in memory (x, dy and w_g of the forward), MN-major (the transpose bit) where k is the row index
// (w_g of the input gradient, dy_g and x_g of the weight gradient).
//
// Iteration kt, every thread: wait for its copies of stage kt, fence them to the async proxy, one
// block barrier; load stage kt + STAGES - 2 into the buffer of stage kt - 2 (free: each warpgroup
// waited for its wgmmas of kt - 2 before the barrier); issue stage kt's 4 wgmmas; wait until only
// they are in flight. So two stages load and one multiplies while the next is issued.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/attention_wgmma.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/grouped_gemm_tiles.cuh"
#include "ops/cuda/wgmma_gemm.cuh"

namespace qt::cuda {
namespace {

using namespace attn;

constexpr int kBM = 128, kBK = 64, kThreads = 256;

template <int BN, int STAGES>
struct TileConfig {
  static constexpr int kStages = STAGES;
  static constexpr int kATile = kBM * kBK * 2;  // bytes
  static constexpr int kBTile = BN * kBK * 2;
  static constexpr int kStageBytes = kATile + kBTile;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + alignment slack
};

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// An R x C tile of a row-major bf16 matrix g (leading dimension ld, 16-byte aligned rows) at rows
// [row0, row0 + R), columns [col0, col0 + C) into the 128B-swizzled layout (C / 64 panels of R
// lines, attention_wgmma.cuh); rows >= row_end and columns >= col_end (a multiple of 8) are
// zero-filled.
template <int R, int C>
__device__ __forceinline__ void load_tile(uint32_t tile, const bf16* g, long long ld, int row0,
                                          int row_end, int col0, int col_end, int tid) {
  constexpr int kChunks = C / 8;
  static_assert((R * kChunks) % kThreads == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int it = 0; it < R * kChunks / kThreads; ++it) {
    const int idx = tid + it * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row0 + r, col = col0 + c * 8;
    const bool ok = row < row_end && col < col_end;
    cp_async_16(tile + sw128<R>(r, c), ok ? g + row * ld + col : g, ok);
  }
}

template <GroupedMode MODE, int BN, int STAGES>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_kernel(void* out_ptr, const bf16* __restrict__ a,
                             const bf16* __restrict__ b, const int* __restrict__ offsets,
                             int groups, int in, int out, float alpha, bool accumulate) {
#if QT_ATTN_HAS_WGMMA
  using Cfg = TileConfig<BN, STAGES>;
  constexpr int S = Cfg::kStages;
  constexpr bool kAT = MODE == GroupedMode::kBackwardWeight;  // A stored [k][m]
  constexpr bool kBT = MODE != GroupedMode::kForward;         // B stored [k][n]
  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = warpgroup_index();

  // The block's output tile: rows [m0, m_end) and columns [n0, n_end) of C, the reduction
  // [k_begin, k_end); A and B as row-major [rows, ld] matrices in absolute coordinates.
  int m0, m_end, n0, n_end, k_begin, k_end, group;
  long long lda, ldb;
  const int N = MODE == GroupedMode::kForward ? out : in;  // C's columns
  const int n_tiles = (N + BN - 1) / BN;
  if constexpr (MODE == GroupedMode::kBackwardWeight) {
    group = blockIdx.y;
    m0 = (blockIdx.x / n_tiles) * kBM;
    m_end = out;
    n0 = (blockIdx.x % n_tiles) * BN;
    n_end = in;
    k_begin = offsets[group];
    k_end = offsets[group + 1];
    if (accumulate && k_end == k_begin) return;
    lda = out;  // dy [rows, out]
    ldb = in;   // x [rows, in]
  } else {
    const GroupTile gt = find_group_tile<kBM>(offsets, groups, blockIdx.x / n_tiles, lane);
    if (gt.group < 0) return;  // every thread alike: no barrier has been passed yet
    group = gt.group;
    m0 = offsets[group] + gt.tile * kBM;
    m_end = offsets[group + 1];
    n0 = (blockIdx.x % n_tiles) * BN;
    n_end = N;
    k_begin = 0;
    k_end = MODE == GroupedMode::kForward ? in : out;
    lda = k_end;  // x [rows, in] or dy [rows, out]
    ldb = in;     // w_g [out, in]: [n][k] or [k][n]
    b += static_cast<std::size_t>(group) * out * in;
  }

  extern __shared__ char smem_raw[];
  const uint32_t s0 = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzled tiles 1024-aligned
  const int nk = (k_end - k_begin + kBK - 1) / kBK;
  auto load = [&](int stage, int kt) {
    const int k0 = k_begin + kt * kBK;
    const uint32_t sa = s0 + stage * Cfg::kStageBytes, sb = sa + Cfg::kATile;
    if constexpr (kAT)
      load_tile<kBK, kBM>(sa, a, lda, k0, k_end, m0, m_end, tid);
    else
      load_tile<kBM, kBK>(sa, a, lda, m0, m_end, k0, k_end, tid);
    if constexpr (kBT)
      load_tile<kBK, BN>(sb, b, ldb, k0, k_end, n0, n_end, tid);
    else
      load_tile<BN, kBK>(sb, b, ldb, n0, n_end, k0, k_end, tid);
  };

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
#pragma unroll
  for (int s = 0; s < S - 2; ++s) {
    if (s < nk) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<S - 3>();
    fence_proxy_async();
    __syncthreads();
    const int next = kt + S - 2;
    if (next < nk) load(next % S, next);
    cp_async_commit();
    const uint32_t sa = s0 + (kt % S) * Cfg::kStageBytes, sb = sa + Cfg::kATile;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      // A: this warpgroup's 64 rows of C. K-major: lines 64 wg.., bytes 32 kk of each; MN-major:
      // panel wg (columns 64 wg..), lines 16 kk... B: all BN columns likewise.
      const uint64_t da = kAT ? wgmma_desc(sa + wg * (kBK * 128) + kk * 2048, kBK * 128, 1024)
                              : desc_kmajor<kBM>(sa, 64 * wg, kk);
      const uint64_t db = kBT ? desc_mnmajor<kBK>(sb, kk) : desc_kmajor<BN>(sb, 0, kk);
      if constexpr (BN == 256)
        wgmma_m64n256<kAT, kBT>(acc, da, db);
      else
        wgmma_m64n128<kAT, kBT>(acc, da, db);
    }
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  fence_acc(acc);
  cp_async_wait<0>();

  // Store: accumulator 4 nb + e at row 16 (warp % 4) + g + 8 (e / 2) of the warpgroup's 64,
  // column 8 nb + 2 t + e % 2.
  const int g = lane >> 2, t = lane & 3;
  const int row_base = m0 + 64 * wg + 16 * ((tid >> 5) & 3) + g;
#pragma unroll
  for (int nb = 0; nb < BN / 8; ++nb) {
    const int col = n0 + nb * 8 + 2 * t;
    if (col >= n_end) continue;  // n_end a multiple of 8: both columns or neither
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 8 * h;
      if (row >= m_end) continue;
      float2 r{alpha * acc[4 * nb + 2 * h], alpha * acc[4 * nb + 2 * h + 1]};
      if constexpr (MODE == GroupedMode::kBackwardWeight) {
        float* p = static_cast<float*>(out_ptr) + static_cast<std::size_t>(group) * out * in +
                   static_cast<std::size_t>(row) * in + col;
        if (accumulate) {
          const float2 o = *reinterpret_cast<const float2*>(p);
          r.x += o.x;
          r.y += o.y;
        }
        *reinterpret_cast<float2*>(p) = r;
      } else {  // accumulating: the bf16 output read, the sum in fp32, rounded once
        bf16* p = static_cast<bf16*>(out_ptr) + static_cast<std::size_t>(row) * N + col;
        if (accumulate) {
          const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
          r.x += o.x;
          r.y += o.y;
        }
        *reinterpret_cast<uint32_t*>(p) = pack_bf16(r.x, r.y);
      }
    }
  }
#endif
}

template <GroupedMode MODE, int BN, int STAGES>
void launch(dim3 grid, void* c, const bf16* a, const bf16* b, const int* offsets, int groups,
            int in, int out, float alpha, bool accumulate, cudaStream_t stream) {
  constexpr int kSmem = TileConfig<BN, STAGES>::kSmemBytes;
  static bool configured = false;  // per instantiation; the attribute is per device function
  if (!configured) {
    QT_CHECK_CUDA(cudaFuncSetAttribute(grouped_gemm_sm90_kernel<MODE, BN, STAGES>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    configured = true;
  }
  grouped_gemm_sm90_kernel<MODE, BN, STAGES><<<grid, kThreads, kSmem, stream>>>(
      c, a, b, offsets, groups, in, out, alpha, accumulate);
  QT_CHECK_LAUNCH();
}

// One block a tile of C: (tiles of w) x groups, or every possible (row tile, column tile).
template <GroupedMode MODE, int BN, int STAGES>
void launch_tiles(void* c, const bf16* a, const bf16* b, const int* offsets, int groups, int rows,
                  int in, int out, float alpha, bool accumulate, cudaStream_t stream) {
  const int cols = MODE == GroupedMode::kForward ? out : in;
  dim3 grid;
  if constexpr (MODE == GroupedMode::kBackwardWeight)
    grid = dim3(static_cast<unsigned>(((out + kBM - 1) / kBM) * ((in + BN - 1) / BN)),
                static_cast<unsigned>(groups));
  else
    grid = dim3(grouped_row_blocks(rows, groups, cols, kBM, BN));
  launch<MODE, BN, STAGES>(grid, c, a, b, offsets, groups, in, out, alpha, accumulate, stream);
}

template <GroupedMode MODE>
void launch_mode(void* c, const bf16* a, const bf16* b, const int* offsets, int groups, int rows,
                 int in, int out, float alpha, bool accumulate, cudaStream_t stream) {
  const int cols = MODE == GroupedMode::kForward ? out : in;
  if (MODE == GroupedMode::kBackwardWeight)
    QT_CUDA_REQUIRE(groups <= 65535, "grouped_gemm_backward_weight: groups <= 65535");
  // Measured on an H100 (qtrain_bench_grouped_gemm_cuda, docs/moe.md): 128 x 256 tiles with 4
  // stages beat 128 x 128 with 6, 4 or (2 blocks an SM) 3, and 128 x 256 with 3, in every product
  // of the 30B-A3B shapes, and persistent blocks (one an SM walking the tiles, the next tile's
  // loads beside a tile's stores: 1 to 18% slower); narrow outputs (a LoRA adapter's rank) take
  // the narrow tile.
  if (cols > 128)
    launch_tiles<MODE, 256, 4>(c, a, b, offsets, groups, rows, in, out, alpha, accumulate,
                               stream);
  else
    launch_tiles<MODE, 128, 6>(c, a, b, offsets, groups, rows, in, out, alpha, accumulate,
                               stream);
}

}  // namespace

void grouped_gemm_sm90(GroupedMode mode, void* c, const bf16* a, const bf16* b,
                       const int* offsets, int groups, int rows, int in, int out, float alpha,
                       bool accumulate, cudaStream_t stream) {
  switch (mode) {
    case GroupedMode::kForward:
      launch_mode<GroupedMode::kForward>(c, a, b, offsets, groups, rows, in, out, alpha,
                                         accumulate, stream);
      break;
    case GroupedMode::kBackwardData:
      launch_mode<GroupedMode::kBackwardData>(c, a, b, offsets, groups, rows, in, out, alpha,
                                              accumulate, stream);
      break;
    case GroupedMode::kBackwardWeight:
      launch_mode<GroupedMode::kBackwardWeight>(c, a, b, offsets, groups, rows, in, out, alpha,
                                                accumulate, stream);
      break;
  }
}

}  // namespace qt::cuda
