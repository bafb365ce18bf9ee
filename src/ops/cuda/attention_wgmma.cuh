// Device helpers of the sm_90a attention kernels (attention_sm90_forward.cu,
// attention_sm90_backward.cu): 128-byte-swizzled shared-memory tiles, wgmma matrix descriptors and
// the wgmma instructions they use. Included by .cu files only; the wgmma wrappers assemble only
// for sm_90a (callers guard their bodies with QT_ATTN_HAS_WGMMA).
//
// Tile layout (what wgmma calls the 128B-swizzle canonical layout): a [R rows, HD] bf16 tile is
// stored as HD / 64 panels of [R][64], one 128-byte line per row, the panels one after the other
// (panel stride R * 128 bytes). The 16-byte chunk c of a line sits at chunk c ^ (row % 8). Tiles
// start 1024-byte aligned (the swizzle acts on address bits 4-9).
//   K-major operand (K = the head dimension runs along the line: Q, K, V, dO as the A or B of
//   S = Q K^T and friends): k-step kk (16 columns) starts at panel kk / 4, byte 32 (kk % 4) of the
//   line; SBO = 1024 (8-row groups), LBO unused.
//   MN-major operand (K = the row index: V in P V, dO in P^T dO, Q in dS^T Q, K in dS K): k-step kk
//   (16 rows) starts at row 16 kk, i.e. byte 2048 kk; LBO = the panel stride (the next 64 columns
//   of N), SBO = 1024 (the next 8 rows of K); the instruction's transpose bit is set.
//
// wgmma m64nNk16 register layouts (warp w of the warpgroup owns rows 16w..16w+15; g = lane / 4,
// t = lane % 4), identical to mma.m16n8k16 per 8-column block nb:
//   accumulator d[4 nb + e]: row g + 8 (e / 2), column 8 nb + 2 t + (e % 2);
//   A fragment of k-step kk: {pack(d[8kk], d[8kk+1]), pack(d[8kk+2], d[8kk+3]),
//                             pack(d[8kk+4], d[8kk+5]), pack(d[8kk+6], d[8kk+7])}
//   of a [64, 16 * steps] accumulator: an accumulator becomes the next product's A in registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/attention_mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QT_ATTN_HAS_WGMMA 1
#else
#define QT_ATTN_HAS_WGMMA 0
#endif

namespace qt::cuda {

// Host launchers of the sm_90a path (attention_sm90_forward.cu, attention_sm90_backward.cu); the
// public entry points in attention_forward.cu / attention_backward.cu dispatch to them.
// warps (4 or 8, 0 for the default) picks 1 or 2 warpgroups per block of each kernel; pos is the
// device [B, T] positions of packed documents or nullptr (plain causal).
void attention_forward_sm90(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                            const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                            int warps, cudaStream_t stream);
void attention_backward_sm90(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                             const bf16* k, const bf16* v, const bf16* out, const float* lse,
                             const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                             int dkdv_warps, int dq_warps, cudaStream_t stream);

// The dK/dV and dQ kernels of attention_backward_sm90, warp-specialised
// (attention_sm90_backward_ws.cu): a TMA producer warp and two consumer warpgroups per 128 rows;
// same results as the kernels they replace (D already in dq / dq_delta). q, dout, k, v 16-byte
// aligned.
void attention_dkdv_ws_sm90(bf16* dk, bf16* dv, const bf16* dq_delta, const bf16* dout,
                            const bf16* q, const bf16* k, const bf16* v, const float* lse,
                            const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                            cudaStream_t stream);
// The forward, warp-specialised (attention_sm90_forward_ws.cu), as attention_forward_sm90.
void attention_forward_ws_sm90(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                               const std::int32_t* pos, int B, int T, int nh, int nkv, int hd,
                               cudaStream_t stream);
void attention_dq_ws_sm90(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                          const float* lse, const std::int32_t* pos, int B, int T, int nh, int nkv,
                          int hd, cudaStream_t stream);

// Whether cfg selects the sm_90a path (kAuto: when available; kWgmma when unavailable aborts).
bool attention_use_wgmma(const AttentionConfig& cfg);

namespace attn {

// Byte offset of 16-byte chunk c (0 .. HD/8-1) of row r in a swizzled tile of R rows.
template <int R>
__device__ __forceinline__ uint32_t sw128(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Rows [row0, row0 + ROWS) of a [T, ld] bf16 matrix (HD used columns) into a swizzled tile with
// cp.async; rows >= T are zero-filled. All NT threads take part; consecutive threads take
// consecutive 16-byte chunks of a row (coalesced global reads).
template <int ROWS, int HD, int NT>
__device__ __forceinline__ void load_tile_sw128(uint32_t tile, const bf16* g, int row0,
                                                long long ld, int T, int tid) {
  constexpr int kChunks = HD / 8;
  static_assert((ROWS * kChunks) % NT == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / NT; ++it) {
    const int idx = tid + it * NT;
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row0 + r;
    const bool ok = row < T;
    const bf16* src = ok ? g + row * ld + c * 8 : g;
    cp_async_16(tile + sw128<ROWS>(r, c), src, ok);
  }
}

// Rows [0, 16) of a warp's staged rows (rows row_base .. of a swizzled tile of R rows, holding
// global rows grow0 ..) -> global, 16 bytes per lane and access; rows >= T are skipped.
template <int R, int HD>
__device__ __forceinline__ void store_warp_rows_sw128(bf16* g, long long ld, int grow0, int T,
                                                      const char* tile, int row_base, int lane) {
  constexpr int kChunks = HD / 8;
#pragma unroll
  for (int it = 0; it < 16 * kChunks / 32; ++it) {
    const int idx = lane + it * 32;
    const int r = idx / kChunks, c = idx % kChunks;
    if (grow0 + r < T) {
      const uint4 val = *reinterpret_cast<const uint4*>(tile + sw128<R>(row_base + r, c));
      *reinterpret_cast<uint4*>(g + (grow0 + r) * ld + c * 8) = val;
    }
  }
}

// A warp's rows of a [64, HD] fp32 accumulator (HD / 8 column blocks), times mul, as bf16 into
// rows row_base + 16 warp .. of a swizzled tile of R rows.
template <int R, int HD>
__device__ __forceinline__ void stage_acc_sw128(char* tile, int row_base,
                                                const float (&acc)[HD / 2], float mul0, float mul1,
                                                int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb) {
    const int r0 = row_base + g, r1 = r0 + 8;
    *reinterpret_cast<uint32_t*>(tile + sw128<R>(r0, nb) + t * 4) =
        pack_bf16(acc[4 * nb] * mul0, acc[4 * nb + 1] * mul0);
    *reinterpret_cast<uint32_t*>(tile + sw128<R>(r1, nb) + t * 4) =
        pack_bf16(acc[4 * nb + 2] * mul1, acc[4 * nb + 3] * mul1);
  }
}

// Shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
// K-major operand: rows row0.. of a swizzled tile of R rows, k-step kk (16 columns).
template <int R>
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t tile, int row0, int kk) {
  return wgmma_desc(tile + (kk >> 2) * (R * 128) + row0 * 128 + (kk & 3) * 32, 16, 1024);
}
// MN-major operand: k-step kk = rows 16 kk .. 16 kk + 15 of a swizzled tile of R rows, all columns.
template <int R>
__device__ __forceinline__ uint64_t desc_mnmajor(uint32_t tile, int kk) {
  return wgmma_desc(tile + kk * 2048, R * 128, 1024);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins the accumulators at this point of the program: no read is hoisted above a wgmma wait and no
// write sunk below a wgmma issue by the compiler.
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_frag(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}
// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to the async proxy (wgmma);
// each writing thread runs it before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// threadIdx.x / 128, broadcast from lane 0 so that the compiler knows it is the same in every lane
// of the warp: shared-memory addresses and wgmma descriptors derived from it can then live in
// uniform registers, instead of being formed per thread and moved there before every wgmma.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
}
// Barrier of the 128 threads of warpgroup wg (ids 1, 2, ...; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory");
}

#if QT_ATTN_HAS_WGMMA

// d += A B, A from registers (bf16 pairs), B from shared memory MN-major (transpose bit set), its
// descriptor db + OB formed inside the instruction's block.
template <uint32_t OB = 0>
__device__ __forceinline__ void wgmma_rs_m64n64_tb(float (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %37, 0;\nadd.s64 db, %36, %38;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, db, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1), "n"(OB));
}

// d += A B, A from registers (bf16 pairs), B from shared memory MN-major (transpose bit set), its
// descriptor db + OB formed inside the instruction's block.
template <uint32_t OB = 0>
__device__ __forceinline__ void wgmma_rs_m64n128_tb(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %69, 0;\nadd.s64 db, %68, %70;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, db, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1), "n"(OB));
}

// d (+)= A B, A and B from shared memory, both K-major, their descriptors da + OA and db + OB
// formed inside the instruction's block (only the two base descriptors stay live across a run of
// k-steps); accumulate = 0 overwrites d.
template <uint32_t OA, uint32_t OB>
__device__ __forceinline__ void wgmma_ss_m64n64_off(float (&d)[32], uint64_t da, uint64_t db,
                                                    int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %34, 0;\n"
      "add.s64 da, %32, %35;\nadd.s64 db, %33, %36;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate), "n"(OA), "n"(OB));
}

// As wgmma_ss_m64n64_off, N = 128.
template <uint32_t OA, uint32_t OB>
__device__ __forceinline__ void wgmma_ss_m64n128_off(float (&d)[64], uint64_t da, uint64_t db,
                                                     int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %66, 0;\n"
      "add.s64 da, %64, %67;\nadd.s64 db, %65, %68;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(da), "l"(db), "r"(accumulate), "n"(OA), "n"(OB));
}

// d (+)= A B over the KT k-steps of two K-major tiles: A = rows row_a .. row_a + 63 of a tile of
// RA rows at tile_a, B = the N rows of a tile of RB rows at tile_b (d is overwritten at k-step 0).
template <int N, int RA, int RB, int KT>
__device__ __forceinline__ void wgmma_ss_kmajor(float (&d)[N / 2], uint32_t tile_a, int row_a,
                                                uint32_t tile_b) {
  static_assert(N == 64 || N == 128, "wgmma_ss_kmajor: N is 64 or 128");
  const uint64_t da = desc_kmajor<RA>(tile_a, row_a, 0), db = desc_kmajor<RB>(tile_b, 0, 0);
  // Descriptor offset of k-step kk in 16-byte units (see desc_kmajor).
  constexpr auto off = [](int rows, int kk) {
    return static_cast<uint32_t>(((kk >> 2) * rows * 128 + (kk & 3) * 32) >> 4);
  };
  [&]<int... KK>(std::integer_sequence<int, KK...>) {
    if constexpr (N == 64)
      (wgmma_ss_m64n64_off<off(RA, KK), off(RB, KK)>(d, da, db, KK > 0), ...);
    else
      (wgmma_ss_m64n128_off<off(RA, KK), off(RB, KK)>(d, da, db, KK > 0), ...);
  }
  (std::make_integer_sequence<int, KT>{});
}

// d += A B over the KS k-steps of A's register fragments a[kk] and an MN-major tile of R rows at
// tile_b (k-step kk = its rows 16 kk .. 16 kk + 15): one base descriptor, constant offsets.
template <int N, int R, int KS>
__device__ __forceinline__ void wgmma_rs_mnmajor(float (&d)[N / 2], const uint32_t (&a)[KS][4],
                                                 uint32_t tile_b) {
  static_assert(N == 64 || N == 128, "wgmma_rs_mnmajor: N is 64 or 128");
  const uint64_t db = desc_mnmajor<R>(tile_b, 0);
  [&]<int... KK>(std::integer_sequence<int, KK...>) {
    if constexpr (N == 64)
      (wgmma_rs_m64n64_tb<KK * 2048 / 16>(d, a[KK], db), ...);
    else
      (wgmma_rs_m64n128_tb<KK * 2048 / 16>(d, a[KK], db), ...);
  }
  (std::make_integer_sequence<int, KS>{});
}

#endif  // QT_ATTN_HAS_WGMMA

// A fragments of all k-steps of a [64, 16 S] fp32 accumulator, rounded to bf16.
template <int S>
__device__ __forceinline__ void acc_to_frags(uint32_t (&a)[S][4], const float (&d)[8 * S]) {
#pragma unroll
  for (int kk = 0; kk < S; ++kk) {
    a[kk][0] = pack_bf16(d[8 * kk], d[8 * kk + 1]);
    a[kk][1] = pack_bf16(d[8 * kk + 2], d[8 * kk + 3]);
    a[kk][2] = pack_bf16(d[8 * kk + 4], d[8 * kk + 5]);
    a[kk][3] = pack_bf16(d[8 * kk + 6], d[8 * kk + 7]);
  }
}

}  // namespace attn
}  // namespace qt::cuda
