// The planner beyond dp (src/plan/memory_plan.h, layouts.h, step_time.h): a tiny model's bytes
// under tensor, sequence and pipeline parallelism worked out by hand; the enumeration of meshes
// (every row divides the GPUs, the excluded ones say why); the recommendation; monotonicity in
// tp and pp; the time model against measured one-GPU rates and the schedule's bubble.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "parallel/tensor_parallel.h"
#include "plan/layouts.h"
#include "plan/memory_plan.h"
#include "plan/step_time.h"
#include "qtrain/error.h"
#include "qtrain/model_config.h"
#include "qtrain/shard_plan.h"

namespace {

using qt::ModelConfig;
using qt::plan::MemoryPlan;
using qt::plan::MemoryPlanInput;
using qt::plan::Offload;
using u64 = std::uint64_t;

constexpr u64 r(u64 bytes) { return (bytes + 255) / 256 * 256; }  // an arena block

ModelConfig preset(const char* name) { return *qt::model_preset(name); }

// tiny: V 256, H 64, I 192, 2 layers, 4 q / 2 kv heads of 16, tied; B = 2, T = 8 (N = 16).
MemoryPlanInput tiny_input(int dp, int tp, int pp, int micro_batches = 4) {
  MemoryPlanInput in;
  in.model = preset("tiny");
  in.micro_batch = 2;
  in.seq_len = 8;
  in.mesh.dp = dp;
  in.mesh.tp = tp;
  in.mesh.pp = pp;
  in.micro_batches = micro_batches;
  return in;
}

// tp 2: each rank's model has 2 q heads, 1 kv head (Q 32, KV 16), MLP width 96, vocabulary 128.
// A layer: ln1 64 + wq 32x64 + wk, wv 16x64 + wo 64x32 + q/k norm 16 + 16 + ln2 64 + 3 x 96x64.
TEST(PlanTensorParallel, TinyUnitsByHand) {
  const qt::plan::ParamUnits u = qt::plan::param_units(qt::tp_local_config(preset("tiny"), 2));
  EXPECT_EQ(u.embed, 128u * 64u);
  EXPECT_EQ(u.layer, 64u + 2048u + 1024u + 1024u + 2048u + 16u + 16u + 64u + 18432u);
  EXPECT_EQ(u.layer, 24736u);
  EXPECT_EQ(u.last, 64u);  // the final norm, whole on every tp rank
}

// dp 1, tp 2, ZeRO-0: every unit whole (bf16 weights, fp32 gradients, master, m, v), and the
// activations of the local model, buffer by buffer.
TEST(PlanTensorParallel, TinyBytesByHand) {
  const MemoryPlan p = memory_plan(tiny_input(1, 2, 1));
  EXPECT_TRUE(p.built);  // the CUDA back end runs tp (without sequence parallelism)
  EXPECT_EQ(p.params, r(8192 * 2) + 2 * r(24736 * 2) + r(64 * 2));
  EXPECT_EQ(p.params, 115968u);
  const u64 f32 = r(8192 * 4) + 2 * r(24736 * 4) + r(64 * 4);
  EXPECT_EQ(p.grads, f32);
  EXPECT_EQ(p.optimizer, 3 * f32 + r(24 * 24));  // 24 tensors' AdamW segments
  EXPECT_EQ(p.host, 12u * (8192 + 2 * 24736 + 64));
  // N 16, H 64 (not split), Q 32, KV 16, I 96, V 128, 2 q / 1 kv heads of 16.
  const u64 batch = 3 * r(16 * 4), rope = 2 * r(8 * 8 * 4);
  const u64 stream = 3 * (2 * r(16 * 64 * 2) + r(16 * 4));  // x, ln, rstd of l = 0..2
  const u64 layer = r(16 * 64 * 2)                          // qkv_raw [N, Q + 2 KV]
                    + r(16 * 2 * 4) + r(16 * 1 * 4)         // q/k rstd
                    + r(16 * 32 * 2) + 2 * r(16 * 16 * 2)   // q, k, v
                    + r(16 * 32 * 2) + r(2 * 2 * 8 * 4)     // att, lse
                    + 2 * r(16 * 64 * 2) + r(16 * 4)        // x_mid, ln2, rstd2
                    + r(16 * 192 * 2) + r(16 * 96 * 2);     // gu, h
  EXPECT_EQ(layer, 19456u);
  const u64 scratch =
      4 * r(16 * 64 * 2) + r(16 * 96 * 2) + 2 * r(16 * 32 * 2) + 2 * r(16 * 16 * 2) + r(16 * 64 * 2);
  EXPECT_EQ(scratch, 16384u);
  const u64 head = r(16 * 128 * 2) + 2 * r(16 * 4) + r(8);  // the local vocabulary's logits
  EXPECT_EQ(p.activations, batch + rope + stream + 2 * layer + scratch + head);
  EXPECT_EQ(p.activations, 74496u);
}

// Sequence parallelism: the residual stream and norms ([N, H] and [N]) hold N / tp = 8 rows; the
// scratch gains the all-gathered norm output [N, H].
TEST(PlanTensorParallel, SequenceParallelSplitsTheResidualStream) {
  MemoryPlanInput in = tiny_input(1, 2, 1);
  in.sequence_parallel = true;
  EXPECT_TRUE(memory_plan(in).built);  // sequence parallelism runs on CUDA
  const MemoryPlan p = memory_plan(in);
  const u64 stream = 3 * (2 * r(8 * 64 * 2) + r(8 * 4));
  const u64 layer = 19456 - 2 * r(16 * 64 * 2) + 2 * r(8 * 64 * 2);  // x_mid, ln2 of 8 rows
  const u64 scratch = 16384 + r(16 * 64 * 2);
  EXPECT_EQ(p.activations, 768 + 512 + stream + 2 * layer + scratch + 4864);
  EXPECT_EQ(p.activations, 66304u);
  EXPECT_LT(p.activations, memory_plan(tiny_input(1, 2, 1)).activations);
  in.mesh.tp = 1;  // nothing to split at tp 1
  EXPECT_EQ(memory_plan(in).activations, memory_plan(tiny_input(1, 1, 1)).activations);
}

// pp 2 of the 2-layer model, 4 micro-batches, 1F1B: stage 0 runs layer 0 with the embedding and
// holds 2 micro-batches (P - s), stage 1 layer 1 with the head and the tied embedding's copy, 1.
TEST(PlanPipeline, TinyStagesByHand) {
  const MemoryPlanInput in = tiny_input(1, 1, 2);
  const qt::plan::StageParts s0 = qt::plan::stage_parts(in, 0), s1 = qt::plan::stage_parts(in, 1);
  ASSERT_EQ(s0.chunks.size(), 1u);
  EXPECT_EQ(s0.chunks[0].first, 0);
  EXPECT_EQ(s0.chunks[0].last, 1);
  EXPECT_EQ(s0.chunks[0].slots, 2);
  EXPECT_TRUE(s0.embedding && !s0.head && !s0.tied_copy);
  EXPECT_EQ(s1.chunks[0].first, 1);
  EXPECT_EQ(s1.chunks[0].slots, 1);
  EXPECT_TRUE(!s1.embedding && s1.head && s1.tied_copy);

  const u64 stream = 2 * r(16 * 64 * 2) + r(16 * 4);  // x, ln, rstd of one layer boundary
  const u64 layer = 33792, scratch = 4 * 2048 + 6144 + 2 * 2048 + 2 * 1024 + 4096;
  const MemoryPlan p0 = qt::plan::memory_plan_stage(in, 0);
  EXPECT_EQ(p0.params, r(16384 * 2) + r(49312 * 2));  // the embedding and layer 0
  EXPECT_EQ(p0.grads, r(16384 * 4) + r(49312 * 4));
  EXPECT_EQ(p0.optimizer, 3 * (r(16384 * 4) + r(49312 * 4)) + r(12 * 24));
  // 2 slots of x, ln, rstd of layers 0..1 and of layer 0's activations; the scratch; d x from
  // stage 1. No lm head.
  EXPECT_EQ(p0.activations, 768 + 512 + 2 * 2 * stream + 2 * layer + scratch + r(16 * 64 * 2));
  EXPECT_EQ(p0.activations, 112896u);
  EXPECT_EQ(p0.slots, 2);
  const MemoryPlan p1 = qt::plan::memory_plan_stage(in, 1);
  EXPECT_EQ(p1.params, r(16384 * 2) + r(49312 * 2) + r(64 * 2));  // copy, layer 1, final norm
  const u64 head = r(16 * 256 * 2) + 2 * r(16 * 4) + r(8);
  EXPECT_EQ(p1.activations, 768 + 512 + 2 * stream + layer + scratch + head + r(16 * 64 * 2));
  EXPECT_EQ(p1.activations, 79360u);
  // memory_plan: the stage that needs most.
  const MemoryPlan peak = memory_plan(in);
  EXPECT_EQ(peak.stage, p0.gpu() >= p1.gpu() ? 0 : 1);
  EXPECT_EQ(peak.gpu(), std::max(p0.gpu(), p1.gpu()));
  EXPECT_TRUE(peak.built);  // a 1F1B pipeline at dp 1 runs on CUDA
  MemoryPlanInput dp2 = tiny_input(2, 1, 2);
  dp2.zero_stage = 1;
  EXPECT_TRUE(memory_plan(dp2).built);  // at dp > 1 with ZeRO-0 or 1
  dp2.zero_stage = 2;
  EXPECT_FALSE(memory_plan(dp2).built);  // not yet with ZeRO-2 or 3: a prediction
}

// ZB-H1 on CUDA (built at dp 1, interleaved too): the tiny pp 2 of TinyStagesByHand, stage 0
// holding the schedule's slots (a weight half may wait after its input half: more than 1F1B's
// 2), each slot x, ln, rstd of layers 0..1 and layer 0's activations as there, and the copies of
// its layer's o, down and q/k/v output gradients for the deferred weight GEMMs:
// [N, Q + 2 KV + 2 H] = [16, 64 + 64 + 128] bf16 (cuda/backend_cuda_pipeline.cpp).
TEST(PlanPipeline, TinyZbH1ByHand) {
  MemoryPlanInput in = tiny_input(1, 1, 2);
  const u64 f1b = qt::plan::memory_plan_stage(in, 0).activations;
  in.mesh.pp_schedule = "zb-h1";
  const u64 slots = static_cast<u64>(qt::plan::stage_parts(in, 0).chunks[0].slots);
  EXPECT_GE(slots, 2u);
  const u64 slot = 2 * (2 * r(16 * 64 * 2) + r(16 * 4)) + 33792;  // x, ln, rstd; the layer
  const u64 deferred = r(2 * 16 * (64 + 2 * 32 + 2 * 64));
  EXPECT_EQ(qt::plan::memory_plan_stage(in, 0).activations,
            f1b + (slots - 2) * slot + slots * deferred);
  EXPECT_TRUE(memory_plan(in).built);
  in.model.num_layers = 4;  // interleaved ZB-H1: 2 chunks of a layer a stage
  in.mesh.pp_chunks = 2;
  EXPECT_TRUE(memory_plan(in).built);
  EXPECT_GT(memory_plan(in).activations, 0u);
  // At dp 1 ZeRO-2 keeps whole gradients (offload's rows run); at dp 2 it is not planned.
  MemoryPlanInput off = tiny_input(1, 1, 2);
  off.mesh.pp_schedule = "zb-h1";
  off.zero_stage = 2;
  off.offload = Offload::kCpu;
  EXPECT_TRUE(memory_plan(off).built);
  off = tiny_input(2, 1, 2);
  off.mesh.pp_schedule = "zb-h1";
  off.zero_stage = 2;
  EXPECT_THROW(memory_plan(off), qt::UserError);
}

// Interleaving and ZB-H1 hold more micro-batches on the first stage than 1F1B's P.
TEST(PlanPipeline, SchedulesSetTheSlots) {
  MemoryPlanInput in;
  in.model = preset("qwen3-0.6b");  // 28 layers
  in.micro_batch = 1;
  in.seq_len = 1024;
  in.mesh.pp = 4;
  in.micro_batches = 8;
  EXPECT_EQ(qt::plan::stage_parts(in, 0).max_slots(), 4);
  EXPECT_EQ(qt::plan::stage_parts(in, 3).max_slots(), 1);
  in.mesh.pp_schedule = "zb-h1";
  EXPECT_GE(qt::plan::stage_parts(in, 0).max_slots(), 4);
  const u64 zb = memory_plan(in).activations;
  in.mesh.pp_schedule = "1f1b";
  EXPECT_GE(zb, memory_plan(in).activations);
  in.mesh.pp_chunks = 2;
  // 28 layers over 8 chunks balanced by cost (the lm head on the last); stage s runs chunks s
  // and s + 4.
  const std::vector<int> b = qt::pipeline_layer_bounds(in.model, in.mesh);
  int layers = 0;
  for (int s = 0; s < 4; ++s) {
    const qt::plan::StageParts st = qt::plan::stage_parts(in, s);
    ASSERT_EQ(st.chunks.size(), 2u);
    EXPECT_EQ(st.chunks[1].first, b[s + 4]);
    EXPECT_EQ(st.layers(), b[s + 1] - b[s] + b[s + 5] - b[s + 4]);
    layers += st.layers();
  }
  EXPECT_EQ(layers, 28);
}

TEST(PlanPipeline, RefusesWhatTheDeckRefuses) {
  MemoryPlanInput in = tiny_input(1, 3, 1);
  EXPECT_THROW(memory_plan(in), qt::UserError);  // tp 3 does not divide 4 heads
  in = tiny_input(1, 1, 3);
  EXPECT_THROW(memory_plan(in), qt::UserError);  // 3 stages of 2 layers
  in = tiny_input(1, 1, 2);
  in.mesh.pp_chunks = 2;
  EXPECT_THROW(memory_plan(in), qt::UserError);  // 4 chunks of 2 layers
  in = tiny_input(1, 1, 2);
  in.mesh.pp_schedule = "zb-h1";
  in.recompute = true;
  EXPECT_THROW(memory_plan(in), qt::UserError);
}

// More tp: fewer parameter, gradient and activation bytes a GPU; more pp: fewer parameter bytes
// on the stage that needs most. Qwen3-32B, one sequence of 4096, ZeRO-1 over dp 2.
TEST(PlanMonotonic, MoreTpOrPpHoldsLess) {
  MemoryPlanInput in;
  in.model = preset("qwen3-32b");
  in.micro_batch = 1;
  in.seq_len = 4096;
  in.mesh.dp = 2;
  in.zero_stage = 1;
  in.micro_batches = 16;
  u64 params = UINT64_MAX, grads = UINT64_MAX, acts = UINT64_MAX;
  for (int tp : {1, 2, 4, 8}) {
    in.mesh.tp = tp;
    const MemoryPlan p = memory_plan(in);
    EXPECT_LT(p.params, params) << "tp " << tp;
    EXPECT_LT(p.grads, grads) << "tp " << tp;
    EXPECT_LT(p.activations, acts) << "tp " << tp;
    params = p.params, grads = p.grads, acts = p.activations;
  }
  in.mesh.tp = 1;
  params = UINT64_MAX;
  for (int pp : {1, 2, 4, 8, 16}) {
    in.mesh.pp = pp;
    const MemoryPlan p = memory_plan(in);
    EXPECT_LT(p.params, params) << "pp " << pp;
    params = p.params;
  }
}

qt::plan::LayoutSearch search(const char* model, int gpus, int global_batch, double gib) {
  qt::plan::LayoutSearch s;
  s.model = preset(model);
  s.micro_batch = 1;
  s.seq_len = 4096;
  s.global_batch = global_batch;
  s.gpus = gpus;
  s.usable = static_cast<u64>(gib * (u64{1} << 30)) - qt::plan::kGpuMarginBytes;
  return s;
}

// Every listed mesh divides the GPUs and the model; the others are listed with a reason naming
// the key.
TEST(PlanLayouts, EnumerationDividesAndExplains) {
  qt::plan::LayoutSearch s = search("tiny", 8, 8, 80);
  s.seq_len = 8;
  s.topology.gpus_per_host = 4;
  const qt::plan::Layouts all = qt::plan::enumerate_layouts(s);
  ASSERT_FALSE(all.rows.empty());
  for (const qt::plan::Layout& row : all.rows) {
    const qt::MeshShape& m = row.in.mesh;
    EXPECT_EQ(m.dp * m.tp * m.pp, 8);
    EXPECT_EQ(4 % m.tp, 0);  // tiny's heads; kv heads 2: divided, or shared by tp / 2 ranks
    EXPECT_TRUE(2 % m.tp == 0 || m.tp % 2 == 0);
    EXPECT_LE(m.pp, 2);
    EXPECT_EQ(row.in.micro_batches * m.dp, 8);
    EXPECT_EQ(row.fits, row.memory.device() <= s.usable);
    EXPECT_GT(row.time.total, 0);
  }
  auto reason = [&](int dp, int tp, int pp) {
    for (const qt::plan::Excluded& e : all.excluded)
      if (e.dp == dp && e.tp == tp && e.pp == pp) return e.why;
    return std::string("(not excluded)");
  };
  EXPECT_EQ(reason(2, 4, 1), "(not excluded)");  // each kv head on 2 of the 4 tp ranks
  EXPECT_EQ(reason(1, 8, 1), "mesh.tp = 8 does not divide model.num_heads = 4");
  EXPECT_EQ(reason(2, 1, 4), "mesh.pp = 4 is more than model.num_layers = 2");
  EXPECT_EQ(reason(1, 2, 4), "mesh.pp = 4 is more than model.num_layers = 2");
  // dp 4 x pp 2: 8 / 4 = 2 micro-batches for 2 stages, enough; 1 x ... runs.
  EXPECT_EQ(reason(4, 1, 2), "(not excluded)");
  // tp above a host, and a global batch that dp does not divide.
  s = search("qwen3-8b", 16, 12, 80);
  s.tp = {8};
  s.topology.gpus_per_host = 4;
  EXPECT_EQ(qt::plan::enumerate_layouts(s).excluded.at(0).why,
            "mesh.tp = 8 is more than the 4 GPUs of one host (topology.gpus_per_host, "
            "--gpus-per-host)");
  s.topology.gpus_per_host = 8;
  s.tp = {1};
  s.pp = {1};
  EXPECT_EQ(qt::plan::enumerate_layouts(s).excluded.at(0).why,
            "train.global_batch = 12 is not a multiple of train.micro_batch x mesh.dp = 1 x 16");
  s.global_batch = 8;
  s.pp = {8};
  EXPECT_EQ(qt::plan::enumerate_layouts(s).excluded.at(0).why,
            "4 micro-batches a step (train.global_batch / (train.micro_batch x mesh.dp)) for "
            "mesh.pp = 8 stages: fewer than the stages");
}

// The recommendation fits, and no fitting row is more than 1% faster; on Qwen3-32B over 32 GPUs
// of 80 GB (4 hosts of 8) it exists.
TEST(PlanLayouts, RecommendationFitsAndIsFastest) {
  const qt::plan::Layouts all = qt::plan::enumerate_layouts(search("qwen3-32b", 32, 64, 80));
  const qt::plan::Layout* best = qt::plan::recommended(all);
  ASSERT_NE(best, nullptr);
  EXPECT_TRUE(best->fits);
  EXPECT_LE(best->memory.gpu(), search("qwen3-32b", 32, 64, 80).usable);
  int fitting = 0;
  for (const qt::plan::Layout& row : all.rows) {
    if (!row.fits) continue;
    ++fitting;
    EXPECT_GE(row.time.total * 1.01, best->time.total);
  }
  EXPECT_GT(fitting, 1);
  EXPECT_LT(fitting, static_cast<int>(all.rows.size()));  // some do not fit (dp 32 ZeRO-0 ...)
  const std::vector<std::string> keys = qt::plan::deck_keys(*best);
  EXPECT_EQ(keys.at(0), "mesh.dp = " + std::to_string(best->in.mesh.dp));
  // Nothing fits a 6 GiB card.
  EXPECT_EQ(qt::plan::recommended(qt::plan::enumerate_layouts(search("qwen3-32b", 32, 64, 6))),
            nullptr);
}

// The time model against the measured one-GPU rates (docs/performance.md, H100, 2 x 4096 tokens
// a step, no recompute): within 5% for the shapes its GEMM rate was taken from (8B-shaped layers)
// and the 1.7B; the 0.6B (H 1024), whose elementwise work weighs more than the GEMM rate allows
// for, within 12% (predicted faster).
TEST(PlanStepTime, OneGpuMatchesMeasuredRates) {
  struct Case {
    const char* preset;
    int layers;
    double tokens_per_s, tolerance;
  };
  for (const Case& c : {Case{"qwen3-1.7b", 0, 42410, 0.05}, Case{"qwen3-8b", 8, 37640, 0.05},
                        Case{"qwen3-0.6b", 0, 86980, 0.12}}) {
    MemoryPlanInput in;
    in.model = preset(c.preset);
    if (c.layers) in.model.num_layers = c.layers;
    in.micro_batch = 2;
    in.seq_len = 4096;
    const qt::plan::StepTime t = qt::plan::step_time(in, qt::TopologyConfig{});
    EXPECT_NEAR(t.tokens_per_s_per_gpu / c.tokens_per_s, 1.0, c.tolerance) << c.preset;
    EXPECT_NEAR(t.total, t.compute + t.tp_comm + t.pp_comm + t.bubble + t.dp_exposed +
                             t.optimizer, 1e-12);
  }
}

// The pipeline's bubble is the schedule's: (P - 1) / (M + P - 1) under 1F1B with every stage
// alike, less under ZB-H1; tp across the network is slower than inside a host.
TEST(PlanStepTime, BubbleAndLinks) {
  MemoryPlanInput in;
  in.model = preset("qwen3-8b");
  in.model.num_layers = 32;
  in.model.tie_word_embeddings = true;
  in.micro_batch = 1;
  in.seq_len = 4096;
  in.mesh.pp = 4;
  in.micro_batches = 8;
  const qt::TopologyConfig topo;
  const qt::plan::StepTime f1b = qt::plan::step_time(in, topo);
  EXPECT_NEAR(f1b.bubble_fraction, 3.0 / 11.0, 1e-9);
  in.mesh.pp_schedule = "zb-h1";
  EXPECT_LT(qt::plan::step_time(in, topo).bubble_fraction, f1b.bubble_fraction);
  in = MemoryPlanInput{};
  in.model = preset("qwen3-8b");
  in.micro_batch = 1;
  in.seq_len = 4096;
  in.mesh.tp = 8;
  qt::TopologyConfig small = topo;
  small.gpus_per_host = 4;  // tp 8 spans two hosts
  const qt::plan::StepTime inside = qt::plan::step_time(in, topo);
  const qt::plan::StepTime across = qt::plan::step_time(in, small);
  EXPECT_GT(inside.tp_comm, 0);
  EXPECT_GT(across.tp_comm, 3 * inside.tp_comm);
  EXPECT_TRUE(qt::plan::group_inside_host(1, 8, 32, 8));
  EXPECT_FALSE(qt::plan::group_inside_host(1, 8, 32, 4));
  EXPECT_TRUE(qt::plan::group_inside_host(2, 4, 32, 8));  // dp 4 at tp 2: 8 ranks of one host
  EXPECT_FALSE(qt::plan::group_inside_host(8, 4, 32, 8));
  EXPECT_TRUE(qt::plan::group_inside_host(8, 4, 8, 8));   // one host holds the whole job
}

}  // namespace
