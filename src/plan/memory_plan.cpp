// The memory model of `qtrain plan` (memory_plan.h). Every term names the allocation it mirrors;
// "design" marks a term of issue 16's ZeRO-2/3 or offload, which the CUDA back end does not have
// yet. Arithmetic in 128 bits, checked once at the end, so that absurd deck sizes cannot wrap.
#include "plan/memory_plan.h"

#include <algorithm>
#include <limits>

#include "qtrain/error.h"

namespace qt::plan {

namespace {

using u128 = unsigned __int128;

constexpr u128 kArenaAlignment = 256;                 // DeviceArena::kAlignment
constexpr u128 kGemmWorkspaceBytes = u128{32} << 20;  // src/ops/cuda/gemm.cuh
constexpr u128 kMaxPartials = 1024;                   // src/ops/cuda/common.cuh
constexpr u128 kAdamWSegmentBytes = 24;               // sizeof(AdamWSegment): 2 x u64 + i32, padded
constexpr u128 kLogitsChunkBytes = u128{1} << 30;  // qwen3_cuda.cpp: bf16 logits per lm-head chunk
constexpr u128 kLimit = u128{1} << 63;             // larger totals are refused

u128 cdiv(u128 a, u128 b) { return (a + b - 1) / b; }
// One arena block of `bytes`: DeviceArena::allocate rounds every block up to 256 bytes.
u128 blk(u128 bytes) { return cdiv(bytes, kArenaAlignment) * kArenaAlignment; }

// rmsnorm_backward_workspace_bytes(N, C) (src/ops/cuda/rmsnorm.cu): fp32 dw partials [blocks, C],
// blocks = one wave of the backward grid.
u128 rmsnorm_backward_ws(u128 N, u128 C) {
  const u128 threads = std::max<u128>(cdiv(C / 8, 32) * 32, 32);  // block_threads(C)
  const u128 wave = std::clamp<u128>(65536 / threads, 128, 512);
  const u128 rows_per_block = C > 4096 ? 1 : 4;  // kWideC
  return std::max<u128>(1, std::min(cdiv(N, rows_per_block), wave)) * C * 4;
}

// qk_norm_rope_backward_workspace_bytes(B, T, heads, hd) (src/ops/cuda/qk_norm_rope.cu): fp32
// partials [blocks, hd], at most kMaxPartials blocks of 256 threads.
u128 qk_norm_rope_backward_ws(u128 N, u128 heads, u128 hd) {
  const u128 rows_per_group = heads % 4 == 0 ? 4 : heads % 2 == 0 ? 2 : 1;
  const u128 rows_per_iter = 256 / std::max<u128>(hd / 8, 1) * rows_per_group;
  return std::max<u128>(1, std::min(cdiv(N * heads, rows_per_iter), kMaxPartials)) * hd * 4;
}

// embedding_backward_workspace_bytes(N) (src/ops/cuda/embedding.cu): keys and positions in and
// out ([N] 4-byte each, 256-aligned), then cub's radix-sort storage, which only the GPU can
// size. Estimated: cub's second key and value buffers (4 + 4 bytes a token) and 64 KiB for its
// bins, look-back and counters. At the shapes trained here rmsnorm's workspace is the larger.
u128 embedding_backward_ws(u128 N) { return 4 * blk(4 * N) + blk(8 * N) + (u128{64} << 10); }

// Qwen3Cuda's constructor (src/cuda/qwen3_cuda.cpp) and BatchBuffers (trained_state.cpp), in
// their order. N = B x T rows; widths H, Q = nh x hd, KV = nkv x hd, I, V.
u128 activation_bytes(const ModelConfig& m, u128 B, u128 T, bool recompute) {
  const u128 N = B * T, H = m.hidden_size, Q = m.q_dim(), KV = m.kv_dim();
  const u128 I = m.intermediate_size, V = m.vocab_size, L = m.num_layers;
  const u128 nh = m.num_heads, nkv = m.num_kv_heads, hd = m.head_dim;
  u128 b = 3 * blk(4 * N);         // BatchBuffers: inputs, targets, positions [B, T] int32
  b += 2 * blk(4 * (T * hd / 2));  // cos_, sin_ [T, hd/2] fp32
  b += (L + 1) * (2 * blk(2 * N * H) + blk(4 * N));  // x_[l], ln_[l] [N, H] bf16, rstd_[l] [N] fp32
  const u128 layer =                          // LayerActs, one per layer or one shared (recompute)
      blk(2 * N * (Q + 2 * KV))               // qkv_raw
      + blk(4 * N * nh) + blk(4 * N * nkv)    // q_rstd, k_rstd
      + blk(2 * N * Q) + 2 * blk(2 * N * KV)  // q, k, v
      + blk(2 * N * Q)                        // att
      + blk(4 * B * nh * T)                   // lse [B, nh, T]
      + 2 * blk(2 * N * H) + blk(4 * N)       // x_mid, ln2, rstd2
      + blk(2 * N * 2 * I) + blk(2 * N * I);  // gu [N, 2I], h [N, I]
  b += (recompute ? 1 : L) * layer;
  // The backward's scratch: tmp_, dx_, dtmp_, dln_ [N, H]; dh_ [N, I]; datt_, dq_ [N, Q];
  // dk_, dv_ [N, KV]; dqkv_ [N, Q + 2 KV]; all bf16.
  b += 4 * blk(2 * N * H) + blk(2 * N * I) + 2 * blk(2 * N * Q) + 2 * blk(2 * N * KV) +
       blk(2 * N * (Q + 2 * KV));
  // The lm head: bf16 logits_ [chunk, V] of 1 GiB at most (chunk rows, at most N), fp32 losses_
  // and chunk_lse_ [chunk], the double loss_sum_.
  const u128 chunk = std::clamp<u128>(kLogitsChunkBytes / (V * 2), 1, N);
  b += blk(2 * chunk * V) + 2 * blk(4 * chunk) + blk(8);
  return b;
}

// Qwen3Cuda::ws_ (the largest workspace of the backward's norms and embedding).
u128 op_workspace_bytes(const ModelConfig& m, u128 B, u128 T) {
  const u128 N = B * T;
  return std::max(
      {rmsnorm_backward_ws(N, m.hidden_size), qk_norm_rope_backward_ws(N, m.num_heads, m.head_dim),
       qk_norm_rope_backward_ws(N, m.num_kv_heads, m.head_dim), embedding_backward_ws(N)});
}

std::uint64_t checked(u128 bytes, const char* what) {
  if (bytes >= kLimit) fail_user("the {} would take more than 2^63 bytes: too large to plan", what);
  return static_cast<std::uint64_t>(bytes);
}

void validate(const MemoryPlanInput& in) {
  const MeshShape& s = in.mesh;
  if (s.tp != 1 || s.pp != 1 || s.ep != 1)
    fail_user(
        "the memory plan models data parallelism only: mesh.tp = {}, mesh.pp = {}, "
        "mesh.ep = {} must be 1",
        s.tp, s.pp, s.ep);
  if (s.dp < 1) fail_user("the data-parallel size must be >= 1, got {}", s.dp);
  if (in.zero_stage < 0 || in.zero_stage > 3)
    fail_user("the ZeRO stage must be 0, 1, 2 or 3, got {}", in.zero_stage);
  if (in.micro_batch < 1 || in.seq_len < 1)
    fail_user("micro_batch ({}) and seq_len ({}) must be >= 1", in.micro_batch, in.seq_len);
  const ModelConfig& m = in.model;
  if (std::min({m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads,
                m.num_kv_heads, m.head_dim}) < 1)
    fail_user("every model size must be >= 1");
}

}  // namespace

const char* offload_name(Offload o) { return o == Offload::kCpu ? "cpu" : "none"; }

std::uint64_t ParamUnits::largest() const {
  return std::max({embed, layers > 0 ? layer : 0, last});
}

std::uint64_t ParamUnits::padded(std::uint64_t unit, int dp) {
  return (unit + dp - 1) / dp * static_cast<std::uint64_t>(dp);
}

std::uint64_t ParamUnits::shard(int dp) const {
  return (padded(embed, dp) + layers * padded(layer, dp) + padded(last, dp)) / dp;
}

// The parameter count of ParamLayout(m) (src/model/params.cpp), unit by unit.
ParamUnits param_units(const ModelConfig& m) {
  const u128 H = m.hidden_size, I = m.intermediate_size, V = m.vocab_size, L = m.num_layers;
  const u128 Q = m.q_dim(), KV = m.kv_dim(), hd = m.head_dim;
  // input_layernorm, q/k/v/o_proj, q_norm, k_norm, post_attention_layernorm, gate/up/down_proj
  const u128 layer = H + Q * H + 2 * KV * H + H * Q + 2 * hd + H + 3 * I * H;
  const u128 embed = V * H, last = H + (m.tie_word_embeddings ? 0 : V * H);
  if (embed + L * layer + last >= (u128{1} << 62))
    fail_user("the model has more than 2^62 parameters: too large to plan");
  return {static_cast<std::uint64_t>(embed), static_cast<std::uint64_t>(layer),
          static_cast<std::uint64_t>(last), static_cast<std::uint64_t>(L)};
}

MemoryPlan memory_plan(const MemoryPlanInput& in) {
  validate(in);
  const ModelConfig& m = in.model;
  const int dp = in.mesh.dp;
  const int stage = in.zero_stage;
  const bool offload = in.offload == Offload::kCpu;
  const ParamUnits units = param_units(m);
  const u128 n = units.total();
  const u128 chunk = cdiv(n, dp), padded = chunk * dp;  // TrainedState::chunk_, padded_
  // Design (stages 2, 3): every unit padded to a multiple of dp; the rank owns 1/dp of each.
  const u128 shard = units.shard(dp);
  const u128 unit = ParamUnits::padded(units.largest(), dp);  // the largest unit, gathered
  const bool wire_bf16 = dp > 1 && in.grad_reduce_bf16;
  // One AdamWSegment per tensor of the layout: embedding, 11 per layer, final norm, lm head.
  const u128 tensors = 2 + u128{11} * m.num_layers + (m.tie_word_embeddings ? 0 : 1);

  MemoryPlan p;
  p.built = stage <= 1 && !offload;
  u128 params, grads, optimizer = 0, host, owned;
  if (stage <= 1) {
    params = blk(2 * padded);                     // TrainedState::weights_ [padded] bf16
    grads = blk(4 * padded)                       // TrainedState::grads_ [padded] fp32
            + (wire_bf16 ? blk(2 * padded) : 0);  // CudaBackend::reduce_stage_ [padded] bf16
    // TrainedState::range_: everything, or split_range(numel, dp, 0) with ZeRO-1 (rank 0's range
    // is the largest). Design: offload shards the master with the moments from stage 1 on.
    owned = stage == 1 ? chunk : n;
  } else {
    // Design, ZeRO-2: fp32 gradients of the rank's shard of every unit, plus two whole units of
    // scratch (the unit being reduce-scattered and the next one being written); with a bf16 wire,
    // a bf16 copy of each scratch unit.
    grads = blk(4 * shard) + 2 * blk(4 * unit) + (wire_bf16 ? 2 * blk(2 * unit) : 0);
    // ZeRO-2: the whole bf16 model; ZeRO-3: its shard plus two gathered units (the one in use and
    // the prefetched next; the largest unit is the embedding or the lm head).
    params = stage == 2 ? blk(2 * shard * dp) : blk(2 * shard) + 2 * blk(2 * unit);
    owned = shard;
  }
  u128 workspace =
      blk(kGemmWorkspaceBytes)       // CudaBackend::gemm_ws_ (cuBLASLt)
      + blk((kMaxPartials + 2) * 8)  // TrainedState::norm_ws_ (grad_norm_workspace_bytes)
      + blk(op_workspace_bytes(m, in.micro_batch, in.seq_len));  // Qwen3Cuda::ws_
  if (!offload) {
    // fp32 master weights: TrainedState::master_ [padded] (ZeRO 0 and 1 keep them whole; ZeRO-1
    // all-gathers them after each step); design: the shard from stage 2 on.
    optimizer = (stage <= 1 ? blk(4 * padded) : blk(4 * owned)) +
                2 * blk(4 * owned)                    // AdamW moments m_, v_ [range] fp32
                + blk(kAdamWSegmentBytes * tensors);  // TrainedState::segments_
    // Host: TrainedState::host_params_ [padded] and host_m_, host_v_ [range] (init, checkpoints);
    // design: the shard's master weights and moments only (checkpoints by StatePiece).
    host = stage <= 1 ? 4 * padded + 8 * owned : 12 * owned;
  } else {
    // Design, offload: master weights and moments of the owned elements in pinned host memory,
    // AdamW on the host; the GPU keeps the bf16 weights and fp32 gradients of its stage.
    host = 12 * owned + kOffloadStageBytes;  // + the host side of the staging
    workspace += blk(kOffloadStageBytes);    // GPU side: fp32 master in, gradients out
    p.host_pinned = true;
  }
  p.params = checked(params, "bf16 parameters");
  p.grads = checked(grads, "gradients");
  p.optimizer = checked(optimizer, "optimizer state");
  p.activations =
      checked(activation_bytes(m, in.micro_batch, in.seq_len, in.recompute), "activations");
  p.workspace = checked(workspace, "workspace");
  p.host = checked(host, "host state");
  checked(u128{p.params} + p.grads + p.optimizer + p.activations + p.workspace, "GPU total");
  return p;
}

}  // namespace qt::plan
