// Fused causal flash attention for GQA on the GPU (bf16 in and out, fp32 accumulation and
// statistics). Contract: src/ops/attention.h; algorithm and limits: docs/attention.md.
// Query head j uses kv head j / (nh / nkv); scale 1/sqrt(hd); hd must be 64 or 128; nh a
// multiple of nkv. The [T, T] scores are never stored.
// Packed sequences: pos (device, int32 [B, T], the RoPE position of each token) restricts query t
// of row b to keys t - pos[b, t] .. t (its own document); nullptr is plain causal. A valid row has
// pos[0] = 0 and pos[t] in {pos[t-1] + 1, 0} (not checked here: the kernels skip key tiles by it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// q: [B, T, nh, hd]; k, v: [B, T, nkv, hd]; out: [B, T, nh, hd] (written);
// lse: [B, nh, T] fp32, natural-log log-sum-exp of the scaled scores of each query row (written).
void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B,
                       int Tn, int nh, int nkv, int hd, cudaStream_t stream,
                       const std::int32_t* pos = nullptr);

// dq: [B, T, nh, hd]; dk, dv: [B, T, nkv, hd]; all written (=). Deterministic: the same inputs
// give bitwise the same gradients. dq doubles as scratch for D_i = sum(dout_i * out_i) until the
// last kernel overwrites it, so dq must not alias any input.
void attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                        const bf16* k, const bf16* v, const bf16* out, const float* lse, int B,
                        int Tn, int nh, int nkv, int hd, cudaStream_t stream,
                        const std::int32_t* pos = nullptr);

// Which kernels run: kMma, the mma.sync kernels (any architecture); kWgmma, the sm_90a kernels
// (wgmma; needs a build for sm_90a and a compute capability 9.0 device, else aborts); kAuto,
// kWgmma where available, else kMma (what the engine uses).
enum class AttentionPath { kAuto, kMma, kWgmma };

// True when this build has the sm_90a kernels and the current device can run them (checked once
// per device, then cached; no launch, no synchronisation).
bool attention_wgmma_available();

// Tuning knobs for benchmarks and tests; 0 keeps the default. Warps per block (4 or 8) of the
// forward kernel, the dK/dV kernel and the dQ kernel: on the mma path each warp owns 16 rows of
// its tile, on the wgmma path each warpgroup (4 warps) 64. dkdv_warps, dq_warps = 12 (wgmma path
// only): the warp-specialised kernel (a TMA producer warpgroup and two consumer warpgroups).
struct AttentionConfig {
  int fwd_warps = 0;
  int dkdv_warps = 0;
  int dq_warps = 0;
  AttentionPath path = AttentionPath::kAuto;
};
void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int B,
                       int Tn, int nh, int nkv, int hd, const AttentionConfig& cfg,
                       cudaStream_t stream, const std::int32_t* pos = nullptr);
void attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                        const bf16* k, const bf16* v, const bf16* out, const float* lse, int B,
                        int Tn, int nh, int nkv, int hd, const AttentionConfig& cfg,
                        cudaStream_t stream, const std::int32_t* pos = nullptr);

}  // namespace qt::cuda
