// The experts' grouped GEMMs (grouped_gemm.cuh) on any sm_80+ GPU, and the dispatch to the sm_90a
// kernel (grouped_gemm_sm90.cu) where the build, the GPU and the shapes allow it. One kernel
// template over the three products (grouped_gemm_tiles.cuh: operand layouts and scheduling),
// 128 x 128 output tiles of 8 warps (each 64 x 32), k-steps of 64 through a 3-stage cp.async
// pipeline into XOR-swizzled shared memory, ldmatrix (.trans where the operand is stored k-major)
// and mma.sync m16n8k16 (attention_mma.cuh's helpers). A group without rows writes zeros to its
// weight gradient (or nothing when accumulating). Rows past a group's end, columns past out / in
// and k past the reduction's end are zero-filled in shared memory and masked on store.
#include <atomic>
#include <cstddef>
#include <string>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/attention_mma.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/grouped_gemm.cuh"
#include "ops/cuda/grouped_gemm_tiles.cuh"

namespace qt::cuda {
namespace {

using attn::addr_a;
using attn::addr_b;
using attn::addr_bt;
using attn::cp_async_16;
using attn::cp_async_commit;
using attn::ldmatrix_x4;
using attn::ldmatrix_x4_trans;
using attn::mma_16816;
using attn::pack_bf16;
using attn::smem_addr;
using attn::swz;

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 3, kThreads = 256;
constexpr int kTileBytes = kBM * kBK * 2;  // one operand's tile, A and B alike
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kSmemBytes = kStages * kStageBytes;
static_assert(kBM == kBN, "A and B tiles share one size");

using Mode = GroupedMode;

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// An R x C tile (C bf16 a row, swizzled as swz<C>) from g (row-major, leading dimension ld) at
// rows [row0, row0 + R), columns [col0, col0 + C); rows >= row_end and columns >= col_end are
// zero-filled. ALIGNED (ld and col_end multiples of 8, g 16-byte aligned): 16-byte cp.async;
// otherwise element by element through registers (the small shapes of the tests' models).
template <int R, int C, bool ALIGNED>
__device__ __forceinline__ void load_tile(uint32_t tile, const bf16* g, long long ld, int row0,
                                          int row_end, int col0, int col_end, int tid) {
  constexpr int kChunks = C / 8;
  static_assert((R * kChunks) % kThreads == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int it = 0; it < R * kChunks / kThreads; ++it) {
    const int idx = tid + it * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row0 + r, col = col0 + c * 8;
    if constexpr (ALIGNED) {
      const bool ok = row < row_end && col < col_end;
      const bf16* src = ok ? g + row * ld + col : g;
      cp_async_16(tile + swz<C>(r, c), src, ok);
    } else {
      alignas(16) bf16 v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[e] = row < row_end && col + e < col_end ? g[row * ld + col + e] : __float2bfloat16(0.f);
      const uint4 u = *reinterpret_cast<const uint4*>(v);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + swz<C>(r, c)),
                   "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w));
    }
  }
}

template <Mode MODE, bool ALIGNED>
__global__ void __launch_bounds__(kThreads, 2) grouped_gemm_kernel(void* out_ptr, const bf16* a,
                                                                const bf16* b,
                                                                const int* offsets, int groups,
                                                                int in, int out, float alpha,
                                                                bool accumulate) {
  constexpr bool kAT = MODE == Mode::kBackwardWeight;  // A stored [k][m]
  constexpr bool kBT = MODE != Mode::kForward;         // B stored [k][n]
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp >> 2, warp_n = warp & 3;  // 2 x 4 warps of 64 x 32

  // The block's output tile: rows [m0, m_end) and columns [n0, n_end) of C, the reduction
  // [k_begin, k_end); A and B as row-major [rows, ld] matrices in absolute coordinates.
  int m0, m_end, n0, n_end, k_begin, k_end, group;
  long long lda, ldb;
  const int N = MODE == Mode::kForward ? out : in;  // C's columns
  const int n_tiles = (N + kBN - 1) / kBN;
  if constexpr (MODE == Mode::kBackwardWeight) {
    group = blockIdx.y;
    const int tile = blockIdx.x;
    m0 = (tile / n_tiles) * kBM;
    m_end = out;
    n0 = (tile % n_tiles) * kBN;
    n_end = in;
    k_begin = offsets[group];
    k_end = offsets[group + 1];
    if (accumulate && k_end == k_begin) return;
    lda = out;  // dy [rows, out]
    ldb = in;   // x [rows, in]
  } else {
    const int tile = blockIdx.x;
    const GroupTile gt = find_group_tile<kBM>(offsets, groups, tile / n_tiles, lane);
    if (gt.group < 0) return;  // every warp alike: no barrier has been passed yet
    group = gt.group;
    m0 = offsets[group] + gt.tile * kBM;
    m_end = offsets[group + 1];
    n0 = (tile % n_tiles) * kBN;
    n_end = N;
    k_begin = 0;
    k_end = MODE == Mode::kForward ? in : out;
    lda = k_end;                                   // x [rows, in] or dy [rows, out]
    ldb = in;                                      // w_g [out, in]: [n][k] or [k][n]
    b += static_cast<std::size_t>(group) * out * in;
  }

  const uint32_t s0 = smem_addr(smem);
  const int nk = (k_end - k_begin + kBK - 1) / kBK;
  auto load = [&](int stage, int kt) {
    const int k0 = k_begin + kt * kBK;
    const uint32_t sa = s0 + stage * kStageBytes, sb = sa + kTileBytes;
    if constexpr (kAT)
      load_tile<kBK, kBM, ALIGNED>(sa, a, lda, k0, k_end, m0, m_end, tid);
    else
      load_tile<kBM, kBK, ALIGNED>(sa, a, lda, m0, m_end, k0, k_end, tid);
    if constexpr (kBT)
      load_tile<kBK, kBN, ALIGNED>(sb, b, ldb, k0, k_end, n0, n_end, tid);
    else
      load_tile<kBN, kBK, ALIGNED>(sb, b, ldb, n0, n_end, k0, k_end, tid);
  };

  float acc[4][4][4] = {};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < nk) load(next % kStages, next);
    cp_async_commit();
    const uint32_t sa = s0 + (kt % kStages) * kStageBytes, sb = sa + kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t af[4][4], bfr[2][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int mr = warp_m * 64 + i * 16;
        if constexpr (kAT)
          ldmatrix_x4_trans(af[i], sa + swz<kBM>(kk * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                 mr / 8 + ((lane >> 3) & 1)));
        else
          ldmatrix_x4(af[i], addr_a<kBK>(sa, mr, kk, lane));
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int nc = warp_n * 32 + j * 16;
        if constexpr (kBT)
          ldmatrix_x4_trans(bfr[j], addr_bt<kBN>(sb, kk * 16, nc / 16, lane));
        else
          ldmatrix_x4(bfr[j], addr_b<kBK>(sb, nc, kk, lane));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          mma_16816(acc[i][j], af[i], bfr[j >> 1][(j & 1) * 2], bfr[j >> 1][(j & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();

  // Store: c0, c1 at (row g, cols 2t, 2t+1), c2, c3 at row g + 8 of each 16 x 8 block.
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = n0 + warp_n * 32 + j * 8 + 2 * t;
      if (col >= n_end) continue;
      const bool pair = col + 1 < n_end;  // always when ALIGNED (n_end a multiple of 8)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + warp_m * 64 + i * 16 + g + 8 * h;
        if (row >= m_end) continue;
        const float v0 = alpha * acc[i][j][2 * h], v1 = alpha * acc[i][j][2 * h + 1];
        if constexpr (MODE == Mode::kBackwardWeight) {
          float* p = static_cast<float*>(out_ptr) + static_cast<std::size_t>(group) * out * in +
                     static_cast<std::size_t>(row) * in + col;
          if constexpr (ALIGNED) {
            float2 r{v0, v1};
            if (accumulate) {
              const float2 o = *reinterpret_cast<const float2*>(p);
              r.x += o.x;
              r.y += o.y;
            }
            *reinterpret_cast<float2*>(p) = r;
          } else {
            p[0] = accumulate ? p[0] + v0 : v0;
            if (pair) p[1] = accumulate ? p[1] + v1 : v1;
          }
        } else {
          // Accumulating: the bf16 output read, the sum in fp32, rounded once.
          bf16* p = static_cast<bf16*>(out_ptr) + static_cast<std::size_t>(row) * N + col;
          if constexpr (ALIGNED) {
            float2 r{v0, v1};
            if (accumulate) {
              const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
              r.x += o.x;
              r.y += o.y;
            }
            *reinterpret_cast<uint32_t*>(p) = pack_bf16(r.x, r.y);
          } else {
            p[0] = __float2bfloat16(accumulate ? __bfloat162float(p[0]) + v0 : v0);
            if (pair) p[1] = __float2bfloat16(accumulate ? __bfloat162float(p[1]) + v1 : v1);
          }
        }
      }
    }
}

void check_args(const char* op, const int* offsets, int groups, int rows, int in, int out) {
  QT_CUDA_REQUIRE(groups >= 1 && rows >= 0 && in > 0 && out > 0 && offsets != nullptr,
                  std::string(op) + ": need groups >= 1, rows >= 0, in, out > 0 and offsets, got groups=" +
                      std::to_string(groups) + " rows=" + std::to_string(rows) +
                      " in=" + std::to_string(in) + " out=" + std::to_string(out));
}

// The fast path's condition: 16-byte rows and pointers.
bool aligned(const void* p0, const void* p1, const void* p2, int in, int out) {
  return in % 8 == 0 && out % 8 == 0 && is_aligned16(p0) && is_aligned16(p1) && is_aligned16(p2);
}

template <Mode MODE, bool ALIGNED>
void launch_as(dim3 grid, void* c, const bf16* a, const bf16* b, const int* offsets, int groups,
               int in, int out, float alpha, bool accumulate, cudaStream_t stream) {
  static bool configured = false;  // per instantiation; the attribute is per device function
  if (!configured) {
    QT_CHECK_CUDA(cudaFuncSetAttribute(grouped_gemm_kernel<MODE, ALIGNED>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    configured = true;
  }
  grouped_gemm_kernel<MODE, ALIGNED><<<grid, kThreads, kSmemBytes, stream>>>(
      c, a, b, offsets, groups, in, out, alpha, accumulate);
  QT_CHECK_LAUNCH();
}

template <Mode MODE>
void launch(dim3 grid, void* c, const bf16* a, const bf16* b, const int* offsets, int groups,
            int in, int out, float alpha, bool accumulate, cudaStream_t stream) {
  if (aligned(c, a, b, in, out))
    launch_as<MODE, true>(grid, c, a, b, offsets, groups, in, out, alpha, accumulate, stream);
  else
    launch_as<MODE, false>(grid, c, a, b, offsets, groups, in, out, alpha, accumulate, stream);
}

std::atomic<GroupedGemmKernel> g_kernel{GroupedGemmKernel::kAuto};

// Whether a product runs on the sm_90a kernel: the choice, the build and GPU, the shapes.
bool use_sm90(const void* c, const void* a, const void* b, int in, int out) {
  const GroupedGemmKernel k = g_kernel.load(std::memory_order_relaxed);
  if (k == GroupedGemmKernel::kMma) return false;
  const bool possible = attention_wgmma_available() && aligned(c, a, b, in, out);
  QT_CUDA_REQUIRE(k != GroupedGemmKernel::kWgmma || possible,
                  "grouped GEMM: GroupedGemmKernel::kWgmma needs an sm_90a build and GPU, in and "
                  "out multiples of 8 and 16-byte aligned pointers");
  return possible;
}

}  // namespace

void grouped_gemm_forward(bf16* y, const bf16* x, const bf16* w, const int* offsets, int groups,
                          int rows, int in, int out, cudaStream_t stream, float alpha,
                          bool accumulate) {
  check_args("grouped_gemm_forward", offsets, groups, rows, in, out);
  if (rows == 0) return;
  if (use_sm90(y, x, w, in, out))
    return grouped_gemm_sm90(Mode::kForward, y, x, w, offsets, groups, rows, in, out, alpha,
                             accumulate, stream);
  launch<Mode::kForward>(dim3(grouped_row_blocks(rows, groups, out, kBM, kBN)), y, x, w, offsets, groups,
                         in, out, alpha, accumulate, stream);
}

void grouped_gemm_backward_data(bf16* dx, const bf16* dy, const bf16* w, const int* offsets,
                                int groups, int rows, int in, int out, cudaStream_t stream,
                                float alpha, bool accumulate) {
  check_args("grouped_gemm_backward_data", offsets, groups, rows, in, out);
  if (rows == 0) return;
  if (use_sm90(dx, dy, w, in, out))
    return grouped_gemm_sm90(Mode::kBackwardData, dx, dy, w, offsets, groups, rows, in, out,
                             alpha, accumulate, stream);
  launch<Mode::kBackwardData>(dim3(grouped_row_blocks(rows, groups, in, kBM, kBN)), dx, dy, w, offsets,
                              groups, in, out, alpha, accumulate, stream);
}

void grouped_gemm_backward_weight(float* dw, const bf16* dy, const bf16* x, const int* offsets,
                                  int groups, int in, int out, bool accumulate,
                                  cudaStream_t stream, float alpha) {
  check_args("grouped_gemm_backward_weight", offsets, groups, 0, in, out);
  QT_CUDA_REQUIRE(groups <= 65535, "grouped_gemm_backward_weight: groups <= 65535");
  if (use_sm90(dw, dy, x, in, out))
    return grouped_gemm_sm90(Mode::kBackwardWeight, dw, dy, x, offsets, groups, 0, in, out,
                             alpha, accumulate, stream);
  const unsigned tiles = static_cast<unsigned>(((out + kBM - 1) / kBM) * ((in + kBN - 1) / kBN));
  launch<Mode::kBackwardWeight>(dim3(tiles, static_cast<unsigned>(groups)), dw, dy, x, offsets,
                                groups, in, out, alpha, accumulate, stream);
}

void set_grouped_gemm_kernel(GroupedGemmKernel kernel) {
  g_kernel.store(kernel, std::memory_order_relaxed);
}

}  // namespace qt::cuda
