// What the two grouped-GEMM kernels share (grouped_gemm.cu: mma.sync, any sm_80+ GPU;
// grouped_gemm_sm90.cu: wgmma, sm_90a): the three products, the scheduling of row tiles over
// groups whose rows only the device knows, and the sm_90a launcher. Included by .cu files only.
//
//   forward       C [n_g, out] = x_g [n_g, in] * w_g^T   A [m][k] = x,      B [n][k] = w_g
//   backward data C [n_g, in]  = dy_g [n_g, out] * w_g   A [m][k] = dy,     B [k][n] = w_g
//   backward wgt  C [out, in]  = dy_g^T * x_g            A [k][m] = dy_g,   B [k][n] = x_g
//
// The two row-grouped products launch one block per possible (row tile, column tile) pair, at
// most ceil(rows / BM) + groups row tiles; each warp finds its block's group by a warp prefix sum
// of the groups' row-tile counts read from the offsets, and blocks past the last tile leave at
// once. The weight gradient launches (tiles of w) x groups and runs each group's rows as the
// reduction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "ops/cuda/common.cuh"

namespace qt::cuda {

enum class GroupedMode { kForward, kBackwardData, kBackwardWeight };

// The sm_90a kernel (grouped_gemm_sm90.cu) over the same arguments as grouped_gemm.cu's: c is
// bf16 [rows, N] (forward, backward data) or fp32 [groups, out, in] (backward weight); needs
// in, out multiples of 8, 16-byte aligned pointers and grouped_gemm_wgmma_available().
void grouped_gemm_sm90(GroupedMode mode, void* c, const __nv_bfloat16* a, const __nv_bfloat16* b,
                       const int* offsets, int groups, int rows, int in, int out, float alpha,
                       bool accumulate, cudaStream_t stream);

// Blocks of a row-grouped product with row tiles of bm and column tiles of bn over cols columns:
// every (row tile, column tile) pair that can exist.
inline unsigned grouped_row_blocks(int rows, int groups, int cols, int bm, int bn) {
  const long long m_tiles = (static_cast<long long>(rows) + bm - 1) / bm + groups;
  const long long blocks = m_tiles * ((cols + bn - 1) / bn);
  QT_CUDA_REQUIRE(blocks < (1LL << 31), "grouped GEMM: too many tiles");
  return static_cast<unsigned>(blocks);
}

#ifdef __CUDACC__
// The group of row tile `tile` (of BM rows) among the groups' row tiles in group order, and the
// tile's index within its group; group -1 when past the last tile. Warp-uniform (every lane
// returns the same), computed by each warp on its own.
struct GroupTile {
  int group, tile;
};
template <int BM>
__device__ __forceinline__ GroupTile find_group_tile(const int* offsets, int groups, int tile,
                                                     int lane) {
  int base = 0;
  for (int g0 = 0; g0 < groups; g0 += 32) {
    const int g = g0 + lane;
    const int n = g < groups ? offsets[g + 1] - offsets[g] : 0;
    const int t = (n + BM - 1) / BM;
    int inc = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inc, o);
      if (lane >= o) inc += v;
    }
    const int excl = inc - t;
    const unsigned hit =
        __ballot_sync(0xffffffffu, t > 0 && tile >= base + excl && tile < base + inc);
    if (hit) {
      const int src = __ffs(hit) - 1;
      return {g0 + src, tile - base - __shfl_sync(0xffffffffu, excl, src)};
    }
    base += __shfl_sync(0xffffffffu, inc, 31);
  }
  return {-1, 0};
}
#endif

}  // namespace qt::cuda
