// The sharding plan and the optimizer driver (issue 16), under mpiexec -n 1 and -n 3: the plan
// covers every parameter once, the gradient norm counts every element once at every ZeRO stage,
// the first AdamW step matches its closed form, and ZeRO-3 holds a shard of the parameters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/lora.h"
#include "model/qwen3.h"
#include "optim/sharded_state.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/comm.h"
#include "qtrain/shard_plan.h"

namespace qt {
namespace {

std::shared_ptr<MpiComm> world() {
  return std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
}

ModelConfig tiny(bool tied) {
  ModelConfig m = *model_preset("tiny");
  m.tie_word_embeddings = tied;
  return m;
}

TEST(ShardPlan, UnitsAndShardsCoverEveryParameterOnce) {
  std::vector<ModelConfig> models = {tiny(true), tiny(false), *model_preset("qwen3-8b")};
  for (const ModelConfig& m : models) {
    const ParamLayout layout(m);
    for (int dp : {1, 2, 3, 4, 7}) {
      SCOPED_TRACE(m.preset + " dp " + std::to_string(dp) + (m.tie_word_embeddings ? " tied" : ""));
      MeshShape mesh;
      mesh.dp = dp;
      const ShardPlan plan = plan_qwen3(m, layout, mesh, 3);
      ASSERT_EQ(plan.units.size(), static_cast<std::size_t>(m.num_layers + 2));
      ASSERT_EQ(plan.specs.size(), layout.params().size());
      EXPECT_EQ(plan.units.front().name, "embed");
      EXPECT_EQ(plan.units[Qwen3Units{m.num_layers}.layer(1)].name, "layers.1");
      EXPECT_EQ(plan.units.back().name, "head");
      std::size_t next = 0, tensors = 0;
      for (const ParamUnit& u : plan.units) {
        EXPECT_EQ(u.range.begin, next) << u.name;  // contiguous, in flat order
        next = u.range.end;
        tensors += u.params.size();
        std::size_t at = u.range.begin;
        for (int r = 0; r < dp; ++r) {  // the shards partition the unit in rank order
          const Range s = u.shard(r);
          EXPECT_EQ(s.begin, std::min(at, u.range.end)) << u.name << " rank " << r;
          EXPECT_LE(s.size(), u.chunk);
          at = s.end;
        }
        EXPECT_EQ(at, u.range.end) << u.name;
        EXPECT_GE(u.padded(), u.range.size());
        EXPECT_LT(u.padded() - u.range.size(), static_cast<std::size_t>(dp));
      }
      EXPECT_EQ(next, layout.numel());
      EXPECT_EQ(tensors, layout.params().size());
      std::size_t owned = 0;
      for (int r = 0; r < dp; ++r)
        for (const Range& x : plan.owned(r)) owned += x.size();
      EXPECT_EQ(owned, layout.numel());
      for (const ShardSpec& s : plan.specs) {
        EXPECT_FALSE(s.sharded_by.has_value());  // dp only: ZeRO shards storage, not tensors
        ASSERT_EQ(s.replicated_over.size(), 1u);
        EXPECT_EQ(s.replicated_over[0], MeshDim::kDp);
      }
    }
  }
}

// Gradient element i of the model summed over ranks: f(i); rank r contributes f(i) w_r.
float grad_value(std::size_t i) { return 1e-3f * static_cast<float>((i * 7919) % 1013) - 0.5f; }
float param_value(std::size_t i) { return 0.01f * static_cast<float>((i * 104729) % 211) - 1.0f; }

TEST(ShardedState, NormAndFirstStepAtEveryStage) {
  auto comm = world();
  const int P = comm->size(), r = comm->rank();
  const ModelConfig m = tiny(true);
  const ParamLayout layout(m);
  MeshShape mesh;
  mesh.dp = P;
  OptimConfig oc;
  oc.lr = 1e-2;
  oc.min_lr = 1e-2;
  oc.warmup_steps = 0;
  oc.schedule = Schedule::kConstant;
  oc.grad_clip = 0;  // no clipping: the closed form below
  oc.weight_decay = 0.1;
  // Rank weights w_r = (r + 1) / sum(r + 1): their sum is 1 up to rounding.
  const double wsum = P * (P + 1) / 2.0;
  const float w_r = static_cast<float>((r + 1) / wsum);
  double want_sq = 0;  // independently: over every element once, in double
  for (std::size_t i = 0; i < layout.numel(); ++i) {
    double g = 0;
    for (int q = 0; q < P; ++q) g += static_cast<double>(grad_value(i) * static_cast<float>((q + 1) / wsum));
    want_sq += g * g;
  }
  for (int zero = 0; zero <= 3; ++zero) {
    SCOPED_TRACE("ZeRO-" + std::to_string(zero) + " over " + std::to_string(P) + " ranks");
    oc.zero_stage = zero;
    const ShardPlan plan = plan_qwen3(m, layout, mesh, zero);
    ShardedState st(plan, layout, oc, *comm, 10);
    for (const FlatPiece& p : st.param_pieces())
      for (std::size_t k = 0; k < p.range.size(); ++k) p.data[k] = param_value(p.range.begin + k);
    st.zero_grads();
    for (std::size_t u = 0; u < plan.units.size(); ++u) {
      const int ui = static_cast<int>(u);
      float* g = st.grads(ui);
      for (std::size_t k = 0; k < plan.units[u].range.size(); ++k)
        g[k] = grad_value(plan.units[u].range.begin + k) * w_r;
      st.grads_done(ui);
    }
    const OptimStepStats s = st.step(0);
    std::printf("ZeRO-%d: grad norm %.9g, want %.9g\n", zero, s.grad_norm, std::sqrt(want_sq));
    EXPECT_NEAR(s.grad_norm, std::sqrt(want_sq), 1e-6 * std::sqrt(want_sq));
    EXPECT_EQ(s.clip_scale, 1.0);
    // First step, bias-corrected: w' = w - lr wd w - lr g / (|g| + eps) (no decay on norms).
    double worst = 0;
    for (const FlatPiece& p : st.param_pieces()) {
      for (std::size_t k = 0; k < p.range.size(); ++k) {
        const std::size_t i = p.range.begin + k;
        double g = 0;
        for (int q = 0; q < P; ++q) g += static_cast<double>(grad_value(i) * static_cast<float>((q + 1) / wsum));
        const ParamInfo* info = nullptr;
        for (const ParamInfo& pi : layout.params())
          if (i >= pi.offset && i < pi.offset + pi.numel) info = &pi;
        const double w = param_value(i);
        const double want = w - (info->weight_decay ? oc.lr * oc.weight_decay * w : 0.0) -
                            oc.lr * g / (std::abs(g) + oc.eps);
        worst = std::max(worst, std::abs(p.data[k] - want));
      }
    }
    EXPECT_LT(worst, 2e-6) << "largest difference from the closed-form first step";
  }
}

// Numerical safety (issue 19): a NaN in one element of one rank's gradients, or a non-finite
// loss, skips the step at every ZeRO stage: the parameters stay as they were, and the next step,
// asked for as AdamW's first update (StepRequest::update 1), lands exactly where a first step
// does, which it cannot if the skip had moved the parameters or the moments.
TEST(ShardedState, NonFiniteStepSkipsAndTheNextUpdateIsTheFirst) {
  auto comm = world();
  const int P = comm->size(), r = comm->rank();
  const ModelConfig m = tiny(true);
  const ParamLayout layout(m);
  MeshShape mesh;
  mesh.dp = P;
  OptimConfig oc;
  oc.lr = 1e-2;
  oc.min_lr = 1e-2;
  oc.warmup_steps = 0;
  oc.schedule = Schedule::kConstant;
  oc.grad_clip = 0;
  oc.weight_decay = 0;  // the first update moves every element by lr against its gradient's sign
  for (int zero = 0; zero <= 3; ++zero) {
    for (const bool nan_loss : {false, true}) {
      SCOPED_TRACE("ZeRO-" + std::to_string(zero) + (nan_loss ? ", loss NaN" : ", gradient NaN"));
      oc.zero_stage = zero;
      const ShardPlan plan = plan_qwen3(m, layout, mesh, zero);
      ShardedState st(plan, layout, oc, *comm, 10);
      for (const FlatPiece& p : st.param_pieces())
        for (std::size_t k = 0; k < p.range.size(); ++k) p.data[k] = param_value(p.range.begin + k);
      auto fill_grads = [&](bool poison) {
        st.zero_grads();
        for (std::size_t u = 0; u < plan.units.size(); ++u) {
          const int ui = static_cast<int>(u);
          float* g = st.grads(ui);
          for (std::size_t k = 0; k < plan.units[u].range.size(); ++k)
            g[k] = grad_value(plan.units[u].range.begin + k) / static_cast<float>(P);
          // One element of the last unit, on the last rank only: the sums carry it everywhere.
          if (poison && r == P - 1 && u + 1 == plan.units.size()) g[0] = std::nanf("");
          st.grads_done(ui);
        }
      };
      fill_grads(!nan_loss);
      const OptimStepStats skipped = st.step({0, 1, !nan_loss});
      EXPECT_TRUE(skipped.skipped);
      EXPECT_EQ(std::isfinite(skipped.grad_norm), nan_loss);
      long long moved = 0;
      for (const FlatPiece& p : st.param_pieces())
        for (std::size_t k = 0; k < p.range.size(); ++k)
          moved += !(p.data[k] == param_value(p.range.begin + k));
      EXPECT_EQ(moved, 0) << "parameters changed by a skipped step";
      fill_grads(false);
      const OptimStepStats applied = st.step({1, 1, true});
      EXPECT_FALSE(applied.skipped);
      double worst = 0;
      for (const FlatPiece& p : st.param_pieces())
        for (std::size_t k = 0; k < p.range.size(); ++k) {
          const std::size_t i = p.range.begin + k;
          const double g = static_cast<double>(grad_value(i) / static_cast<float>(P)) * P;
          const double want = param_value(i) - oc.lr * g / (std::abs(g) + oc.eps);
          worst = std::max(worst, std::abs(p.data[k] - want));
        }
      EXPECT_LT(worst, 2e-6) << "the update after a skip is not AdamW's first";
    }
  }
}

TEST(ShardedState, Zero3HoldsAShardAndGathersOneUnitAtATime) {
  auto comm = world();
  const int P = comm->size();
  ModelConfig m = tiny(false);
  m.num_layers = 6;  // enough layers that two gathered units and the shards are less than all
  const int B = 2, T = 8;
  Qwen3Model model(m, B, T, false);
  const ParamLayout& layout = model.layout();
  MeshShape mesh;
  mesh.dp = P;
  OptimConfig oc;
  oc.zero_stage = 3;
  const ShardPlan plan = plan_qwen3(m, layout, mesh, 3);
  ShardedState st(plan, layout, oc, *comm, 10);
  std::size_t shard = 0, largest = 0;
  for (const ParamUnit& u : plan.units) {
    shard += u.chunk;
    largest = std::max(largest, u.padded());
  }
  EXPECT_EQ(st.bytes().params, 4.0 * static_cast<double>(shard));
  EXPECT_EQ(st.bytes().grads, 4.0 * static_cast<double>(shard));  // the reduced shard only
  init_params(m, layout, 1, st.param_pieces());
  std::vector<std::int32_t> in(B * T), tg(B * T);
  for (int i = 0; i < B * T; ++i) {
    in[i] = (i * 37) % m.vocab_size;
    tg[i] = (i * 53 + 1) % m.vocab_size;
  }
  st.zero_grads();
  const double loss = model.forward(st, in.data(), tg.data());
  model.backward(st, 1.0f / (B * T));
  EXPECT_TRUE(std::isfinite(loss));
  // Afterwards nothing stays gathered; at the peak, the shards plus at most two whole units
  // (a layer and the next, whose input norm the layer's last op reads; or the last layer and
  // the head).
  EXPECT_EQ(st.bytes().params, 4.0 * static_cast<double>(shard));
  EXPECT_LE(st.peak_bytes().params, 4.0 * static_cast<double>(shard + 2 * largest));
  EXPECT_LE(st.peak_bytes().grads, 4.0 * static_cast<double>(shard + 2 * largest));
  if (P > 1) EXPECT_LT(st.peak_bytes().params, 4.0 * static_cast<double>(layout.numel()));
}

// Tensor parallelism's plan and element map: sharded tensors carry tp and their global shape;
// over the tp ranks the written pieces cover the global layout exactly once, and the pieces a
// rank reads put global element (r, c) of a row-parallel tensor at local (r, c - t * cols).
// Pipeline stages in the plan: the layers of each chunk from the cost model, from mesh.pp_layers
// when given, and with several chunks a stage; every layer on the stage of its chunk, the
// embedding on stage 0 and the head on the last.
TEST(ShardPlan, PipelineStagesHoldTheirLayers) {
  ModelConfig m = tiny(false);
  m.num_layers = 4;
  const ParamLayout layout(m);
  auto stages = [&](const MeshShape& mesh, const std::vector<int>& layer_stage) {
    const ShardPlan plan = plan_qwen3(m, layout, mesh, 0);
    EXPECT_EQ(plan.units.front().stage, 0);                // the embedding
    EXPECT_EQ(plan.units.back().stage, mesh.pp - 1);       // the head
    for (int l = 0; l < m.num_layers; ++l) EXPECT_EQ(plan.units[1 + l].stage, layer_stage[l]) << l;
    return plan.stage_layers;
  };
  MeshShape mesh;
  mesh.pp = 2;
  // tiny's lm head (a 256-token vocabulary) costs less than a layer: two layers a stage
  EXPECT_EQ(stages(mesh, {0, 0, 1, 1}), (std::vector<int>{0, 2, 4}));
  mesh.pp_layers = "3, 1";
  EXPECT_EQ(stages(mesh, {0, 0, 0, 1}), (std::vector<int>{0, 3, 4}));
  mesh.pp_layers = "";
  mesh.pp_chunks = 2;  // chunk c on stage c % 2
  EXPECT_EQ(stages(mesh, {0, 1, 0, 1}), (std::vector<int>{0, 1, 2, 3, 4}));
}

// Sequence parallelism: every tp rank norms its own rows, so the gradients of every norm (not
// only q_norm and k_norm) are partial over tp; the split of the other tensors is unchanged, and
// without tp the flag changes nothing.
TEST(TensorParallel, SequenceParallelMakesTheNormGradientsPartial) {
  const ModelConfig g = tiny(false);
  for (const int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const ModelConfig l = tp_local_config(g, tp);
    const ParamLayout local(l);
    MeshShape mesh;
    mesh.tp = tp;
    const ShardPlan plain = plan_qwen3(l, local, mesh, 1);
    mesh.sequence_parallel = true;
    const ShardPlan sp = plan_qwen3(l, local, mesh, 1);
    int norms = 0;
    for (std::size_t i = 0; i < sp.specs.size(); ++i) {
      const std::string& name = local.params()[i].name;
      const bool norm = name.find("norm.weight") != std::string::npos;
      norms += norm;
      EXPECT_EQ(!sp.specs[i].partial_over.empty(), tp > 1 && norm) << name;
      EXPECT_EQ(sp.specs[i].replicated_over, plain.specs[i].replicated_over) << name;
      EXPECT_EQ(sp.specs[i].sharded_by, plain.specs[i].sharded_by) << name;
      EXPECT_EQ(sp.specs[i].global_shape, plain.specs[i].global_shape) << name;
    }
    EXPECT_EQ(norms, 4 * g.num_layers + 1);  // ln1, q/k norm, ln2 a layer; the final norm
  }
}

TEST(TensorParallel, PlanAndMapCoverTheGlobalLayoutOnce) {
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const ModelConfig g = tiny(tied);
    const int tp = 2;
    const ModelConfig l = tp_local_config(g, tp);
    EXPECT_EQ(l.num_heads * tp, g.num_heads);
    EXPECT_EQ(l.intermediate_size * tp, g.intermediate_size);
    const ParamLayout global(g), local(l);
    MeshShape mesh;
    mesh.tp = tp;
    const ShardPlan plan = plan_qwen3(l, local, mesh, 0);
    for (std::size_t i = 0; i < plan.specs.size(); ++i) {
      const ShardSpec& s = plan.specs[i];
      const std::string& name = local.params()[i].name;
      EXPECT_EQ(s.global_shape, global.params()[i].shape) << name;
      const TpRole role = tp_role(name);
      EXPECT_EQ(s.sharded_by.has_value(), role == TpRole::kColumn || role == TpRole::kRow) << name;
      EXPECT_EQ(!s.partial_over.empty(), role == TpRole::kPartial) << name;
    }
    std::vector<int> written(global.numel(), 0);
    std::vector<float> values(global.numel());
    for (std::size_t k = 0; k < values.size(); ++k) values[k] = static_cast<float>(k);
    for (int t = 0; t < tp; ++t) {
      const TpMap map(global, local, plan, t);
      for (const TpMap::Segment& seg : map.segments(Range{0, local.numel()}, true))
        for (std::size_t k = 0; k < seg.count; ++k) ++written[seg.global + k];
      // Read the global values into the local layout and look at one row-parallel tensor.
      std::vector<float> mine(local.numel(), -1.0f);
      const std::vector<FlatPiece> whole = {{Range{0, local.numel()}, mine.data()}};
      for (const FlatPiece& p : map.to_global(whole, false))
        for (std::size_t k = 0; k < p.range.size(); ++k) p.data[k] = values[p.range.begin + k];
      EXPECT_EQ(std::count(mine.begin(), mine.end(), -1.0f), 0) << "tp rank " << t;
      const ParamInfo& lo = local.find("model.layers.1.self_attn.o_proj.weight");
      const ParamInfo& go = global.find("model.layers.1.self_attn.o_proj.weight");
      const std::size_t cols = static_cast<std::size_t>(lo.shape[1]);
      const std::size_t gcols = static_cast<std::size_t>(go.shape[1]);
      for (std::size_t r : {std::size_t{0}, static_cast<std::size_t>(lo.shape[0]) - 1})
        for (std::size_t c : {std::size_t{0}, cols - 1})
          EXPECT_EQ(mine[lo.offset + r * cols + c],
                    values[go.offset + r * gcols + static_cast<std::size_t>(t) * cols + c])
              << "o_proj (" << r << ", " << c << ") on tp rank " << t;
    }
    EXPECT_EQ(std::count(written.begin(), written.end(), 1),
              static_cast<std::ptrdiff_t>(written.size()));
  }
}

// More tp ranks than key/value heads (Megatron's replication): each rank holds one kv head, tp
// rank t the head t / R of R = tp / num_kv_heads ranks, whose query heads all belong to it; the
// plan marks k/v sharded in groups of R with their gradients partial over tp; reading gives the
// group's ranks the head's rows, writing lets only the group's first write them (each global
// element once over tp).
TEST(TensorParallel, KeyValueHeadsSharedByTpRanks) {
  for (const auto& [kv, tp] : std::vector<std::pair<int, int>>{{1, 2}, {2, 4}, {1, 4}, {2, 2}}) {
    SCOPED_TRACE("kv heads " + std::to_string(kv) + ", tp " + std::to_string(tp));
    ModelConfig g = tiny(false);
    g.num_kv_heads = kv;
    const int R = tp_kv_replicas(g, tp);
    EXPECT_EQ(R, tp > kv ? tp / kv : 1);
    const ModelConfig l = tp_local_config(g, tp);
    EXPECT_EQ(l.num_kv_heads, tp > kv ? 1 : kv / tp);
    EXPECT_EQ(l.num_heads * tp, g.num_heads);
    const ParamLayout global(g), local(l);
    MeshShape mesh;
    mesh.tp = tp;
    const ShardPlan plan = plan_qwen3(l, local, mesh, 0, R);
    for (std::size_t i = 0; i < plan.specs.size(); ++i) {
      const ShardSpec& s = plan.specs[i];
      const std::string& name = local.params()[i].name;
      const bool kv_proj = name.find("k_proj.weight") != std::string::npos ||
                           name.find("v_proj.weight") != std::string::npos;
      EXPECT_EQ(s.global_shape, global.params()[i].shape) << name;
      EXPECT_EQ(s.tp_replicas, kv_proj ? R : 1) << name;
      const bool partial = tp_role(name) == TpRole::kPartial || (kv_proj && R > 1);
      EXPECT_EQ(!s.partial_over.empty(), partial) << name;
    }
    std::vector<int> written(global.numel(), 0);
    std::vector<float> values(global.numel());
    for (std::size_t k = 0; k < values.size(); ++k) values[k] = static_cast<float>(k);
    const int group = g.num_heads / g.num_kv_heads;  // query heads a kv head
    for (int t = 0; t < tp; ++t) {
      // GQA stays consistent: rank t's query heads [t nh_l, (t + 1) nh_l) use its kv heads.
      const int kv_first = t * l.num_heads / group, kv_last = ((t + 1) * l.num_heads - 1) / group;
      EXPECT_EQ(kv_first, t / R * l.num_kv_heads) << "tp rank " << t;
      EXPECT_EQ(kv_last, (t / R + 1) * l.num_kv_heads - 1) << "tp rank " << t;
      const TpMap map(global, local, plan, t);
      for (const TpMap::Segment& seg : map.segments(Range{0, local.numel()}, true))
        for (std::size_t k = 0; k < seg.count; ++k) ++written[seg.global + k];
      std::vector<float> mine(local.numel(), -1.0f);
      const std::vector<FlatPiece> whole = {{Range{0, local.numel()}, mine.data()}};
      for (const FlatPiece& p : map.to_global(whole, false))
        for (std::size_t k = 0; k < p.range.size(); ++k) p.data[k] = values[p.range.begin + k];
      EXPECT_EQ(std::count(mine.begin(), mine.end(), -1.0f), 0) << "tp rank " << t;
      // k_proj [kv_l hd, H]: the rows of kv heads [t / R kv_l, ...); q_proj: query heads t nh_l ...
      for (const auto& [tensor, block] :
           {std::pair{"model.layers.1.self_attn.k_proj.weight", t / R},
            std::pair{"model.layers.0.self_attn.v_proj.weight", t / R},
            std::pair{"model.layers.1.self_attn.q_proj.weight", t}}) {
        const ParamInfo& lo = local.find(tensor);
        const ParamInfo& go = global.find(tensor);
        for (std::size_t k = 0; k < lo.numel; ++k)
          ASSERT_EQ(mine[lo.offset + k],
                    values[go.offset + static_cast<std::size_t>(block) * lo.numel + k])
              << tensor << " element " << k << " on tp rank " << t;
      }
    }
    EXPECT_EQ(std::count(written.begin(), written.end(), 1),
              static_cast<std::ptrdiff_t>(written.size()));
  }
}

// The LoRA adapters with kv heads shared by tp ranks: the k/v adapters' B factors [kv_l hd, r]
// follow their base projection (tp_replicas, partial over tp, rank t reading kv head t / R's
// rows, the group's first writing them); their A factors stay whole (partial over all of tp).
TEST(TensorParallel, KeyValueAdaptersFollowTheSharedHeads) {
  LoraConfig lc;
  lc.r = 2;
  lc.targets = "all-linear";
  for (const auto& [kv, tp] : std::vector<std::pair<int, int>>{{1, 2}, {1, 4}, {2, 4}}) {
    SCOPED_TRACE("kv heads " + std::to_string(kv) + ", tp " + std::to_string(tp));
    ModelConfig g = tiny(false);
    g.num_kv_heads = kv;
    const int R = tp_kv_replicas(g, tp);
    const ModelConfig l = tp_local_config(g, tp);
    const ParamLayout global = lora_layout(g, lc), local = lora_layout(l, lc);
    MeshShape mesh;
    mesh.tp = tp;
    const ShardPlan plan = plan_one_unit(local, "adapters", mesh, 0, R);
    int shared = 0;
    for (std::size_t i = 0; i < plan.specs.size(); ++i) {
      const ShardSpec& s = plan.specs[i];
      const std::string& name = local.params()[i].name;
      const bool kv_b = name.find("k_proj.lora_B") != std::string::npos ||
                        name.find("v_proj.lora_B") != std::string::npos;
      shared += kv_b;
      EXPECT_EQ(s.global_shape, global.params()[i].shape) << name;
      EXPECT_EQ(s.tp_replicas, kv_b ? R : 1) << name;
      EXPECT_EQ(!s.partial_over.empty(), kv_b || tp_role(name) == TpRole::kPartial) << name;
    }
    EXPECT_EQ(shared, 2 * g.num_layers);  // k and v a layer
    std::vector<int> written(global.numel(), 0);
    std::vector<float> values(global.numel());
    for (std::size_t k = 0; k < values.size(); ++k) values[k] = static_cast<float>(k);
    const std::string k_b = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight";
    for (int t = 0; t < tp; ++t) {
      const TpMap map(global, local, plan, t);
      for (const TpMap::Segment& seg : map.segments(Range{0, local.numel()}, true))
        for (std::size_t k = 0; k < seg.count; ++k) ++written[seg.global + k];
      std::vector<float> mine(local.numel(), -1.0f);
      const std::vector<FlatPiece> whole = {{Range{0, local.numel()}, mine.data()}};
      for (const FlatPiece& p : map.to_global(whole, false))
        for (std::size_t k = 0; k < p.range.size(); ++k) p.data[k] = values[p.range.begin + k];
      EXPECT_EQ(std::count(mine.begin(), mine.end(), -1.0f), 0) << "tp rank " << t;
      const ParamInfo& lo = local.find(k_b);
      const ParamInfo& go = global.find(k_b);
      ASSERT_EQ(lo.shape[0], l.head_dim);  // one kv head's rows
      for (std::size_t k = 0; k < lo.numel; ++k)
        ASSERT_EQ(mine[lo.offset + k],
                  values[go.offset + static_cast<std::size_t>(t / R) * lo.numel + k])
            << k_b << " element " << k << " on tp rank " << t;
    }
    EXPECT_EQ(std::count(written.begin(), written.end(), 1),
              static_cast<std::ptrdiff_t>(written.size()));
  }
}

// A pipeline stage's adapters (the layers of its chunks, lora_layout of layer ranges) are some of
// the model's: TpMap finds each by name, so over every stage and tp rank each global element is
// written once, and each stage reads its own tensors' values (tp 1: at their global offsets, the
// row-parallel A factors by columns at tp 2). Fails if the map pairs tensors by index.
TEST(TensorParallel, PipelineStageAdaptersMapByName) {
  LoraConfig lc;
  lc.r = 2;
  lc.targets = "all-linear";
  ModelConfig g = tiny(false);
  g.num_layers = 4;
  // Interleaved, two chunks a stage: stage 0 runs layers 0 and 2, stage 1 layers 1 and 3.
  const std::vector<std::vector<std::pair<int, int>>> stages = {{{0, 1}, {2, 3}},
                                                                {{1, 2}, {3, 4}}};
  for (int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const ModelConfig l = tp_local_config(g, tp);
    const ParamLayout global = lora_layout(g, lc);
    MeshShape mesh;
    mesh.tp = tp;
    mesh.pp = 2;
    std::vector<int> written(global.numel(), 0);
    std::vector<float> values(global.numel());
    for (std::size_t k = 0; k < values.size(); ++k) values[k] = static_cast<float>(k);
    for (std::size_t st = 0; st < stages.size(); ++st) {
      const ParamLayout local = lora_layout(l, lc, stages[st]);
      ASSERT_EQ(local.params().size(), global.params().size() / 2);
      const ShardPlan plan = plan_one_unit(local, "adapters", mesh, 0, 1);
      const std::string a_down = "base_model.model.model.layers." + std::to_string(2 + st) +
                                 ".mlp.down_proj.lora_A.weight";  // [r, I / tp], row-parallel
      for (int t = 0; t < tp; ++t) {
        const TpMap map(global, local, plan, t);
        for (const TpMap::Segment& seg : map.segments(Range{0, local.numel()}, true))
          for (std::size_t k = 0; k < seg.count; ++k) ++written[seg.global + k];
        std::vector<float> mine(local.numel(), -1.0f);
        const std::vector<FlatPiece> whole = {{Range{0, local.numel()}, mine.data()}};
        for (const FlatPiece& p : map.to_global(whole, false))
          for (std::size_t k = 0; k < p.range.size(); ++k) p.data[k] = values[p.range.begin + k];
        EXPECT_EQ(std::count(mine.begin(), mine.end(), -1.0f), 0) << "stage " << st;
        const ParamInfo& lo = local.find(a_down);
        const ParamInfo& go = global.find(a_down);
        const std::size_t cols = static_cast<std::size_t>(lo.shape[1]);
        const std::size_t gcols = static_cast<std::size_t>(go.shape[1]);
        for (std::size_t r = 0; r < static_cast<std::size_t>(lo.shape[0]); ++r)
          for (std::size_t c = 0; c < cols; ++c)
            ASSERT_EQ(mine[lo.offset + r * cols + c],
                      values[go.offset + r * gcols + static_cast<std::size_t>(t) * cols + c])
                << a_down << " (" << r << ", " << c << ") on stage " << st << ", tp rank " << t;
      }
    }
    EXPECT_EQ(std::count(written.begin(), written.end(), 1),
              static_cast<std::ptrdiff_t>(written.size()));
  }
}

}  // namespace
}  // namespace qt
