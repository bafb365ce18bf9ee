// The memory model of `qtrain plan` (src/plan/memory_plan.h): a tiny model's bytes worked out by
// hand from its shapes, buffer by buffer as the CUDA back end allocates them (ShardedCudaState at
// every ZeRO stage); the measured arena peaks of
// docs/performance.md and docs/plan.md; and the relations that must hold between ZeRO stages and
// offload.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dist/device_communicators.h"
#include "plan/memory_plan.h"
#include "qtrain/error.h"
#include "qtrain/model_config.h"

namespace {

using qt::ModelConfig;
using qt::plan::MemoryPlan;
using qt::plan::MemoryPlanInput;
using qt::plan::Offload;
using u64 = std::uint64_t;

constexpr u64 kMiB = u64{1} << 20;
constexpr double kGiB = double(u64{1} << 30);

// An arena block: 256-byte granules.
constexpr u64 r(u64 bytes) { return (bytes + 255) / 256 * 256; }

// The tiny preset: V 256, H 64, I 192, 2 layers, 4 q / 2 kv heads of 16, tied embeddings.
ModelConfig tiny() {
  const auto m = qt::model_preset("tiny");
  EXPECT_TRUE(m.has_value());
  return *m;
}

MemoryPlanInput input(const ModelConfig& m, int B, int T, int dp, int stage,
                      Offload off = Offload::kNone, bool recompute = false) {
  MemoryPlanInput in;
  in.model = m;
  in.micro_batch = B;
  in.seq_len = T;
  in.recompute = recompute;
  in.mesh.dp = dp;
  in.zero_stage = stage;
  in.offload = off;
  return in;
}

// Tiny, B = 2, T = 8 (N = 16 rows). Parameters: embedding 256 x 64 = 16384; a layer
// 64 + 64*64 + 2*32*64 + 64*64 + 16 + 16 + 64 + 3*192*64 = 49312; final norm 64;
// total 16384 + 2 * 49312 + 64 = 115072.
constexpr u64 kTinyParams = 115072;
constexpr u64 kTinyLayer = 49312;

TEST(MemoryPlan, TinyUnitsAndParameterCount) {
  const qt::plan::ParamUnits u = qt::plan::param_units(tiny());
  EXPECT_EQ(u.embed, 16384u);
  EXPECT_EQ(u.layer, kTinyLayer);
  EXPECT_EQ(u.last, 64u);
  EXPECT_EQ(u.layers, 2u);
  EXPECT_EQ(u.total(), kTinyParams);
  EXPECT_EQ(u.total(), static_cast<u64>(tiny().num_params()));  // the spec's formula
  EXPECT_EQ(u.largest(), kTinyLayer);
  EXPECT_EQ(u.largest_after_embed(), kTinyLayer);
  // dp = 2: 8192 + 2 * 24656 + 32
  EXPECT_EQ(u.shard(2), 57536u);
  // dp = 3: 5462 + 2 * 16438 + 22 (each unit's chunk rounded up)
  EXPECT_EQ(u.shard(3), 5462u + 2 * 16438u + 22u);
  EXPECT_EQ(qt::plan::ParamUnits::chunk(64, 3), 22u);
  EXPECT_EQ(qt::plan::ParamUnits::padded(64, 3), 66u);
  EXPECT_EQ(qt::plan::ParamUnits::chunk(2, 3), 1u);  // ParamUnit::chunk is at least 1
  EXPECT_EQ(u.shard(1), kTinyParams);
}

// Activations of tiny at B = 2, T = 8, every buffer of Qwen3Cuda and BatchBuffers by hand:
// N = 16, H = 64, Q = 64, KV = 32, I = 192, V = 256, nh = 4, nkv = 2, hd = 16, L = 2.
u64 tiny_activations(bool recompute) {
  const u64 N = 16, H = 64, Q = 64, KV = 32, I = 192, V = 256, nh = 4, nkv = 2, hd = 16, T = 8;
  const u64 batch = 3 * r(N * 4);            // inputs, targets, positions int32
  const u64 rope = 2 * r(T * (hd / 2) * 4);  // cos, sin
  const u64 stream = 3 * (r(N * H * 2) + r(N * H * 2) + r(N * 4));  // x, ln, rstd for l = 0..2
  const u64 layer = r(N * (Q + 2 * KV) * 2)                         // qkv_raw     4096
                    + r(N * nh * 4) + r(N * nkv * 4)                // q/k rstd     256 + 256
                    + r(N * Q * 2) + r(N * KV * 2) * 2              // q, k, v     2048 + 2 * 1024
                    + r(N * Q * 2)                                  // att         2048
                    + r(2 * nh * T * 4)                             // lse          256
                    + r(N * H * 2) * 2 + r(N * 4)                   // x_mid, ln2, rstd2
                    + r(N * 2 * I * 2) + r(N * I * 2);              // gu 12288, h 6144
  EXPECT_EQ(layer, 33792u);
  const u64 scratch = 4 * r(N * H * 2) + r(N * I * 2) + 2 * r(N * Q * 2) + 2 * r(N * KV * 2) +
                      r(N * (Q + 2 * KV) * 2);
  // 2^30 / (2 V) rows per lm-head chunk, at most N: all 16 rows.
  const u64 lm = r(N * V * 2) + 2 * r(N * 4) + r(8);
  return batch + rope + stream + (recompute ? 1 : 2) * layer + scratch + lm;
}

TEST(MemoryPlan, TinyActivationsByHand) {
  EXPECT_EQ(tiny_activations(false), 115456u);
  EXPECT_EQ(memory_plan(input(tiny(), 2, 8, 1, 0)).activations, 115456u);
  EXPECT_EQ(memory_plan(input(tiny(), 2, 8, 1, 0, Offload::kNone, true)).activations,
            115456u - 33792u);  // one shared set of layer activations
}

// Workspace: cuBLASLt 32 MiB, the grad-norm partials (1024 + 2 doubles), the largest op
// workspace, and the optimizer driver's second norm workspace (on the NCCL stream) with a sum of
// squares for each of the 4 units. At N = 16 the largest op workspace is the embedding
// backward's (estimated: 4 x 256 + 256 + 64 KiB), above rmsnorm's 4 blocks x 64 x 4 = 1024 and
// qk-norm's 1 block x 16 x 4 = 64.
constexpr u64 kTinyWorkspace =
    32 * kMiB + r(1026 * 8) + (4 * 256 + 256 + 65536) + r(1026 * 8) + r(4 * 8);
constexpr u64 kTinyShardedWorkspace = kTinyWorkspace;

// One GPU, ZeRO-0: each of the 4 units (embedding 16384, two layers of 49312, final norm 64)
// whole: bf16 weights, fp32 gradients, master, m and v.
TEST(MemoryPlan, TinyZero0OneGpuByHand) {
  const MemoryPlan p = memory_plan(input(tiny(), 2, 8, 1, 0));
  EXPECT_TRUE(p.built);
  const u64 f32 = r(16384 * 4) + 2 * r(49312 * 4) + r(64 * 4);
  EXPECT_EQ(p.params, r(16384 * 2) + 2 * r(49312 * 2) + r(64 * 2));  // 230656
  EXPECT_EQ(p.grads, f32);                                           // 460544
  // master + m + v (fp32), and 24 AdamW segments of 24 bytes (embedding, 11 per layer, norm)
  EXPECT_EQ(p.optimizer, 3 * f32 + r(24 * 24));
  EXPECT_EQ(p.optimizer, 1382400u);
  EXPECT_EQ(p.workspace, kTinyWorkspace);
  EXPECT_EQ(p.host, 12 * kTinyParams);
  EXPECT_EQ(p.host_pinned, 0u);
  EXPECT_EQ(p.gpu(), p.params + p.grads + p.optimizer + p.activations + p.workspace);
  EXPECT_EQ(p.nccl, 0u);  // one GPU: no communicator
  EXPECT_EQ(p.device(), p.gpu());
}

// NCCL's communicators outside the arena, 1 GiB each of more than one rank, the list
// cuda::connect_before_arena connects (dist/device_communicators.h): tp, dp, a Qwen3-MoE model's
// ep and expert-dp, the pipeline's 2 channels (4 interleaved).
TEST(MemoryPlan, NcclCommunicatorsOfEachMesh) {
  const auto mesh = [](int dp, int tp, int pp, int ep = 1, int chunks = 1) {
    qt::MeshShape m;
    m.dp = dp, m.tp = tp, m.pp = pp, m.ep = ep, m.pp_chunks = chunks;
    return m;
  };
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(1, 1, 1), false), 0);
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(2, 1, 1), false), 1);
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(1, 2, 1), false), 1);
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(2, 2, 1), false), 2);
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(1, 1, 2), false), 2);
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(1, 1, 2, 1, 2), false), 4);
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(2, 1, 1, 2), true), 2);   // dp, ep (expert-dp of 1 rank)
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(4, 1, 1, 2), true), 3);   // dp, ep, expert-dp
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(2, 1, 2, 2), true), 4);   // dp, ep, 2 channels
  EXPECT_EQ(qt::plan::device_communicator_count(mesh(4, 1, 1, 2), false), 1);  // a dense model: no ep group
  const std::vector<qt::DeviceCommunicator> all = qt::device_communicators(mesh(4, 2, 2, 2), true);
  std::vector<qt::MeshDim> dims;
  for (const auto& c : all) dims.push_back(c.dim);
  using D = qt::MeshDim;
  EXPECT_EQ(dims, (std::vector<D>{D::kTp, D::kDp, D::kEp, D::kEdp, D::kPp, D::kPp}));
  EXPECT_EQ(all[4].channel, 0);
  EXPECT_EQ(all[5].channel, 1);
  MemoryPlanInput in = input(tiny(), 2, 8, 2, 1);
  const MemoryPlan p = memory_plan(in);
  EXPECT_EQ(p.nccl, qt::plan::kNcclCommunicatorBytes);
  EXPECT_EQ(p.device(), p.gpu() + qt::plan::kNcclCommunicatorBytes);
}

// Two GPUs: ZeRO-0 keeps everything whole; ZeRO-1 whole weights and gradients, and per unit the
// master [chunk] and moments of rank 0's shard: embedding 8192, layers 24656, norm 32.
TEST(MemoryPlan, TinyZero0And1TwoGpusByHand) {
  const u64 whole_bf16 = r(16384 * 2) + 2 * r(49312 * 2) + r(64 * 2);
  const u64 whole_f32 = r(16384 * 4) + 2 * r(49312 * 4) + r(64 * 4);
  const MemoryPlan z0 = memory_plan(input(tiny(), 2, 8, 2, 0));
  EXPECT_EQ(z0.params, whole_bf16);
  EXPECT_EQ(z0.grads, whole_f32);
  EXPECT_EQ(z0.optimizer, 3 * whole_f32 + r(24 * 24));
  EXPECT_EQ(z0.host, 12 * kTinyParams);
  const MemoryPlan p = memory_plan(input(tiny(), 2, 8, 2, 1));
  EXPECT_TRUE(p.built);
  EXPECT_EQ(p.params, whole_bf16);
  EXPECT_EQ(p.grads, whole_f32);
  EXPECT_EQ(p.optimizer, 3 * r(8192 * 4) + 2 * 3 * r(24656 * 4) + 3 * r(32 * 4) + r(24 * 24));
  EXPECT_EQ(p.host, 12 * (8192u + 2 * 24656u + 32u));
  // optim.grad_reduce = bf16: a bf16 copy of the largest unit (a layer) for the wire.
  MemoryPlanInput in = input(tiny(), 2, 8, 2, 1);
  in.grad_reduce_bf16 = true;
  EXPECT_EQ(memory_plan(in).grads, whole_f32 + r(49312 * 2));
  in.mesh.dp = 1;  // no reduction, no copy
  EXPECT_EQ(memory_plan(in).grads, whole_f32);
}

TEST(MemoryPlan, TinyZero1PadsToDp) {
  // dp = 3: chunks 5462, 16438 and 22 (padded 16386, 49314, 66: zeros after each unit's end).
  const MemoryPlan p = memory_plan(input(tiny(), 2, 8, 3, 1));
  EXPECT_EQ(p.params, r(16386 * 2) + 2 * r(49314 * 2) + r(66 * 2));
  EXPECT_EQ(p.grads, r(16386 * 4) + 2 * r(49314 * 4) + r(66 * 4));
  EXPECT_EQ(p.optimizer, 3 * r(5462 * 4) + 2 * 3 * r(16438 * 4) + 3 * r(22 * 4) + r(24 * 24));
}

// ZeRO-2/3 on two GPUs, ShardedCudaState's blocks by hand. Units (chunk, padded): embedding
// 16384 (8192, 16384), two layers of 49312 (24656, 49312), final norm 64 (32, 64). Rank 0 owns a
// whole chunk of each. The shared slots are sized by the largest unit after the embedding, a
// layer: 49312 padded, 24656 a chunk.
TEST(MemoryPlan, TinyZero2And3TwoGpusByHand) {
  const u64 segments = r(24 * 24);  // 24 AdamW segments: embedding, 11 per layer, norm
  // Per unit: fp32 grad [chunk] of the own shard; master [chunk], m, v [own] fp32.
  const u64 grad_shard = r(8192 * 4) + 2 * r(24656 * 4) + r(32 * 4);
  // Two gradient slots, each a layer [padded] and its reduce-scatter output [chunk]; the
  // embedding's slot [16384] and its output [8192].
  const u64 grad_slots = 2 * (r(49312 * 4) + r(24656 * 4)) + r(16384 * 4) + r(8192 * 4);
  const u64 optimizer = 3 * r(8192 * 4) + 2 * 3 * r(24656 * 4) + 3 * r(32 * 4) + segments;

  const MemoryPlan z2 = memory_plan(input(tiny(), 2, 8, 2, 2));
  EXPECT_TRUE(z2.built);
  EXPECT_EQ(z2.params, r(16384 * 2) + 2 * r(49312 * 2) + r(64 * 2));  // every unit whole, bf16
  EXPECT_EQ(z2.params, 32768u + 2 * 98816u + 256u);
  EXPECT_EQ(z2.grads, grad_shard + grad_slots);
  EXPECT_EQ(z2.grads, 230656u + 2 * 197376u + 2 * 98816u + 65536u + 32768u);
  EXPECT_EQ(z2.optimizer, optimizer);
  EXPECT_EQ(z2.activations, tiny_activations(false));
  EXPECT_EQ(z2.workspace, kTinyShardedWorkspace);
  EXPECT_EQ(z2.host, 12 * 57536u);  // host master, m, v of the own shard
  EXPECT_EQ(z2.host_pinned, 0u);

  const MemoryPlan z3 = memory_plan(input(tiny(), 2, 8, 2, 3));
  EXPECT_TRUE(z3.built);
  // The own bf16 shard of every unit, three gather slots of a layer, the embedding's slot.
  EXPECT_EQ(z3.params,
            r(8192 * 2) + 2 * r(24656 * 2) + r(32 * 2) + 3 * r(49312 * 2) + r(16384 * 2));
  EXPECT_EQ(z3.params, 16384u + 2 * 49408u + 256u + 3 * 98816u + 32768u);
  EXPECT_EQ(z3.grads, z2.grads);
  EXPECT_EQ(z3.optimizer, z2.optimizer);
  EXPECT_EQ(z3.activations, z2.activations);
  EXPECT_EQ(z3.workspace, z2.workspace);
  EXPECT_EQ(z3.host, z2.host);
}

// On one GPU there is no communicator: the shard is the whole unit, nothing is gathered, no
// scratch; ZeRO-2 and 3 are the same.
TEST(MemoryPlan, TinyZero2And3OneGpuByHand) {
  for (int stage : {2, 3}) {
    const MemoryPlan p = memory_plan(input(tiny(), 2, 8, 1, stage));
    EXPECT_EQ(p.params, r(16384 * 2) + 2 * r(49312 * 2) + r(64 * 2)) << stage;
    EXPECT_EQ(p.grads, r(16384 * 4) + 2 * r(49312 * 4) + r(64 * 4));
    EXPECT_EQ(p.optimizer, 3 * (r(16384 * 4) + 2 * r(49312 * 4) + r(64 * 4)) + r(24 * 24));
    EXPECT_EQ(p.host, 12 * kTinyParams);
  }
}

TEST(MemoryPlan, TinyOffloadByHand) {
  const MemoryPlan none = memory_plan(input(tiny(), 2, 8, 2, 2));
  const MemoryPlan p = memory_plan(input(tiny(), 2, 8, 2, 2, Offload::kCpu));
  EXPECT_TRUE(p.built);
  EXPECT_EQ(p.optimizer, r(24 * 24));  // the AdamW segment table stays on the GPU
  EXPECT_EQ(p.params, none.params);
  EXPECT_EQ(p.grads, none.grads);
  EXPECT_EQ(p.workspace, kTinyShardedWorkspace);  // the staging is host memory
  EXPECT_EQ(p.host, 12 * 57536u);          // master, m, v of the own shard, pageable
  // Pinned: two fp32 gradient and two bf16 weight buffers of the largest chunk (a layer's 24656,
  // above the embedding's 8192).
  EXPECT_EQ(p.host_pinned, 2 * (24656 * 4 + 24656 * 2));
  // One GPU: the chunk is the whole unit.
  EXPECT_EQ(memory_plan(input(tiny(), 2, 8, 1, 3, Offload::kCpu)).host_pinned,
            2 * (49312 * 4 + 49312 * 2));
  EXPECT_EQ(memory_plan(input(tiny(), 2, 8, 1, 3, Offload::kCpu)).host, 12 * kTinyParams);
}

// The arena peaks measured on an H100 (docs/performance.md, 2026-11-26: micro_batch 2 x 4096
// tokens, no recompute, one GPU), as printed there to 0.1 GiB.
TEST(MemoryPlan, MeasuredArenaPeaks) {
  struct Case {
    const char* preset;
    int layers;  // 0: the preset's
    double gib;
  };
  for (const Case& c : {Case{"qwen3-0.6b", 0, 21.4}, Case{"qwen3-1.7b", 0, 46.1},
                        Case{"qwen3-8b", 8, 57.1}, Case{"qwen3-8b", 12, 74.3}}) {
    ModelConfig m = *qt::model_preset(c.preset);
    if (c.layers) m.num_layers = c.layers;
    const MemoryPlan p = memory_plan(input(m, 2, 4096, 1, 0));
    EXPECT_NEAR(p.gpu() / kGiB, c.gib, 0.05) << c.preset << " " << c.layers << " layers";
  }
}

// The sharded back end's arena after set-up, measured on H200s (docs/plan.md): Qwen3-8B,
// micro_batch 1 x 4096 tokens, no recompute, as printed to 0.01 GiB (2 GPUs: with the untied
// embedding's gradient as rows, no whole-table gradient slot).
TEST(MemoryPlan, MeasuredShardedArena) {
  const ModelConfig m = *qt::model_preset("qwen3-8b");
  EXPECT_NEAR(memory_plan(input(m, 1, 4096, 2, 3)).gpu() / kGiB, 100.92, 0.01);  // 2 GPUs
  EXPECT_NEAR(memory_plan(input(m, 1, 4096, 1, 3, Offload::kCpu)).gpu() / kGiB, 66.38, 0.01);
}

std::vector<ModelConfig> qwen3_presets() {
  std::vector<ModelConfig> out;
  for (const char* name :
       {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"})
    out.push_back(*qt::model_preset(name));
  return out;
}

// At dp > 1 each stage needs no more GPU memory than the one below as long as the units after
// the embedding are small against the model. ZeRO-1 shards the moments. ZeRO-2 shards 8 bytes of
// each parameter (fp32 gradients and master weights) and adds 4 bytes a parameter of two whole
// units with their reduced chunks and the embedding's slot: less when
// 2 n (dp - 1) >= (dp + 1) (2 largest + embed). ZeRO-3 shards the 2 bytes of bf16 weights and adds
// three gather slots and the embedding's: less when n (dp - 1) >= dp (3 largest + embed).
bool small_units(const ModelConfig& m, int dp) {
  const qt::plan::ParamUnits u = qt::plan::param_units(m);
  const double n = double(u.total()), big = double(u.largest_after_embed()), e = double(u.embed);
  return 2 * n * (dp - 1) >= (dp + 1) * (2 * big + e) && n * (dp - 1) >= dp * (3 * big + e);
}

TEST(MemoryPlan, HigherStagesNeedNoMoreAtDpAboveOne) {
  int checked = 0;
  for (const ModelConfig& m : qwen3_presets())
    for (int dp : {2, 3, 4, 8, 64}) {
      if (!small_units(m, dp)) continue;
      ++checked;
      for (bool recompute : {false, true}) {
        auto gpu = [&](int stage, Offload off = Offload::kNone, bool bf16 = false) {
          MemoryPlanInput in = input(m, 1, 4096, dp, stage, off, recompute);
          in.grad_reduce_bf16 = bf16;
          return memory_plan(in).gpu();
        };
        const std::string at = m.preset + " dp " + std::to_string(dp);
        EXPECT_LE(gpu(1), gpu(0)) << at;
        EXPECT_LE(gpu(1, Offload::kNone, true), gpu(0, Offload::kNone, true)) << at;
        EXPECT_LE(gpu(2), gpu(1)) << at;
        EXPECT_LE(gpu(3), gpu(2)) << at;
        EXPECT_LE(gpu(3, Offload::kCpu), gpu(2, Offload::kCpu)) << at;
      }
    }
  EXPECT_EQ(checked, 6 * 5);  // every Qwen3 preset at every dp
}

// Not a law, then: where one unit is a large part of the model, ZeRO-2's scratch and ZeRO-3's
// gather slots outweigh what they shard at small dp (tiny: a layer is 43% of the model). The plan
// shows it rather than hiding it.
TEST(MemoryPlan, HigherStagesCanCostMoreOnAFewLargeUnits) {
  EXPECT_FALSE(small_units(tiny(), 2));
  EXPECT_GT(memory_plan(input(tiny(), 2, 8, 2, 3)).gpu(),
            memory_plan(input(tiny(), 2, 8, 2, 2)).gpu());
  EXPECT_GT(memory_plan(input(tiny(), 2, 8, 2, 2)).gpu(),
            memory_plan(input(tiny(), 2, 8, 2, 1)).gpu());
}

// Offload takes the master weights and moments off the GPU (the segment table stays) and puts
// their 12 bytes an own element in host memory, beside 12 pinned bytes an element of the largest
// chunk (two fp32 and two bf16 staging buffers).
TEST(MemoryPlan, OffloadRemovesOptimizerStateFromGpu) {
  std::vector<ModelConfig> models = qwen3_presets();
  models.push_back(tiny());
  for (const ModelConfig& m : models) {
    const qt::plan::ParamUnits u = qt::plan::param_units(m);
    const u64 segments = r(24 * (2 + 11 * u64(m.num_layers) + (m.tie_word_embeddings ? 0 : 1)));
    for (int dp : {1, 2, 8})
      for (int s : {2, 3}) {
        const MemoryPlan none = memory_plan(input(m, 1, 2048, dp, s));
        const MemoryPlan cpu = memory_plan(input(m, 1, 2048, dp, s, Offload::kCpu));
        EXPECT_GT(none.optimizer, segments);
        EXPECT_EQ(cpu.optimizer, segments) << m.preset << " stage " << s;
        EXPECT_EQ(cpu.params, none.params);
        EXPECT_EQ(cpu.grads, none.grads);
        EXPECT_EQ(cpu.activations, none.activations);
        EXPECT_EQ(cpu.workspace, none.workspace);
        EXPECT_EQ(cpu.host, none.host);
        EXPECT_EQ(cpu.host, 12 * u.shard(dp));
        EXPECT_EQ(none.host_pinned, 0u);
        const u64 largest_chunk = (std::max(u.largest_after_embed(), u.embed) + dp - 1) / dp;
        EXPECT_EQ(cpu.host_pinned, 12 * largest_chunk);
        if (m.num_params() > 100'000'000) {
          EXPECT_LT(cpu.gpu(), none.gpu());
        }
      }
    // The CUDA back end offloads at ZeRO-2 and 3 only (the deck refuses 0 and 1).
    for (int s : {0, 1})
      EXPECT_THROW(memory_plan(input(m, 1, 2048, 2, s, Offload::kCpu)), qt::UserError);
  }
}

// With one GPU there is nothing to shard or reduce: every ZeRO stage allocates the same.
TEST(MemoryPlan, OneGpuStagesAreTheSame) {
  std::vector<ModelConfig> models = qwen3_presets();
  models.push_back(tiny());
  for (const ModelConfig& m : models) {
    const MemoryPlan z0 = memory_plan(input(m, 1, 1024, 1, 0));
    for (int stage : {1, 2, 3}) {
      const MemoryPlan z = memory_plan(input(m, 1, 1024, 1, stage));
      EXPECT_EQ(z.params, z0.params) << m.preset << " ZeRO-" << stage;
      EXPECT_EQ(z.grads, z0.grads);
      EXPECT_EQ(z.optimizer, z0.optimizer);
      EXPECT_EQ(z.activations, z0.activations);
      EXPECT_EQ(z.workspace, z0.workspace);
      EXPECT_EQ(z.host, z0.host);
    }
  }
}

// The largest unit: the embedding of Qwen3 (tied or not; untied, the lm head unit is one norm
// larger), a decoder layer of tiny.
TEST(MemoryPlan, LargestUnit) {
  const qt::plan::ParamUnits u8 = qt::plan::param_units(*qt::model_preset("qwen3-8b"));
  EXPECT_EQ(u8.embed, 151936u * 4096u);
  EXPECT_EQ(u8.last, 151936u * 4096u + 4096u);
  EXPECT_EQ(u8.largest(), u8.last);
  EXPECT_EQ(u8.total(), static_cast<u64>(qt::model_preset("qwen3-8b")->num_params()));
  const qt::plan::ParamUnits u06 = qt::plan::param_units(*qt::model_preset("qwen3-0.6b"));
  EXPECT_EQ(u06.last, 1024u);
  EXPECT_EQ(u06.largest(), u06.embed);
}

TEST(MemoryPlan, RefusesWhatItCannotPlan) {
  MemoryPlanInput in = input(tiny(), 2, 8, 2, 0);
  in.mesh.tp = 3;  // does not divide the 4 heads
  EXPECT_THROW(memory_plan(in), qt::UserError);
  in.mesh.tp = 1;
  in.mesh.ep = 2;
  EXPECT_THROW(memory_plan(in), qt::UserError);
  in = input(tiny(), 2, 8, 2, 4);
  EXPECT_THROW(memory_plan(in), qt::UserError);
  in = input(tiny(), 2, 8, 2, 1, Offload::kCpu);
  EXPECT_THROW(memory_plan(in), qt::UserError);  // offload needs ZeRO-2 or 3
  in = input(tiny(), 2, 8, 2, 2);
  in.grad_reduce_bf16 = true;
  EXPECT_THROW(memory_plan(in), qt::UserError);  // ZeRO-2 and 3 reduce in fp32
  in = input(tiny(), 0, 8, 2, 0);
  EXPECT_THROW(memory_plan(in), qt::UserError);
  in = input(tiny(), 2, 8, 2, 0);
  in.model.hidden_size = 2'000'000'000;
  in.model.intermediate_size = 2'000'000'000;
  in.model.num_layers = 2'000'000'000;
  EXPECT_THROW(memory_plan(in), qt::UserError);  // beyond 2^62 parameters, no wrap-around
  in = input(tiny(), 1 << 15, 1 << 15, 1, 0);
  in.model.intermediate_size = 1 << 30;
  EXPECT_THROW(memory_plan(in), qt::UserError);  // activations beyond 2^63 bytes
}

}  // namespace

namespace {

// The order the back end's out-of-memory message and `qtrain plan` prefer settings in, and the
// cheapest that fits: every earlier setting in that order does not fit, the one returned does.
TEST(MemoryPlan, CheapestFittingFollowsThePreferenceOrder) {
  MemoryPlanInput in;
  in.model = *qt::model_preset("qwen3-8b");
  in.micro_batch = 1;
  in.seq_len = 4096;
  in.mesh.dp = 2;
  const auto all = qt::plan::settings_by_preference(in);
  ASSERT_EQ(all.size(), 6u);
  const std::vector<std::pair<int, Offload>> want = {
      {0, Offload::kNone}, {1, Offload::kNone}, {2, Offload::kNone},
      {3, Offload::kNone}, {2, Offload::kCpu},  {3, Offload::kCpu}};
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(all[i].zero_stage, want[i].first) << i;
    EXPECT_EQ(all[i].offload, want[i].second) << i;
  }
  EXPECT_FALSE(qt::plan::cheapest_fitting(in, 1 << 20).has_value());  // nothing fits 1 MiB
  const auto roomy = qt::plan::cheapest_fitting(in, u64{1} << 50);
  ASSERT_TRUE(roomy.has_value());
  EXPECT_EQ(roomy->zero_stage, 0);
  EXPECT_EQ(roomy->offload, Offload::kNone);
  for (const double gib : {60.0, 75.5, 100.0, 136.5}) {
    const u64 usable = static_cast<u64>(gib * (1 << 30));
    const auto best = qt::plan::cheapest_fitting(in, usable);
    ASSERT_TRUE(best.has_value()) << gib << " GiB";
    EXPECT_LE(best->plan.gpu(), usable) << gib << " GiB";
    for (const auto& s : all) {
      if (s.zero_stage == best->zero_stage && s.offload == best->offload) break;
      EXPECT_GT(s.plan.gpu(), usable) << "ZeRO-" << s.zero_stage << " fits " << gib
                                      << " GiB but was passed over";
    }
  }
}

}  // namespace
