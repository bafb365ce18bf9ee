// Tensor Memory Accelerator (TMA) tile loads, mbarriers and register reallocation for the
// warp-specialised sm_90a kernels: a producer warp loads tiles with cp.async.bulk.tensor and
// signals an mbarrier per buffer ("full"); consumer warpgroups wait on it, compute, and arrive on
// the buffer's "empty" mbarrier, which the producer waits on before it reuses the buffer.
// Included by .cu files only; the device helpers assemble only for sm_90a (callers guard their
// bodies with QT_ATTN_HAS_WGMMA, as for wgmma).
//
// mbarrier phases: a barrier starts in phase 0; wait(parity) returns once the phase of that parity
// has completed. A consumer of buffer use n waits on full with parity n & 1; the producer waits on
// empty with parity (n & 1) ^ 1, which passes at once for the first use of each buffer. A waiter
// must wait for every phase in turn: waiting for phase n + 1 while phase n is still open passes
// at once (the parity matches phase n - 1's), so a consumer that skips a buffer waits anyway.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (the encoder comes through the runtime)
#include <cuda_runtime_api.h>

#include <cstdint>

namespace qt::cuda {

// Host: a tensor map over a contiguous bf16 tensor [B, T, heads, hd] (hd 64 or 128) whose boxes are
// [box_rows rows, 64 columns] of one (b, head): the load of box (col0, head, row0, b) writes one
// 128B-swizzled panel of box_rows lines (attention_wgmma.cuh's tile layout, one panel per 64
// columns); rows >= T read as zero. base must be 16-byte aligned. Defined in
// attention_sm90_backward_ws.cu.
CUtensorMap make_head_tile_map(const void* base, int B, int T, int heads, int hd, int box_rows);

namespace tma {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// After the inits, before the barrier that publishes them: makes them visible to the async proxy.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Adds `bytes` to the transaction count of the current phase (no arrival).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// One box of a 4-d tensor map into shared memory at dst (1024-byte aligned for the 128B swizzle);
// completes `bar`'s transactions by the box's bytes.
__device__ __forceinline__ void load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                        int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Per-thread register budget of the executing warpgroup (all its warps run it).
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// A ring of STAGES buffers, each with a "full" and an "empty" mbarrier (8 bytes each: full of
// buffer i at full0 + 8 i, empty at empty0 + 8 i). Use u = 0, 1, ... of the ring is buffer
// u % STAGES in phase (u / STAGES) & 1; the parity rule above lives here only.
template <int STAGES>
struct BufferRing {
  uint32_t full0, empty0;
  __device__ uint32_t full(int u) const { return full0 + 8 * (u % STAGES); }
  __device__ uint32_t empty(int u) const { return empty0 + 8 * (u % STAGES); }
  // One thread, before fence_mbar_init: arrivals that complete a phase of each barrier.
  __device__ void init(int full_arrivals, int empty_arrivals) const {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(full0 + 8 * i, full_arrivals);
      mbar_init(empty0 + 8 * i, empty_arrivals);
    }
  }
  // Consumer: use u's tiles have landed.
  __device__ void wait_full(int u) const { mbar_wait(full(u), (u / STAGES) & 1); }
  // Producer: use u's buffer is free (the use before it released; a first use passes at once).
  __device__ void wait_empty(int u) const { mbar_wait(empty(u), ((u / STAGES) & 1) ^ 1); }
  // Consumer warp: done with use u's buffer, once every lane's reads of it are (one arrival per
  // warp).
  __device__ void release(int u, int lane) const {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(u));
  }
};

#endif

}  // namespace tma
}  // namespace qt::cuda
