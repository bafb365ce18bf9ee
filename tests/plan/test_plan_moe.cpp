// `qtrain plan` on Qwen3-MoE (src/plan/memory_plan.h, layouts.h, step_time.h): a tiny MoE
// model's parameter bytes at ep 1 and ep 2, its expert units sharded over edp = dp / ep, and its
// activation bytes (LayerActs' router buffers, CudaOps::moe_allocate's buffers) worked out by
// hand from the config, not from the planner's code; the enumeration of ep; the step time's
// all-to-all; Qwen3-30B-A3B on 8 GPUs of 80 GB, and the trainer's host-memory check of it.
#include <gtest/gtest.h>

#include <algorithm>

#include <cstdint>
#include <string>

#include "plan/layouts.h"
#include "plan/memory_plan.h"
#include "plan/step_time.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/model_config.h"
#include "train/host_memory.h"

namespace {

using qt::ModelConfig;
using qt::plan::MemoryPlan;
using qt::plan::MemoryPlanInput;
using u64 = std::uint64_t;

constexpr u64 r(u64 bytes) { return (bytes + 255) / 256 * 256; }  // an arena block

// inputs/tiny-moe.ini's model: V 256, H 64, 3 layers, 4 q / 2 kv heads of 16, tied; layers 0
// and 2 sparse with E = 8 experts of width Im = 32, k = 2 a token; layer 1 dense (I = 128).
ModelConfig tiny_moe() {
  ModelConfig m = *qt::model_preset("tiny");
  m.intermediate_size = 128;
  m.num_layers = 3;
  m.num_experts = 8;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 32;
  m.mlp_only_layers = {1};
  return m;
}

MemoryPlanInput input(int dp, int ep, int stage, bool recompute = false) {
  MemoryPlanInput in;
  in.model = tiny_moe();
  in.micro_batch = 2;
  in.seq_len = 8;
  in.mesh.dp = dp;
  in.mesh.ep = ep;
  in.zero_stage = stage;
  in.recompute = recompute;
  return in;
}

// Elements: attention and norms of a layer 64 + 64x64 (q) + 2 x 32x64 (k, v) + 64x64 (o)
// + 16 + 16 (q/k norm) + 64 = 12448; the dense MLP 3 x 128 x 64 = 24576; a sparse layer's
// router 8 x 64 = 512 and experts 3 x 8 x 32 x 64 = 49152; embedding 256 x 64; final norm 64.
constexpr u64 kAttn = 12448, kDenseMlp = 24576, kRouter = 512, kExperts = 49152;
constexpr u64 kEmbed = 16384, kNorm = 64;
constexpr u64 kSparse = kAttn + kRouter + kExperts, kDense = kAttn + kDenseMlp;
// AdamW segments: the embedding, 11 tensors a layer (sparse: norms, q, k, v, o, q/k norm,
// router, experts' gate_up and down), the final norm.
constexpr u64 kSegments = r(24 * (1 + 3 * 11 + 1));

TEST(PlanMoe, ParameterCount) {
  EXPECT_EQ(kEmbed + 2 * kSparse + kDense + kNorm, 177696u);
  EXPECT_EQ(static_cast<u64>(tiny_moe().num_params()), 177696u);  // the spec's formula agrees
}

// ep 1, dp 2, ZeRO-1: each layer one unit, experts inside; whole bf16 weights and fp32
// gradients; master, m and v of rank 0's half of each unit.
TEST(PlanMoe, Ep1ParameterBytesByHand) {
  const MemoryPlan p = qt::plan::memory_plan(input(2, 1, 1));
  EXPECT_TRUE(p.built);
  EXPECT_EQ(p.params, r(2 * kEmbed) + 2 * r(2 * kSparse) + r(2 * kDense) + r(2 * kNorm));
  EXPECT_EQ(p.grads, r(4 * kEmbed) + 2 * r(4 * kSparse) + r(4 * kDense) + r(4 * kNorm));
  EXPECT_EQ(p.optimizer, 3 * (r(4 * kEmbed / 2) + 2 * r(4 * kSparse / 2) + r(4 * kDense / 2) +
                              r(4 * kNorm / 2)) +
                             kSegments);
  EXPECT_EQ(p.host, 12 * (kEmbed + 2 * kSparse + kDense + kNorm) / 2);
}

// ep 2, dp 2 (edp 1), ZeRO-1: each rank stores 4 of the 8 experts of each sparse layer, a unit
// of their own (3 x 4 x 32 x 64 = 24576 elements) that no other rank shares: not sharded.
TEST(PlanMoe, Ep2ParameterBytesByHand) {
  const u64 layer = kAttn + kRouter, experts = kExperts / 2;
  const MemoryPlan p = qt::plan::memory_plan(input(2, 2, 1));
  EXPECT_TRUE(p.built);  // ep > 1: cuda_ops_moe_ep.cpp
  EXPECT_TRUE(qt::plan::memory_plan(input(2, 2, 3)).built);
  EXPECT_EQ(p.params, r(2 * kEmbed) + 2 * r(2 * layer) + r(2 * kDense) + r(2 * kNorm) +
                          2 * r(2 * experts));
  EXPECT_EQ(p.grads, r(4 * kEmbed) + 2 * r(4 * layer) + r(4 * kDense) + r(4 * kNorm) +
                         2 * r(4 * experts));
  EXPECT_EQ(p.optimizer, 3 * (r(4 * kEmbed / 2) + 2 * r(4 * layer / 2) + r(4 * kDense / 2) +
                              r(4 * kNorm / 2) + 2 * r(4 * experts)) +
                             kSegments);
  EXPECT_EQ(p.host, 12 * ((kEmbed + 2 * layer + kDense + kNorm) / 2 + 2 * experts));
}

// dp 4, ep 2: the expert units shard over edp = 2 (half of the rank's 4 experts each), the rest
// over dp = 4. A rank updates 1 / 4 of everything, as at ep 1 (E / ep / edp = E / dp).
TEST(PlanMoe, ExpertUnitsShardOverEdp) {
  const u64 layer = kAttn + kRouter, experts = kExperts / 2;
  const MemoryPlan p = qt::plan::memory_plan(input(4, 2, 1));
  EXPECT_EQ(p.optimizer, 3 * (r(4 * kEmbed / 4) + 2 * r(4 * layer / 4) + r(4 * kDense / 4) +
                              r(4 * kNorm / 4) + 2 * r(4 * experts / 2)) +
                             kSegments);
  EXPECT_EQ(p.host, 12 * ((kEmbed + 2 * layer + kDense + kNorm) / 4 + 2 * experts / 2));
  EXPECT_EQ(p.host, qt::plan::memory_plan(input(4, 1, 1)).host);
  // ZeRO-2: the gradients are each unit's shard, plus the ring's two pairs of (the largest
  // padded unit after the embedding: the dense layer's 37024; the largest shard: an expert
  // unit's 12288 over edp 2, above the dense layer's 9256 over dp 4), as ShardedCudaState sizes
  // them (max_padded and max_chunk over the units, each with its own group).
  const MemoryPlan z2 = qt::plan::memory_plan(input(4, 2, 2));
  EXPECT_EQ(z2.grads, r(4 * kEmbed / 4) + 2 * r(4 * layer / 4) + r(4 * kDense / 4) +
                          r(4 * kNorm / 4) + 2 * r(4 * experts / 2) +
                          2 * (r(4 * kDense) + r(4 * experts / 2)) +  // grad_ring_
                          r(4 * kEmbed) + r(4 * kEmbed / 4));        // embed_grads_ (tied)
}

// tp 2, dp 1, ZeRO-0: each rank holds its tp share of every tensor, worked out from the
// model: attention 64 (ln1) + 32x64 (q: 2 of 4 heads) + 2 x 16x64 (k, v: 1 of 2 kv heads) +
// 64x32 (o) + 16 + 16 (q/k norm) + 64 (ln2) = 6304; the dense MLP 3 x 64 x 64 = 12288 (I / 2);
// a sparse layer's router whole (8 x 64 = 512) and its experts 3 x 8 x 16 x 64 = 24576 (Im / 2);
// the embedding's half of the vocabulary 128 x 64; the final norm 64. One unit each.
TEST(PlanMoe, Tp2ParameterBytesByHand) {
  const u64 attn = 6304, sparse = attn + kRouter + kExperts / 2, dense = attn + 12288;
  MemoryPlanInput in = input(1, 1, 0);
  in.mesh.tp = 2;
  const MemoryPlan p = qt::plan::memory_plan(in);
  EXPECT_TRUE(p.built);  // cuda_ops_moe.cpp under tp
  EXPECT_EQ(p.params, r(2 * kEmbed / 2) + 2 * r(2 * sparse) + r(2 * dense) + r(2 * kNorm));
  EXPECT_EQ(p.grads, r(4 * kEmbed / 2) + 2 * r(4 * sparse) + r(4 * dense) + r(4 * kNorm));
  EXPECT_EQ(p.host, 12 * (kEmbed / 2 + 2 * sparse + dense + kNorm));
  // Sequence parallelism and tp x ep plan too (tp 2, ep 2 over dp 2: 4 of the 8 experts, each
  // its half of the width, a unit of their own).
  in.sequence_parallel = true;
  EXPECT_TRUE(qt::plan::memory_plan(in).built);
  MemoryPlanInput both = input(2, 2, 1);
  both.mesh.tp = 2;
  const MemoryPlan q = qt::plan::memory_plan(both);
  EXPECT_TRUE(q.built);
  const u64 layer = attn + kRouter, experts = kExperts / 4;
  EXPECT_EQ(q.params, r(2 * kEmbed / 2) + 2 * r(2 * layer) + r(2 * dense) + r(2 * kNorm) +
                          2 * r(2 * experts));
  // pp is built (backend_cuda_pipeline.cpp), at ep 1 and with ep.
  MemoryPlanInput pp = input(1, 1, 0);
  pp.mesh.pp = 2;
  pp.micro_batches = 2;
  EXPECT_TRUE(qt::plan::memory_plan(pp).built);
  MemoryPlanInput pp_ep = input(2, 2, 0);
  pp_ep.mesh.pp = 2;
  pp_ep.micro_batches = 2;
  EXPECT_TRUE(qt::plan::memory_plan(pp_ep).built);
}

// A pipeline stage's MoE buffers a micro-batch in flight: stage 0 of pp 2 holds 2 micro-batches
// under 1F1B with M = 2 and 1 with M = 1; the difference is one slot, by hand: x, ln, rstd of
// its layers' inputs and output, each layer's LayerActs (a sparse layer: the router's output),
// and CudaOps::moe_allocate's per-slot set of each sparse layer (pos, pair, offsets; gu, h, out
// without recompute) and the pipeline's statistics sums [2 E] double. At ep = P 2 (dp 2) the
// experts' rows are the most a rank receives, ex = P N min(k, E / P), and moe_ep_allocate adds
// a slot's exchange maps of each sparse layer (offsets [E / P + 1], to_expert, from_expert [ex]
// int32; the received rows x [ex, H] bf16 without recompute).
TEST(PlanMoe, PipelineCountsEachSlot) {
  const u64 N = 16, H = 64, Q = 64, KV = 32, I = 128, nh = 4, nkv = 2, T = 8;
  const u64 E = 8, k = 2, Im = 32, rows = N * k;
  for (const u64 P : {1, 2})
  for (bool recompute : {false, true}) {
    MemoryPlanInput in = input(static_cast<int>(P), static_cast<int>(P), 0, recompute);
    const u64 ex = P > 1 ? P * N * std::min(k, E / P) : rows;
    in.mesh.pp = 2;
    in.micro_batches = 2;
    const qt::plan::StageParts st = qt::plan::stage_parts(in, 0);
    ASSERT_EQ(st.chunks.size(), 1u);
    ASSERT_EQ(st.chunks[0].slots, 2);
    const u64 layers = static_cast<u64>(st.chunks[0].last - st.chunks[0].first);
    const u64 sparse = static_cast<u64>(in.model.moe_layers_before(st.chunks[0].last) -
                                        in.model.moe_layers_before(st.chunks[0].first));
    ASSERT_GE(sparse, 1u);  // layer 0 is sparse
    const u64 two = qt::plan::memory_plan_stage(in, 0).activations;
    in.micro_batches = 1;
    ASSERT_EQ(qt::plan::stage_parts(in, 0).chunks[0].slots, 1);
    const u64 one = qt::plan::memory_plan_stage(in, 0).activations;
    const u64 common = r(N * (Q + 2 * KV) * 2) + r(N * nh * 4) + r(N * nkv * 4) + r(N * Q * 2) +
                       2 * r(N * KV * 2) + r(N * Q * 2) + r(2 * nh * T * 4) +
                       2 * r(N * H * 2) + r(N * 4);
    const u64 dense = r(N * 2 * I * 2) + r(N * I * 2);
    const u64 router = r(N * E * 4) + r(N * k * 4) + r(N * k * 2);
    const u64 experts = r(ex * 2 * Im * 2) + r(ex * Im * 2) + r(rows * H * 2);
    u64 slot = (layers + 1) * (2 * r(N * H * 2) + r(N * 4)) +
               sparse * (2 * r(rows * 4) + r((E + 1) * 4)) + r(2 * E * 8);
    if (P > 1) slot += sparse * (r((E / P + 1) * 4) + 2 * r(ex * 4));
    if (!recompute)
      slot += layers * common + (layers - sparse) * dense + sparse * (router + experts) +
              (P > 1 ? sparse * r(ex * H * 2) : 0);
    EXPECT_EQ(two - one, slot) << "ep " << P << ", recompute " << recompute;
  }
}

// Activations at B = 2, T = 8 (N = 16 rows, rows = N k = 32 (token, slot) pairs), every buffer
// by hand: BatchBuffers, Qwen3Cuda's stream and LayerActs (dense: gu, h; sparse: the router's
// probs [N, E] fp32, idx [N, k] int32, w [N, k] bf16), the scratch (no dh: layer 1's dense MLP
// needs it: it is there), the lm head, CudaOps::moe_allocate and, at ep = P > 1,
// moe_ep_allocate, whose buffers hold the most rows a rank receives: P N min(k, E / P), or
// `received` when given (a capacity's bound).
u64 tiny_moe_activations(bool recompute, u64 P = 1, u64 received = 0) {
  const u64 N = 16, H = 64, Q = 64, KV = 32, I = 128, V = 256, nh = 4, nkv = 2, hd = 16, T = 8;
  const u64 E = 8, k = 2, Im = 32, rows = N * k, L = 3, sparse = 2, El = E / P;
  const u64 ex = received > 0 ? received : P > 1 ? P * N * std::min(k, El) : rows;
  const u64 batch = 3 * r(N * 4);
  const u64 rope = 2 * r(T * (hd / 2) * 4);
  const u64 stream = (L + 1) * (2 * r(N * H * 2) + r(N * 4));
  const u64 common = r(N * (Q + 2 * KV) * 2) + r(N * nh * 4) + r(N * nkv * 4) + r(N * Q * 2) +
                     2 * r(N * KV * 2) + r(N * Q * 2) + r(2 * nh * T * 4) + 2 * r(N * H * 2) +
                     r(N * 4);
  const u64 dense = r(N * 2 * I * 2) + r(N * I * 2);
  const u64 router = r(N * E * 4) + r(N * k * 4) + r(N * k * 2);
  const u64 layers = recompute ? common + dense + router : 3 * common + dense + sparse * router;
  const u64 scratch = 4 * r(N * H * 2) + r(N * I * 2) + 2 * r(N * Q * 2) + 2 * r(N * KV * 2) +
                      r(N * (Q + 2 * KV) * 2);
  const u64 lm = r(N * V * 2) + 2 * r(N * 4) + r(8);
  // moe_allocate: pos, pair [rows], offsets [E + 1] a sparse layer; gu, h, out a sparse layer
  // (one set with recompute); counts and kept [E] int32, the routing workspace (one block of 256
  // pairs: [1, E] and [rows] int32), logits [N, E], x, dout [rows, H], dh [rows, Im], dgu
  // [rows, 2 Im], dx_gate [N, H], dw [rows] fp32, balance [2 E] double, the router bias
  // [sparse layers, E] fp32, load [sparse layers, E] and dropped [sparse layers] double.
  const u64 kept = recompute ? 1 : sparse;
  const u64 experts = r(ex * 2 * Im * 2) + r(ex * Im * 2) + r(rows * H * 2);
  u64 moe = sparse * (2 * r(rows * 4) + r((E + 1) * 4)) + kept * experts + 2 * r(E * 4) +
            r(r(E * 4) + r(rows * 4)) + r(N * E * 2) + 2 * r(rows * H * 2) + r(ex * Im * 2) +
            r(ex * 2 * Im * 2) + r(N * H * 2) + r(rows * 4) + r(2 * E * 8) + r(sparse * E * 4) +
            r(sparse * E * 8) + r(sparse * 8);
  // moe_ep_allocate: offsets [El + 1], to_expert, from_expert [ex] a sparse layer; x [ex, H]
  // a sparse layer (one with recompute); counts [P, E], segments [2 E] int32; two [ex, H]
  // exchange buffers.
  if (P > 1)
    moe += sparse * (r((El + 1) * 4) + 2 * r(ex * 4)) + kept * r(ex * H * 2) + r(P * E * 4) +
           r(2 * E * 4) + 2 * r(ex * H * 2);
  return batch + rope + stream + layers + scratch + lm + moe;
}

TEST(PlanMoe, ActivationsByHand) {
  EXPECT_EQ(qt::plan::memory_plan(input(1, 1, 0)).activations, tiny_moe_activations(false));
  EXPECT_EQ(qt::plan::memory_plan(input(1, 1, 0, true)).activations, tiny_moe_activations(true));
  // ep 2: the experts' buffers for 2 x 16 x min(2, 4) = 64 rows, and the dispatch's own.
  EXPECT_EQ(qt::plan::memory_plan(input(2, 2, 0)).activations, tiny_moe_activations(false, 2));
  EXPECT_EQ(qt::plan::memory_plan(input(2, 2, 0, true)).activations,
            tiny_moe_activations(true, 2));
}

// model.moe_capacity_factor bounds the rows a rank receives at ep > 1 by E C: at N = 16, k = 2,
// E = 8, factor 1 gives C = ceil(16 x 2 / 8) = 4, so 32 rows instead of 2 x 16 x 2 = 64 (ep 2)
// or 4 x 16 x 2 = 128 (ep 4); factor 1.3 gives C = ceil(5.2) = 6, 48 rows; factor 3 gives C = 12,
// 96 rows, above ep 2's worst case of 64, which stays. At ep 1 nothing changes (the experts'
// buffers hold every pair, N k rows).
TEST(PlanMoe, CapacityFactorBoundsTheReceivedRows) {
  auto with = [](MemoryPlanInput in, double factor) {
    in.model.moe_capacity_factor = factor;
    return qt::plan::memory_plan(in).activations;
  };
  EXPECT_EQ(with(input(2, 2, 0), 1.0), tiny_moe_activations(false, 2, 32));
  EXPECT_EQ(with(input(2, 2, 0, true), 1.0), tiny_moe_activations(true, 2, 32));
  EXPECT_EQ(with(input(4, 4, 0), 1.0), tiny_moe_activations(false, 4, 32));
  EXPECT_EQ(with(input(2, 2, 0), 1.3), tiny_moe_activations(false, 2, 48));
  EXPECT_EQ(with(input(2, 2, 0), 3.0), tiny_moe_activations(false, 2));
  EXPECT_EQ(with(input(1, 1, 0), 1.0), tiny_moe_activations(false));
  EXPECT_LT(with(input(4, 4, 0), 1.0), qt::plan::memory_plan(input(4, 4, 0)).activations);
}

qt::plan::LayoutSearch tiny_search(int gpus) {
  qt::plan::LayoutSearch s;
  s.model = tiny_moe();
  s.micro_batch = 2;
  s.seq_len = 8;
  s.global_batch = 8;
  s.gpus = gpus;
  s.usable = u64{1} << 30;
  return s;
}

// Each mesh with pp = 1 runs every ep dividing dp and E, at every tp (tiny_moe's 2 kv heads
// allow tp 1, 2 and 4: 4 shares each kv head between 2 tp ranks); pp > 1 too, with ep (pp 2 x
// dp 2 x ep 2), and an ep the deck would refuse is left out with the reason.
TEST(PlanMoe, EnumerationIncludesEpAndTp) {
  const qt::plan::Layouts all = qt::plan::enumerate_layouts(tiny_search(4));
  bool seen[5] = {}, seen_tp[5] = {};
  bool tp_ep = false;  // tp 2 x ep 2 (dp 2)
  bool seen_pp = false, seen_pp_ep = false;
  for (const qt::plan::Layout& row : all.rows) {
    const qt::MeshShape& m = row.in.mesh;
    EXPECT_EQ(m.dp * m.tp * m.pp, 4);
    seen_pp |= m.pp == 2;
    seen_pp_ep |= m.pp == 2 && m.ep == 2;
    ASSERT_TRUE(m.ep == 1 || m.ep == 2 || m.ep == 4);
    ASSERT_TRUE(m.tp == 1 || m.tp == 2 || m.tp == 4);
    seen[m.ep] = true;
    seen_tp[m.tp] = true;
    tp_ep |= m.tp == 2 && m.ep == 2;
    EXPECT_EQ(row.memory.built, m.pp == 1 || m.dp == 1 || row.in.zero_stage <= 1);
    EXPECT_EQ(row.time.ep_comm > 0, m.ep > 1);
    EXPECT_EQ(row.time.tp_comm > 0, m.tp > 1);
  }
  EXPECT_TRUE(seen[1] && seen[2] && seen[4]);
  EXPECT_TRUE(seen_tp[1] && seen_tp[2] && seen_tp[4]);
  EXPECT_TRUE(tp_ep);
  EXPECT_TRUE(seen_pp);
  EXPECT_TRUE(seen_pp_ep);
  auto reason = [&](int dp, int tp, int pp, int ep) {
    for (const qt::plan::Excluded& e : all.excluded)
      if (e.dp == dp && e.tp == tp && e.pp == pp && e.ep == ep) return e.why;
    return std::string("(not excluded)");
  };
  EXPECT_EQ(reason(2, 2, 1, 1), "(not excluded)");
  // tp must split every expert's width (6 over tp 4 does not; over tp 2 it does).
  qt::plan::LayoutSearch odd = tiny_search(4);
  odd.model.moe_intermediate_size = 6;
  const qt::plan::Layouts six_wide = qt::plan::enumerate_layouts(odd);
  bool tp4_excluded = false;
  for (const qt::plan::Excluded& e : six_wide.excluded)
    if (e.tp == 4)
      tp4_excluded |= e.why == "mesh.tp = 4 does not divide model.moe_intermediate_size = 6";
  EXPECT_TRUE(tp4_excluded);
  for (const qt::plan::Layout& row : six_wide.rows) EXPECT_NE(row.in.mesh.tp, 4);
  EXPECT_EQ(reason(2, 1, 2, 1), "(not excluded)");
  EXPECT_EQ(reason(2, 1, 2, 2), "(not excluded)");  // ep in a pipeline
  // --ep 3 (does not divide dp 4); 6 experts: ep 4 does not divide them.
  qt::plan::LayoutSearch s = tiny_search(4);
  s.tp = s.pp = {1};
  s.ep = {3};
  const qt::plan::Layouts three = qt::plan::enumerate_layouts(s);
  EXPECT_TRUE(three.rows.empty());
  ASSERT_EQ(three.excluded.size(), 1u);
  EXPECT_EQ(three.excluded[0].ep, 3);
  EXPECT_EQ(three.excluded[0].why, "mesh.ep = 3 does not divide mesh.dp = 4");
  s.ep = {};
  s.model.num_experts = 6;
  const qt::plan::Layouts six = qt::plan::enumerate_layouts(s);
  ASSERT_EQ(six.excluded.size(), 1u);
  EXPECT_EQ(six.excluded[0].ep, 4);
  EXPECT_EQ(six.excluded[0].why, "mesh.ep = 4 does not divide model.num_experts = 6");
  for (const qt::plan::Layout& row : six.rows) EXPECT_NE(row.in.mesh.ep, 4);
  // The planner refuses what the deck refuses.
  EXPECT_THROW(qt::plan::memory_plan(input(4, 3, 0)), qt::UserError);
  MemoryPlanInput dense = input(2, 2, 0);
  dense.model.num_experts = 0;
  EXPECT_THROW(qt::plan::memory_plan(dense), qt::UserError);
}

// The all-to-all term: 4 x N k H x 2 bytes x (ep - 1) / ep a sparse layer over the NVLink bus
// bandwidth (+ a latency each), the only difference in time between ep 2 and ep 4 at ZeRO-0
// beside the dp terms; and the model FLOPs count the active experts only.
TEST(PlanMoe, AllToAllTime) {
  qt::TopologyConfig topo;
  MemoryPlanInput in = input(4, 2, 0);
  in.micro_batches = 1;
  const qt::plan::StepTime t = qt::plan::step_time(in, topo);
  const double bytes = 2.0 * 16 * 2 * 64, one = 0.5 * bytes / (topo.intra_host_gbps * 1e9) +
                                                qt::plan::kRates.latency_intra_s;
  EXPECT_NEAR(t.ep_comm, 2 * 4 * one, 1e-12);  // 2 sparse layers x 4 all-to-alls
  in.mesh.ep = 1;
  EXPECT_EQ(qt::plan::step_time(in, topo).ep_comm, 0.0);
}

// The experts' GEMMs at their own rate: the compute of a micro-batch at ZeRO-0 without recompute
// is 3 passes (forward, input and weight gradients) of the experts' 6 H Im k FLOPs a token over
// expert_gemm_flops plus the rest at the dense rates; halving the expert rate adds exactly the
// experts' time again, and a dense model's compute ignores the rate.
TEST(PlanMoe, ExpertGemmsAtTheirOwnRate) {
  qt::TopologyConfig topo;
  MemoryPlanInput in = input(1, 1, 0);
  in.micro_batches = 1;
  qt::plan::Rates slow = qt::plan::kRates;
  slow.expert_gemm_flops /= 2;
  const double base = qt::plan::step_time(in, topo).compute;
  const double halved = qt::plan::step_time(in, topo, slow).compute;
  const qt::ModelConfig& m = in.model;
  const double tokens = double(in.micro_batch) * in.seq_len;
  const double experts = 3.0 * tokens * m.num_moe_layers() * 6.0 * m.hidden_size *
                         m.moe_intermediate_size * m.num_experts_per_tok /
                         qt::plan::kRates.expert_gemm_flops;
  EXPECT_GT(experts, 0.0);
  EXPECT_NEAR(halved - base, experts, 1e-9 * base);
  MemoryPlanInput dense = in;
  dense.model.num_experts = 0;
  dense.model.mlp_only_layers.clear();
  dense.mesh.ep = 1;
  EXPECT_EQ(qt::plan::step_time(dense, topo, slow).compute,
            qt::plan::step_time(dense, topo).compute);
}

// Qwen3-30B-A3B at seq 4096 on 8 GPUs of 80 GB: every ep of 8 is planned and something fits;
// ZeRO-3 with offload at ep 1 (built today) fits under 40 GiB with recompute.
TEST(PlanMoe, Qwen3_30bA3bOnEightGpus) {
  qt::plan::LayoutSearch s;
  s.model = *qt::model_preset("qwen3-30b-a3b");
  s.micro_batch = 1;
  s.seq_len = 4096;
  s.global_batch = 8;
  s.gpus = 8;
  s.usable = (u64{80} << 30) - qt::plan::kGpuMarginBytes;
  const qt::plan::Layouts all = qt::plan::enumerate_layouts(s);
  bool built_under_40 = false;
  for (const qt::plan::Layout& row : all.rows)
    if (row.memory.built && row.fits && row.memory.device() < (u64{40} << 30)) built_under_40 = true;
  EXPECT_TRUE(built_under_40);
  EXPECT_NE(qt::plan::recommended(all), nullptr);
  EXPECT_NE(qt::plan::recommended(all, /*built_only=*/true), nullptr);
}

// The trainer's host-memory check before a Qwen3-MoE run on cuda takes the planner's host state:
// at dp 8 with ZeRO-3 a rank's fp32 weights and AdamW moments are 12 bytes x 1/8 of Qwen3-30B-A3B's
// 30,532,122,624 parameters (qwen3-spec.md), not the whole model's, which would refuse the run on
// any node of 8 GPUs (2.7 TiB).
TEST(PlanMoe, TrainerHostCheckOfQwen3_30bA3bOnCudaIsTheRanksShard) {
  const qt::Deck deck = qt::parse_deck_text(
      "[model]\npreset = qwen3-30b-a3b\n[train]\ndevice = cuda\nseq_len = 4096\n"
      "micro_batch = 1\nglobal_batch = 8\n[optim]\nzero_stage = 3\n[data]\nsource = synthetic\n",
      "deck.ini", {}, 8);
  const double shard = 12.0 * 30532122624.0 / 8;
  const double bytes = qt::training_host_memory(deck, 8).bytes;
  EXPECT_GE(bytes, shard);
  EXPECT_LT(bytes, 1.05 * shard);
}

}  // namespace
