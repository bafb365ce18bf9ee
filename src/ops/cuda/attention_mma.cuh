// Device helpers shared by the attention kernels (attention_forward.cu, attention_backward.cu):
// cp.async tile loads into XOR-swizzled shared memory, ldmatrix, and mma.sync m16n8k16 bf16 with
// fp32 accumulation. Included by .cu files only.
//
// Fragment layouts of mma.m16n8k16.row.col (g = lane / 4, t = lane % 4):
//   A [16 x 16]: a0 (row g, cols 2t..2t+1), a1 (row g+8, same cols), a2 (row g, cols 2t+8..),
//                a3 (row g+8, cols 2t+8..)
//   B [16 x 8]:  b0 (k 2t..2t+1, col g), b1 (k 2t+8.., col g)
//   C [16 x 8]:  c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1)
// The C fragments of two neighbouring 8-column blocks form the A fragment of one 16-wide k-step,
// which is how P and dS go from one product into the next without shared memory.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "cuda/check.h"

namespace qt::cuda::attn {

using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Grid of the attention kernels: (head, batch, tile), the tile slowest. Blocks start in linear
// order (x fastest), so the longest tiles (index 0) of every head and batch start first and the
// short ones fill the tail (docs/attention.md, "Launch order"). Kernels read h = blockIdx.x,
// b = blockIdx.y, tile = blockIdx.z; check_shapes keeps B and the tiles (>= 64 rows) <= 65535.
inline dim3 tiles_last_grid(int tiles, int heads, int B) {
  return dim3(static_cast<unsigned>(heads), static_cast<unsigned>(B),
              static_cast<unsigned>(tiles));
}

// The scores' scale 1 / sqrt(hd) and the same times log2 e (the kernels' exp2 units), as every
// launcher passes them.
struct SoftmaxScale {
  float scale, log2;
};
inline SoftmaxScale softmax_scale(int hd) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  return {scale, scale * kLog2e};
}

// f.template operator()<HD, PACKED>() for hd (64 or 128) and PACKED = (pos != nullptr): the
// launchers' dispatch onto the kernels' template arguments.
template <typename F>
void with_hd_packed(int hd, const void* pos, F&& f) {
  auto by_pos = [&]<int HD>() {
    if (pos)
      f.template operator()<HD, true>();
    else
      f.template operator()<HD, false>();
  };
  if (hd == 128)
    by_pos.template operator()<128>();
  else
    by_pos.template operator()<64>();
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of 16-byte chunk `c` of row `r` in a tile of rows of HD bf16 (HD * 2 bytes each).
// The chunk index is XORed with r % 8, so the 8 rows that one ldmatrix 8x8 matrix reads (same
// logical chunk) sit in 8 different bank groups: conflict-free for loads and ldmatrix alike.
template <int HD>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>(r * (HD * 2) + ((c ^ (r & 7)) << 4));
}

// 16 bytes global -> shared; when !valid the 16 bytes are zero-filled and src is not read.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// 4 bytes global -> shared, zero-filled when !valid.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n"); }

// Rows [row0, row0 + ROWS) of a [T, ld] bf16 matrix (HD used columns) into a swizzled tile;
// rows >= T are zero-filled. All NT threads of the block take part.
template <int ROWS, int HD, int NT>
__device__ __forceinline__ void load_tile(uint32_t tile, const bf16* g, int row0, long long ld,
                                          int T, int tid) {
  constexpr int kChunks = HD / 8;
  static_assert((ROWS * kChunks) % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / NT; ++it) {
    const int idx = tid + it * NT;
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row0 + r;
    const bool ok = row < T;
    const bf16* src = ok ? g + row * ld + c * 8 : g;
    cp_async_16(tile + swz<HD>(r, c), src, ok);
  }
}

// Rows [0, 16) of a warp's staged tile (rows row_base .. row_base+15 of the shared tile, holding
// global rows grow0 ..) -> global, 16 bytes per lane and access; rows >= T are skipped.
template <int HD>
__device__ __forceinline__ void store_warp_rows(bf16* g, long long ld, int grow0, int T,
                                                const char* tile, int row_base, int lane) {
  constexpr int kChunks = HD / 8;
#pragma unroll
  for (int it = 0; it < 16 * kChunks / 32; ++it) {
    const int idx = lane + it * 32;
    const int r = idx / kChunks, c = idx % kChunks;
    if (grow0 + r < T) {
      const uint4 val = *reinterpret_cast<const uint4*>(tile + swz<HD>(row_base + r, c));
      *reinterpret_cast<uint4*>(g + (grow0 + r) * ld + c * 8) = val;
    }
  }
}

// The backward's D of row (b, t, h), kept in the first 4 bytes of dq's row until the dQ kernel
// overwrites it (16-byte aligned: hd >= 64).
__device__ __forceinline__ const float* delta_ptr(const bf16* dq, int b, int t, int h, int T,
                                                  int nh, int hd) {
  return reinterpret_cast<const float*>(dq + ((static_cast<long long>(b) * T + t) * nh + h) * hd);
}

// Packed rows (PACKED, both backward paths): the first query tile in [i_first + 1, n_qt) whose
// first row's document starts after key k_last (n_qt if none): every later tile's rows start even
// later (ds = t - pos[t] never decreases), so the query tiles [i_first, result) are the only ones
// that read keys <= k_last. Binary search, pb = pos[b].
__device__ __forceinline__ int packed_query_tile_end(const int* pb, int i_first, int n_qt, int rows,
                                                     int k_last) {
  int lo = i_first + 1, hi = n_qt;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    const int t = mid * rows;
    if (t - pb[t] > k_last)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// The query tiles (of `rows` rows) that a dK/dV block of kv rows [k0, k_last] visits for each
// query head of its group: [first, first + count). Tiles before k0 / rows lie wholly above the
// diagonal; PACKED (pb = pos[b]): the tiles from packed_query_tile_end on read none of its keys.
struct QueryTiles {
  int first, count;
};
template <bool PACKED>
__device__ __forceinline__ QueryTiles dkdv_query_tiles(const int* pb, int T, int rows, int k0,
                                                       int k_last) {
  const int n_qt = (T + rows - 1) / rows;
  const int first = k0 / rows;
  int end = n_qt;
  if constexpr (PACKED) end = packed_query_tile_end(pb, first, n_qt, rows, k_last);
  return {first, end - first};
}

// End of a forward row pair (rows row_q0 and row_q0 + 8 of this lane's quad, log2-unit running
// max m_run, this lane's part of the row sums l_run): inv = 1 / the full row sum, and the quad's
// first lane writes lse = (m + log2 l) ln 2 to lse_bh[row] (lse_bh: the (b, head) row of lse)
// for rows below T.
__device__ __forceinline__ void finish_forward_rows(float (&inv)[2], const float (&l_run)[2],
                                                    const float (&m_run)[2], float* lse_bh,
                                                    int row_q0, int T, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[r] = 1.f / l;
    const int row = row_q0 + 8 * r;
    if ((lane & 3) == 0 && row < T) lse_bh[row] = (m_run[r] + log2f(l)) * kLn2;
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a b  (m16n8k16, bf16 inputs, fp32 accumulators)
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Lane addresses for ldmatrix.x4 on a swizzled tile (lane l feeds row l % 8 of matrix l / 8):
// A operand, rows m0..m0+15, k-columns k0..k0+15 (k0 = 16 * kk): registers a0..a3.
template <int HD>
__device__ __forceinline__ uint32_t addr_a(uint32_t tile, int m0, int kk, int lane) {
  return tile + swz<HD>(m0 + (lane & 15), kk * 2 + (lane >> 4));
}
// B operand stored [n][k] (rows = n), n0..n0+15, k-step kk: {b0, b1} of n-block n0 and of n0+8.
template <int HD>
__device__ __forceinline__ uint32_t addr_b(uint32_t tile, int n0, int kk, int lane) {
  return tile + swz<HD>(n0 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1));
}
// B operand stored [k][n] (rows = k), read with .trans: k-rows k0..k0+15, columns 16 * nn ..:
// {b0, b1} of n-block 16 nn and of 16 nn + 8.
template <int HD>
__device__ __forceinline__ uint32_t addr_bt(uint32_t tile, int k0, int nn, int lane) {
  return tile + swz<HD>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), nn * 2 + (lane >> 4));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A fragment of k-step kk from the C fragments of n-blocks 2kk and 2kk+1 (rounded to bf16).
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// Writes a warp's [16, HD] fp32 accumulator (HD/8 C fragments), times `mul`, as bf16 into rows
// row_base.. of a swizzled tile.
template <int HD>
__device__ __forceinline__ void stage_acc(char* tile, int row_base, const float (&acc)[HD / 8][4],
                                          float mul0, float mul1, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb) {
    const int r0 = row_base + g, r1 = r0 + 8;
    *reinterpret_cast<uint32_t*>(tile + swz<HD>(r0, nb) + t * 4) =
        pack_bf16(acc[nb][0] * mul0, acc[nb][1] * mul0);
    *reinterpret_cast<uint32_t*>(tile + swz<HD>(r1, nb) + t * 4) =
        pack_bf16(acc[nb][2] * mul1, acc[nb][3] * mul1);
  }
}

// Host-side argument check shared by the launchers (a wrong shape is a programming error).
inline void check_shapes(const char* op, int B, int T, int nh, int nkv, int hd) {
  if (hd != 64 && hd != 128)
    fail_library("attention", __FILE__, __LINE__, "hd == 64 || hd == 128", op);
  if (B < 1 || B > 65535 || T < 1 || T > 65535 * 64 || nh < 1 || nh > 65535 || nkv < 1 ||
      nh % nkv != 0)
    fail_library("attention", __FILE__, __LINE__,
                 "1 <= B, nh <= 65535, 1 <= T <= 65535 * 64, nkv >= 1, nh % nkv == 0", op);
}

}  // namespace qt::cuda::attn
