// The memory model of `qtrain plan` (memory_plan.h). Every term names the allocation it mirrors.
// Arithmetic in 128 bits, checked once at the end, so that absurd deck sizes cannot wrap.
#include "plan/memory_plan.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <utility>

#include "dist/device_communicators.h"
#include "ops/moe_capacity.h"
#include "parallel/expert_parallel.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/error.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

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

// moe_route_workspace_bytes(n_pairs, E) (src/ops/cuda/moe.cu): per-block expert counts
// [ceil(n_pairs / 256), E] and each pair's rank [n_pairs], int32, each 256-aligned.
u128 moe_route_ws(u128 pairs, u128 E) { return blk(cdiv(pairs, 256) * E * 4) + blk(pairs * 4); }

// CudaOps::moe_allocate (src/cuda/cuda_ops_moe.cpp) and, at ep > 1, moe_ep_allocate
// (src/cuda/cuda_ops_moe_ep.cpp), allocation by allocation, for the stage's sparse layers, a
// set of the routing (and without recompute the experts' activations) for each micro-batch a
// chunk holds at once (its slots: CudaOps' moe_slots in a pipeline, 1 at pp = 1);
// rows = N x k (token, slot) pairs. m is the rank's model (the router and the counts span all E
// experts at any ep). At ep = P > 1 the experts' buffers hold the most rows a rank can receive,
// ex_rows = ep_max_received_rows (ops/moe_capacity.h: P N min(k, E / P), or E C with a capacity
// factor when less), as the back end sizes them (the worst case, not the average).
u128 moe_block_bytes(const ModelConfig& m, const StageParts& st, u128 N, bool recompute, int ep) {
  const u128 E = m.num_experts, k = m.num_experts_per_tok, H = m.hidden_size;
  const u128 Im = m.moe_intermediate_size, rows = N * k;
  const u128 P = static_cast<u128>(ep), El = E / P;
  const u128 ex_rows = static_cast<u128>(moe_expert_rows(
      static_cast<long>(N), m.num_experts_per_tok, m.num_experts, ep, m.moe_capacity_factor));
  u128 sets = 0;  // the stage's sparse layers' sets (a slot each)
  for (const StageParts::Chunk& c : st.chunks) {
    const u128 n = m.moe_layers_before(c.last) - m.moe_layers_before(c.first);
    sets += n * static_cast<u128>(c.slots);
  }
  // Per sparse layer and slot: pos, pair [rows] int32; offsets [E + 1] int32.
  u128 b = sets * (2 * blk(4 * rows) + blk(4 * (E + 1)));
  // The experts' activations gu [ex_rows, 2 Im], h [ex_rows, Im], out [rows, H] bf16: per
  // sparse layer and slot, or one shared set with recompute (moe_recompute_).
  const u128 kept = recompute ? 1 : sets;
  b += kept * (blk(2 * ex_rows * 2 * Im) + blk(2 * ex_rows * Im) + blk(2 * rows * H));
  b += 2 * blk(4 * E)               // moe_counts_, moe_kept_ [E] int32
       + blk(moe_route_ws(rows, E))  // moe_route_ws_
       + blk(2 * N * E)              // moe_logits_ [N, E] bf16
       + blk(2 * rows * H)           // moe_x_ [rows, H]
       + blk(2 * rows * H)           // moe_dout_ [rows, H]
       + blk(2 * ex_rows * Im)       // moe_dh_ [ex_rows, Im]
       + blk(2 * ex_rows * 2 * Im)   // moe_dgu_ [ex_rows, 2 Im]
       + blk(2 * N * H)              // moe_dx_gate_ [N, H]
       + blk(4 * rows)               // moe_dw_ [rows] fp32
       + blk(8 * 2 * E)              // moe_own_.sums [2 E] double
       + blk(4 * u128(m.num_moe_layers()) * E)  // router_bias_ [sparse layers of the model, E]
       + blk(8 * u128(m.num_moe_layers()) * E)  // moe_load_ [sparse layers of the model, E]
       + blk(8 * u128(m.num_moe_layers()));     // moe_dropped_ [sparse layers of the model]
  if (ep > 1) {  // moe_ep_allocate
    // Per sparse layer and slot: offsets [El + 1], to_expert, from_expert [ex_rows] int32; the
    // received rows in expert order x [ex_rows, H] bf16 per layer and slot, or one shared with
    // recompute.
    b += sets * (blk(4 * (El + 1)) + 2 * blk(4 * ex_rows)) + kept * blk(2 * ex_rows * H);
    b += blk(4 * P * E)             // moe_ep_counts_ [P, E] int32
         + blk(4 * 2 * E)           // moe_ep_segments_ [2 E] int32
         + 2 * blk(2 * ex_rows * H);  // moe_ep_a_, moe_ep_b_ [ex_rows, H] scratch
  }
  return b;
}

// A stage's activation buffers: Qwen3Cuda's (CudaOps' constructor, src/cuda/cuda_ops.cpp, and
// allocate_stage_acts, src/model/layer_program.h, one call per chunk) and BatchBuffers
// (training_buffers.cpp). m is the tp rank's model. N = B x T rows; widths H, Q = nh x hd,
// KV = nkv x hd, I, V; Ns: the rows of the residual stream and norms (N / tp with sequence
// parallelism, else N).
u128 activation_bytes(const ModelConfig& m, const StageParts& st, u128 B, u128 T, bool recompute,
                      u128 Ns, bool sp, bool zb, int ep) {
  const u128 N = B * T, H = m.hidden_size, Q = m.q_dim(), KV = m.kv_dim();
  const u128 I = m.intermediate_size, V = m.vocab_size, L = m.num_layers;
  const u128 nh = m.num_heads, nkv = m.num_kv_heads, hd = m.head_dim;
  u128 b = 3 * blk(4 * N);         // BatchBuffers: inputs, targets, positions [B, T] int32
  b += 2 * blk(4 * (T * hd / 2));  // cos_, sin_ [T, hd/2] fp32
  const u128 common =                        // LayerActs, one per layer or one shared (recompute)
      blk(2 * N * (Q + 2 * KV))               // qkv_raw
      + blk(4 * N * nh) + blk(4 * N * nkv)    // q_rstd, k_rstd
      + blk(2 * N * Q) + 2 * blk(2 * N * KV)  // q, k, v
      + blk(2 * N * Q)                        // att
      + blk(4 * B * nh * T)                   // lse [B, nh, T]
      + 2 * blk(2 * Ns * H) + blk(4 * Ns);    // x_mid, ln2, rstd2
  const u128 dense_mlp = blk(2 * N * 2 * I) + blk(2 * N * I);  // gu [N, 2I], h [N, I]
  // A sparse layer's router output instead: moe_probs [N, E] fp32, moe_idx [N, k] int32,
  // moe_w [N, k] bf16.
  const u128 E = m.num_experts, K = m.num_experts_per_tok;
  const u128 router = blk(4 * N * E) + blk(4 * N * K) + blk(2 * N * K);
  bool any_dense = false, any_moe = false;  // allocate_stage_acts' rule
  for (const StageParts::Chunk& c : st.chunks)
    for (int l = c.first; l < c.last; ++l) (m.is_moe_layer(l) ? any_moe : any_dense) = true;
  // The backward's scratch: tmp, dx, dtmp, dln [N, H]; dh [N, I] (dense layers only); datt, dq
  // [N, Q]; dk, dv [N, KV]; dqkv [N, Q + 2 KV]; all bf16. Sequence parallelism adds the
  // all-gathered norm output [N, H] that the column-parallel GEMMs read (gathered again in the
  // backward).
  const u128 scratch = 4 * blk(2 * N * H) + (any_dense ? blk(2 * N * I) : 0) +
                       2 * blk(2 * N * Q) + 2 * blk(2 * N * KV) + blk(2 * N * (Q + 2 * KV)) +
                       (sp ? blk(2 * N * H) : 0);
  for (const StageParts::Chunk& c : st.chunks) {
    const u128 k = c.slots, layers = c.last - c.first;
    // Each slot: x, ln [Ns, H] bf16 and rstd [Ns] fp32 of layers first..last (the chunk's input
    // through its output), and without recompute the LayerActs of its layers (dense: gu, h;
    // sparse: the router's output); with recompute one shared set serving both kinds.
    b += k * (layers + 1) * (2 * blk(2 * Ns * H) + blk(4 * Ns));
    if (recompute) {
      b += common + (any_dense ? dense_mlp : 0) + (any_moe ? router : 0);
    } else {
      const u128 sparse = m.moe_layers_before(c.last) - m.moe_layers_before(c.first);
      b += k * (layers * common + (layers - sparse) * dense_mlp + sparse * router);
    }
    b += scratch;
    // ZB-H1: each slot's deferred weight gradients keep copies of the output gradients that
    // live in the scratch: o's and down's [N, H] and q/k/v's [N, Q + 2 KV] a layer.
    if (zb) b += k * blk(2 * layers * N * (Q + 2 * KV + 2 * H));
    if (u128(c.last) == L && k > 1) b += k * blk(2 * N * H);  // dhead: a slot's own d ln[L]
  }
  if (any_moe) b += moe_block_bytes(m, st, N, recompute, ep);
  if (st.head) {
    // The lm head: bf16 logits_ [chunk, V] of 1 GiB at most (chunk rows, at most N), fp32
    // losses_ and chunk_lse_ [chunk], the double loss_sum_.
    const u128 chunk = std::clamp<u128>(kLogitsChunkBytes / (V * 2), 1, N);
    b += blk(2 * chunk * V) + 2 * blk(4 * chunk) + blk(8);
  }
  // A pipeline's messages: d x [Ns, H] bf16 received from the next stage, and sent to the
  // previous one (x arrives in the slot's own x[first]).
  for (const StageParts::Chunk& c : st.chunks) {
    if (u128(c.last) < L) { b += blk(2 * Ns * H); break; }
  }
  for (const StageParts::Chunk& c : st.chunks) {
    if (c.first > 0) { b += blk(2 * Ns * H); break; }
  }
  return b;
}

// CudaOps::ws_ (the largest workspace of the backward's norms and embedding).
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
  const ModelConfig& m = in.model;
  if (std::min({m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads,
                m.num_kv_heads, m.head_dim}) < 1)
    fail_user("every model size must be >= 1");
  if (s.dp < 1) fail_user("the data-parallel size must be >= 1, got {}", s.dp);
  if (s.ep < 1) fail_user("mesh.ep must be >= 1, got {}", s.ep);
  if (s.ep != 1 && !m.is_moe())
    fail_user("mesh.ep = {}: expert parallelism needs a Qwen3-MoE model (model.num_experts > 0)",
              s.ep);
  if (m.is_moe()) {  // the deck's rules (validate_moe)
    if (s.dp % s.ep != 0) fail_user("mesh.ep = {} does not divide mesh.dp = {}", s.ep, s.dp);
    if (m.num_experts % s.ep != 0)
      fail_user("mesh.ep = {} does not divide model.num_experts = {}", s.ep, m.num_experts);
  }
  if (s.tp < 1 || s.pp < 1 || s.pp_chunks < 1)
    fail_user("mesh.tp ({}), mesh.pp ({}) and mesh.pp_chunks ({}) must be >= 1", s.tp, s.pp,
              s.pp_chunks);
  if (const auto miss = tp_split_miss(m, s.tp))
    fail_user("mesh.tp = {} does not divide {} = {} (each tp rank takes an equal share)", s.tp,
              miss->key, miss->n);
  if (s.pp * s.pp_chunks > m.num_layers)
    fail_user("mesh.pp x mesh.pp_chunks = {} x {} chunks is more than model.num_layers = {}",
              s.pp, s.pp_chunks, m.num_layers);
  if (in.micro_batches < 1) fail_user("the micro-batches of a step must be >= 1");
  if (s.pp > 1) {
    if (s.pp_schedule != "1f1b" && s.pp_schedule != "zb-h1")
      fail_user("mesh.pp_schedule = {} must be 1f1b or zb-h1", s.pp_schedule);
    if (s.pp_chunks > 1 && in.micro_batches % s.pp != 0)
      fail_user("mesh.pp_chunks = {} (interleaved 1F1B or ZB-H1) needs micro-batches a step ({}) "
                "a multiple of mesh.pp = {}",
                s.pp_chunks, in.micro_batches, s.pp);
    if (s.pp_schedule == "zb-h1" && (in.recompute || (in.zero_stage >= 2 && s.dp > 1)))
      fail_user("mesh.pp_schedule = zb-h1 needs train.recompute = false, and optim.zero_stage "
                "0 or 1 at mesh.dp > 1");
  }
  if (in.zero_stage < 0 || in.zero_stage > 3)
    fail_user("the ZeRO stage must be 0, 1, 2 or 3, got {}", in.zero_stage);
  if (in.offload == Offload::kCpu && in.zero_stage < 2)
    fail_user("optim.offload = cpu needs optim.zero_stage = 2 or 3 on the CUDA back end, got {}",
              in.zero_stage);
  if (in.grad_reduce_bf16 && in.zero_stage >= 2)
    fail_user("optim.grad_reduce = bf16 needs optim.zero_stage = 0 or 1 (ZeRO-{} reduces in fp32)",
              in.zero_stage);
  if (in.micro_batch < 1 || in.seq_len < 1)
    fail_user("micro_batch ({}) and seq_len ({}) must be >= 1", in.micro_batch, in.seq_len);
}

}  // namespace

const char* offload_name(Offload o) { return o == Offload::kCpu ? "cpu" : "none"; }

std::uint64_t ParamUnits::largest() const {
  return std::max({embed, layers > 0 ? layer : 0, last});
}

std::uint64_t ParamUnits::largest_after_embed() const {
  return std::max(layers > 0 ? layer : 0, last);
}

std::uint64_t ParamUnits::chunk(std::uint64_t unit, int dp) {
  return std::max<std::uint64_t>(1, (unit + dp - 1) / dp);
}

std::uint64_t ParamUnits::padded(std::uint64_t unit, int dp) {
  return chunk(unit, dp) * static_cast<std::uint64_t>(dp);
}

std::uint64_t ParamUnits::shard(int dp) const {
  return chunk(embed, dp) + layers * chunk(layer, dp) + chunk(last, dp);
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

int StageParts::layers() const {
  int n = 0;
  for (const Chunk& c : chunks) n += c.last - c.first;
  return n;
}

int StageParts::max_slots() const {
  int n = 1;
  for (const Chunk& c : chunks) n = std::max(n, c.slots);
  return n;
}

std::vector<StageParts> pipeline_stages(const MemoryPlanInput& in) {
  validate(in);
  const MeshShape& mesh = in.mesh;
  const int P = mesh.pp, L = in.model.num_layers;
  std::vector<StageParts> out(static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s) {
    StageParts& st = out[static_cast<std::size_t>(s)];
    st.embedding = s == 0;
    st.head = s == P - 1;
    st.tied_copy = P > 1 && st.head && in.model.tie_word_embeddings;
  }
  if (P == 1) {
    out[0].chunks.push_back({0, L, 1});
    return out;
  }
  std::vector<int> bounds;
  try {
    bounds = pipeline_layer_bounds(in.model, mesh);
  } catch (const std::invalid_argument& e) {
    fail_user("mesh.pp_layers = {}: {}", mesh.pp_layers, e.what());
  }
  // Each stage's list of a step (parallel/pipeline_schedule.h) says how many micro-batches each
  // chunk holds at once: P - s under 1F1B, more on early stages when interleaved or ZB-H1.
  const PipeSchedule lists = schedule(schedule_config(mesh, in.micro_batches));
  for (int s = 0; s < P; ++s)
    for (int v = 0; v < mesh.pp_chunks; ++v) {
      const int c = v * P + s;
      out[static_cast<std::size_t>(s)].chunks.push_back(
          {bounds[c], bounds[c + 1], activation_slots(lists[static_cast<std::size_t>(s)], c)});
    }
  return out;
}

StageParts stage_parts(const MemoryPlanInput& in, int s) {
  if (s < 0 || s >= std::max(in.mesh.pp, 1))
    fail_user("pipeline stage {} of mesh.pp = {}", s, in.mesh.pp);
  return pipeline_stages(in)[static_cast<std::size_t>(s)];
}

namespace {

// Stage s's bytes; `in` validated, st = its parts.
MemoryPlan stage_plan(const MemoryPlanInput& in, const StageParts& st, int s) {
  const int tp = in.mesh.tp;
  const ModelConfig m = tp_local_config(in.model, tp);  // the tp rank's model
  const int dp = in.mesh.dp;
  const int stage = in.zero_stage;
  const bool offload = in.offload == Offload::kCpu;
  const ParamUnits units = param_units(m);
  const bool holds_embed = st.embedding || st.tied_copy;
  const u128 layers = st.layers();
  // Qwen3-MoE: the real layout of the (tp, ep) rank's model and the stage's units of
  // plan_qwen3 (at ep > 1 each sparse layer's experts, E / ep of them, a
  // unit of their own sharded over edp = dp / ep; at ep = 1 inside their layer's unit; at tp > 1
  // each expert's tp share of the width, the router whole; at pp > 1 the units of stage s and
  // the last stage's copy of a tied embedding).
  const bool moe = m.is_moe();
  std::optional<ShardPlan> moe_plan;
  std::vector<char> moe_held;  // [units] the stage holds the unit (moe)
  u128 moe_tensors = 0, moe_units = 0;
  if (moe) {
    const ModelConfig local = ep_local_config(m, in.mesh.ep);
    const ParamLayout layout(local);
    moe_plan = plan_qwen3(local, layout, in.mesh, in.zero_stage, tp_kv_replicas(in.model, tp));
    for (std::size_t i = 0; i < moe_plan->units.size(); ++i) {
      const ParamUnit& u = moe_plan->units[i];
      const bool held = in.mesh.pp == 1 || u.stage == s || (i == 0 && st.tied_copy);
      moe_held.push_back(held ? 1 : 0);
      if (!held) continue;
      moe_tensors += u.params.size();
      ++moe_units;
    }
  }
  // One AdamWSegment per tensor held: the embedding, 11 per layer, the final norm and lm head.
  const u128 tensors = moe ? moe_tensors
                           : (holds_embed ? 1 : 0) + 11 * layers +
                                 (st.head ? (m.tie_word_embeddings ? 1 : 2) : 0);
  const u128 held_units = moe ? moe_units : (holds_embed ? 1 : 0) + layers + (st.head ? 1 : 0);

  MemoryPlan p;
  // What the CUDA back end runs today: tp (and sequence parallelism) at any dp, pp at dp 1 with
  // whole backwards (src/cuda/backend_cuda_pipeline.cpp).
  // Qwen3-MoE: any tp and ep (src/cuda/cuda_ops_moe.cpp, cuda_ops_moe_ep.cpp); pp > 1 as the
  // dense pipeline, with ep too.
  p.built = in.mesh.pp == 1 || dp == 1 || in.zero_stage <= 1;
  p.stage = s;
  p.slots = st.max_slots();
  u128 params = 0, grads = 0, optimizer = blk(kAdamWSegmentBytes * tensors),  // segments_
      host = 0, pinned = 0;
  {
    // ShardedCudaState (src/cuda/sharded_state_cuda.cpp) over the stage's units of plan_qwen3:
    // per unit, chunk = ceil(unit / dp), padded = chunk x dp, rank 0 owning min(unit, chunk)
    // elements (at ZeRO-0 it updates the whole unit). At dp = 1 there is no NCCL communicator:
    // nothing is gathered or reduced, and every stage allocates the same.
    const bool gathers = stage == 3 && dp > 1;          // ShardedCudaState::gathers()
    const bool scatters = dp > 1;                        // ShardedCudaState::scatters()
    const bool whole_grads = stage <= 1 || dp == 1;      // ShardedCudaState::whole_grads()
    u128 owned = 0, all_padded = 1;
    // gdp: the ranks the unit's ZeRO shards spread over (dp; edp for an expert unit).
    auto add = [&](u128 count, u128 unit, int gdp) {
      const u128 c = ParamUnits::chunk(unit, gdp), padded = c * gdp;
      const u128 own = stage == 0 ? unit : std::min(unit, c);
      params += count * blk(2 * (gathers ? c : padded));  // Unit::weights bf16
      // Unit::master [unit at ZeRO-0, else chunk], m, v [own] fp32 (on the host with offload)
      if (!offload) optimizer += count * (blk(4 * (stage == 0 ? unit : c)) + 2 * blk(4 * own));
      grads += count * blk(4 * (whole_grads ? padded : c));  // Unit::grad
      owned += count * own;
      if (count > 0) all_padded = std::max(all_padded, padded);
    };
    u128 max_chunk = 0, max_padded = 0, embed_chunk = 0, embed_padded = 0;
    if (moe) {
      // Every unit of plan_qwen3 the stage holds with its own group; the slots:
      // ShardedCudaState's max_chunk and max_padded over the units after the embedding, which
      // has its own.
      const std::vector<ParamUnit>& us = moe_plan->units;
      for (std::size_t i = 0; i < us.size(); ++i)
        if (moe_held[i]) add(1, us[i].range.size(), us[i].dp);
      max_chunk = max_padded = 1;
      for (std::size_t i = 1; i < us.size(); ++i) {
        if (!moe_held[i]) continue;
        max_chunk = std::max<u128>(max_chunk, us[i].chunk);
        max_padded = std::max<u128>(max_padded, us[i].padded());
      }
      embed_chunk = us[0].chunk;
      embed_padded = us[0].padded();
    } else {
      if (holds_embed) add(1, units.embed, dp);
      add(layers, units.layer, dp);
      if (st.head) add(1, units.last, dp);
      // The slots: max_chunk and max_padded over the units after the embedding, which has its
      // own.
      const u128 rest = std::max<u128>(layers > 0 ? units.layer : 0, st.head ? units.last : 0);
      max_chunk = ParamUnits::chunk(rest, dp), max_padded = max_chunk * dp;
      embed_chunk = ParamUnits::chunk(units.embed, dp), embed_padded = embed_chunk * dp;
    }
    if (gathers) {  // weight_ring_: 3 gathered units (4 with expert units); embed_weights_ (a
                    // tied embedding stays)
      const bool expert_units = moe && in.mesh.ep > 1 && dp > 1;
      params += (expert_units ? 4 : 3) * blk(2 * max_padded);
      if (holds_embed) params += blk(2 * embed_padded);
    }
    // ZeRO-0/1 with optim.grad_reduce = bf16: reduce_stage_, bf16 [the largest padded unit].
    if (scatters && stage <= 1 && in.grad_reduce_bf16) grads += blk(2 * all_padded);
    if (scatters && stage >= 2) {  // grad_ring_: 2 x (a whole unit, its reduce-scatter output)
      grads += 2 * (blk(4 * max_padded) + blk(4 * max_chunk));
      // An untied embedding's gradient as rows (EmbeddingRows) when all dp ranks' tokens are
      // fewer elements than the table: the gathered ids, rows of dx (bf16) and the sort's
      // workspace; else embed_grads_, the whole table and its reduce-scatter output.
      const u128 gathered = u128(dp) * in.micro_batch * in.seq_len;
      if (holds_embed) {
        if (!m.tie_word_embeddings && gathered * m.hidden_size < units.embed)
          grads += blk(4 * gathered) + blk(2 * gathered * m.hidden_size) +
                   blk(embedding_backward_ws(gathered));
        else
          grads += blk(4 * embed_padded) + blk(4 * embed_chunk);
      }
    }
    host = 12 * owned;  // Unit::host_master, host_m, host_v [own]: with offload the live state
    // Offload: stage_grads_ and stage_weights_, two of each, [max chunk] fp32 and bf16 pinned.
    if (offload) pinned = 2 * (4 + 2) * std::max(max_chunk, holds_embed ? embed_chunk : 0);
  }
  // gemm_ws_ (cuBLASLt), norm_ws_ (grad_norm_workspace_bytes), CudaOps::ws_.
  u128 workspace = blk(kGemmWorkspaceBytes) + blk((kMaxPartials + 2) * 8) +
                   blk(op_workspace_bytes(m, in.micro_batch, in.seq_len));
  // ShardedCudaState: the norm's workspace on the NCCL stream, and each unit's sum of squares.
  workspace += blk((kMaxPartials + 2) * 8) + blk(8 * held_units);
  const bool sp = in.sequence_parallel && tp > 1;
  const u128 N = u128(in.micro_batch) * in.seq_len, Ns = sp ? cdiv(N, tp) : N;
  p.params = checked(params, "bf16 parameters");
  p.grads = checked(grads, "gradients");
  p.optimizer = checked(optimizer, "optimizer state");
  p.activations = checked(
      activation_bytes(m, st, in.micro_batch, in.seq_len, in.recompute, Ns, sp,
                       in.mesh.pp > 1 && in.mesh.pp_schedule == "zb-h1", in.mesh.ep),
      "activations");
  if (moe && in.mesh.pp > 1) {
    // The CUDA pipeline's MoE statistics (backend_cuda_pipeline.cpp): each chunk slot's sums
    // [2 E] double, and on the last stage each micro-batch's whole sums [M, 2 E].
    const u128 E = m.num_experts;
    u128 stats = 0;
    for (const StageParts::Chunk& c : st.chunks) stats += static_cast<u128>(c.slots) * blk(16 * E);
    if (st.head) stats += blk(16 * E * static_cast<u128>(in.micro_batches));
    p.activations = checked(u128{p.activations} + stats, "activations");
  }
  p.workspace = checked(workspace, "workspace");
  p.host = checked(host, "host state");
  p.host_pinned = checked(pinned, "pinned host staging");
  p.nccl = nccl_bytes(in.mesh, in.model.is_moe());
  checked(u128{p.params} + p.grads + p.optimizer + p.activations + p.workspace + p.nccl,
          "GPU total");
  return p;
}

}  // namespace

int device_communicator_count(const MeshShape& mesh, bool moe) {
  return static_cast<int>(qt::device_communicators(mesh, moe).size());
}

MemoryPlan memory_plan_stage(const MemoryPlanInput& in, int s) {
  return stage_plan(in, stage_parts(in, s), s);
}

MemoryPlan memory_plan(const MemoryPlanInput& in) {
  const std::vector<StageParts> stages = pipeline_stages(in);
  MemoryPlan best = stage_plan(in, stages[0], 0);
  for (int s = 1; s < in.mesh.pp; ++s) {
    const MemoryPlan p = stage_plan(in, stages[static_cast<std::size_t>(s)], s);
    if (p.gpu() > best.gpu()) best = p;
  }
  return best;
}

std::vector<Setting> settings_by_preference(const MemoryPlanInput& in) {
  std::vector<Setting> out;
  for (Offload off : {Offload::kNone, Offload::kCpu})
    for (int stage = 0; stage <= 3; ++stage) {
      if (off == Offload::kCpu && stage < 2) continue;
      MemoryPlanInput x = in;
      x.zero_stage = stage;
      x.offload = off;
      x.grad_reduce_bf16 = in.grad_reduce_bf16 && stage <= 1;
      out.push_back({stage, off, memory_plan(x)});
    }
  return out;
}

std::optional<Setting> cheapest_fitting(const MemoryPlanInput& in, std::uint64_t usable) {
  for (const Setting& s : settings_by_preference(in))
    if (s.plan.gpu() <= usable) return s;
  return std::nullopt;
}

}  // namespace qt::plan
