// Expert storage per expert-parallel rank (issue 18): an ep rank's local layout holds E / ep
// experts of each sparse layer (the router whole), the plan makes each sparse layer's experts a
// unit of their own over the expert-data-parallel group, and EpMap puts the local experts at
// their rows of the global tensors. Under tensor parallelism a tp rank holds every expert's
// columns of its width (gate and up by rows, down by columns) and TpMap puts them at their
// place in the global tensors. The expected sizes are the config's arithmetic, written out
// here, not the layout's code.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"
#include "parallel/unit_order.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {
namespace {

// Three layers, the middle one dense: two sparse layers of E = 8 experts of width Im = 12.
ModelConfig moe_model(bool tied) {
  ModelConfig m = *model_preset("tiny");
  m.num_layers = 3;
  m.num_experts = 8;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 12;
  m.mlp_only_layers = {1};
  m.tie_word_embeddings = tied;
  return m;
}

TEST(ExpertStorage, LocalLayoutHoldsTheRanksExpertsOnly) {
  for (bool tied : {true, false})
    for (int ep : {1, 2, 4, 8}) {
      SCOPED_TRACE("ep " + std::to_string(ep) + (tied ? " tied" : " untied"));
      const ModelConfig g = moe_model(tied);
      const ModelConfig c = ep_local_config(g, ep);
      const ParamLayout global(g), local(c);
      const std::size_t H = 64, Im = 12, E = 8, sparse = 2;  // moe_model's, written out
      const std::size_t per_expert = 2 * Im * H + H * Im;     // gate_up + down
      EXPECT_EQ(global.numel() - local.numel(), sparse * (E - E / ep) * per_expert);
      // The router stays whole; the experts are this rank's rows.
      EXPECT_EQ(local.find("model.layers.0.mlp.gate.weight").shape,
                (std::vector<std::int64_t>{8, 64}));
      EXPECT_EQ(local.find("model.layers.2.mlp.experts.gate_up_proj").shape,
                (std::vector<std::int64_t>{8 / ep, 24, 64}));
      EXPECT_EQ(local.find("model.layers.2.mlp.experts.down_proj").shape,
                (std::vector<std::int64_t>{8 / ep, 64, 12}));
      if (ep > 1)  // after the head
        EXPECT_GT(local.find("model.layers.0.mlp.experts.gate_up_proj").offset,
                  local.find("model.norm.weight").offset);
      else  // the global layout: right after the router
        EXPECT_EQ(local.find("model.layers.0.mlp.experts.gate_up_proj").offset,
                  local.find("model.layers.0.mlp.gate.weight").offset + E * H);
    }
}

TEST(ExpertStorage, ExpertUnitsAreShardedOverExpertDp) {
  const ModelConfig g = moe_model(false);
  for (int ep : {2, 4})
    for (int dp : {ep, 2 * ep}) {
      SCOPED_TRACE("ep " + std::to_string(ep) + " dp " + std::to_string(dp));
      const ModelConfig c = ep_local_config(g, ep);
      const ParamLayout local(c);
      MeshShape mesh;
      mesh.dp = dp;
      mesh.ep = ep;
      const ShardPlan plan = plan_qwen3(c, local, mesh, 3);
      const Qwen3Units units{3};
      ASSERT_EQ(plan.units.size(), 3u + 2 + 2);  // embed, 3 layers, head, 2 expert units
      std::size_t next = 0;
      for (const ParamUnit& u : plan.units) {  // contiguous, in flat order, covering all
        EXPECT_EQ(u.range.begin, next) << u.name;
        next = u.range.end;
      }
      EXPECT_EQ(next, local.numel());
      for (int m : {0, 1}) {
        const ParamUnit& u = plan.units[units.experts(m)];
        EXPECT_EQ(u.name, m == 0 ? "experts.0" : "experts.2");
        EXPECT_EQ(u.group, MeshDim::kEdp);
        EXPECT_EQ(u.dp, dp / ep);
        EXPECT_EQ(u.range.size(), static_cast<std::size_t>(8 / ep) * 3 * 12 * 64);
        for (std::size_t t : u.params) {
          EXPECT_EQ(plan.specs[t].sharded_by, MeshDim::kEp);
          EXPECT_EQ(plan.specs[t].global_shape[0], 8);
        }
      }
      for (int u = 0; u <= units.head(); ++u) EXPECT_EQ(plan.units[u].group, MeshDim::kDp);
      // The layer keeps its router: ln1, q, k, v, o, q_norm, k_norm, ln2, router.
      EXPECT_EQ(plan.units[units.layer(0)].params.size(), 9u);
      EXPECT_EQ(plan.units[units.layer(1)].params.size(), 11u);  // dense
    }
}

// ZeRO-3's gather order (parallel/unit_order.h): each sparse layer's experts right after their
// layer (the plan puts them after the head), the dense layer alone; at ep 1 the plan's order.
TEST(ExpertStorage, ForwardUnitOrderPutsExpertsAfterTheirLayer) {
  const ModelConfig g = moe_model(false);
  MeshShape mesh;
  mesh.dp = 2;
  mesh.ep = 2;
  const ModelConfig c = ep_local_config(g, 2);
  const ShardPlan plan = plan_qwen3(c, ParamLayout(c), mesh, 3);
  const Qwen3Units u{3};  // embed 0, layers 1..3, head 4, experts of layers 0 and 2: 5, 6
  EXPECT_EQ(forward_unit_order(plan),
            (std::vector<int>{u.embed(), u.layer(0), u.experts(0), u.layer(1), u.layer(2),
                              u.experts(1), u.head()}));
  mesh.ep = 1;
  const ShardPlan whole = plan_qwen3(g, ParamLayout(g), mesh, 3);
  EXPECT_EQ(forward_unit_order(whole), (std::vector<int>{0, 1, 2, 3, 4}));
}

// Over the ep ranks, the local layouts mapped to the global one cover every expert element
// once, at its expert's rows, and every other element once per rank.
TEST(ExpertStorage, EpMapPlacesEachRanksExpertsAtTheirGlobalRows) {
  const ModelConfig g = moe_model(true);
  const ParamLayout global(g);
  for (int ep : {2, 4}) {
    SCOPED_TRACE("ep " + std::to_string(ep));
    const ParamLayout local(ep_local_config(g, ep));
    std::vector<int> seen(global.numel(), 0);
    for (int r = 0; r < ep; ++r) {
      const EpMap map(global, local, r);
      for (const LayoutMap::Segment& s : map.segments(Range{0, local.numel()}, true)) {
        for (std::size_t i = 0; i < s.count; ++i) ++seen[s.global + i];
        ASSERT_LE(s.global + s.count, global.numel());
      }
      // Expert e of this rank, element j, is global expert r El + e's element j.
      const std::size_t El = 8 / ep, per = 2 * 12 * 64;
      const ParamInfo& lt = local.find("model.layers.2.mlp.experts.gate_up_proj");
      const ParamInfo& gt = global.find("model.layers.2.mlp.experts.gate_up_proj");
      const std::size_t e = El - 1, j = 5;
      const auto segs = map.segments(Range{lt.offset + e * per + j, lt.offset + e * per + j + 1},
                                     true);
      ASSERT_EQ(segs.size(), 1u);
      EXPECT_EQ(segs[0].global, gt.offset + (r * El + e) * per + j);
    }
    for (const ParamInfo& p : global.params()) {
      const bool expert = p.name.find("mlp.experts.") != std::string::npos;
      for (std::size_t i = p.offset; i < p.offset + p.numel; ++i)
        ASSERT_EQ(seen[i], expert ? 1 : ep) << p.name << " element " << i - p.offset;
    }
  }
}


// tp ranks split each expert's width Im = 12 as the dense MLP's: tp rank t holds, of expert e,
// gate rows [t Im/tp, (t + 1) Im/tp), up rows Im + the same, and those columns of down; the
// router whole with a partial gradient. Over the tp ranks the map writes every global element
// once, and reading places each local element at that global one.
TEST(ExpertStorage, TensorParallelSplitsEachExpertsWidth) {
  const ModelConfig g = moe_model(false);
  const ParamLayout global(g);
  std::vector<float> values(global.numel());
  for (std::size_t k = 0; k < values.size(); ++k) values[k] = static_cast<float>(k);
  for (int tp : {2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const ModelConfig l = tp_local_config(g, tp);
    EXPECT_EQ(l.moe_intermediate_size, 12 / tp);
    EXPECT_EQ(l.num_experts, 8);
    const ParamLayout local(l);
    const std::int64_t Im = 12, Iml = 12 / tp, H = 64, E = 8;
    EXPECT_EQ(local.find("model.layers.2.mlp.experts.gate_up_proj").shape,
              (std::vector<std::int64_t>{E, 2 * Iml, H}));
    EXPECT_EQ(local.find("model.layers.2.mlp.experts.down_proj").shape,
              (std::vector<std::int64_t>{E, H, Iml}));
    EXPECT_EQ(local.find("model.layers.2.mlp.gate.weight").shape,
              (std::vector<std::int64_t>{E, H}));
    MeshShape mesh;
    mesh.tp = tp;
    const ShardPlan plan = plan_qwen3(l, local, mesh, 0, tp > 2 ? tp / 2 : 1);
    auto spec = [&](const std::string& name) -> const ShardSpec& {
      return plan.specs[static_cast<std::size_t>(&local.find(name) - local.params().data())];
    };
    EXPECT_FALSE(spec("model.layers.2.mlp.gate.weight").sharded_by.has_value());
    EXPECT_EQ(spec("model.layers.2.mlp.gate.weight").partial_over,
              std::vector<MeshDim>{MeshDim::kTp});
    const ShardSpec& gu = spec("model.layers.2.mlp.experts.gate_up_proj");
    EXPECT_EQ(gu.axis, 1);
    EXPECT_EQ(gu.tp_blocks, 2);
    EXPECT_EQ(gu.global_shape, (std::vector<std::int64_t>{E, 2 * Im, H}));
    const ShardSpec& dn = spec("model.layers.2.mlp.experts.down_proj");
    EXPECT_EQ(dn.axis, 2);
    EXPECT_EQ(dn.global_shape, (std::vector<std::int64_t>{E, H, Im}));
    std::vector<int> written(global.numel(), 0);
    for (int t = 0; t < tp; ++t) {
      const TpMap map(global, local, plan, t);
      for (const LayoutMap::Segment& s : map.segments(Range{0, local.numel()}, true))
        for (std::size_t i = 0; i < s.count; ++i) ++written[s.global + i];
      std::vector<float> mine(local.numel(), -1.0f);
      const std::vector<FlatPiece> whole = {{Range{0, local.numel()}, mine.data()}};
      for (const FlatPiece& p : map.to_global(whole, false))
        for (std::size_t k = 0; k < p.range.size(); ++k) p.data[k] = values[p.range.begin + k];
      const ParamInfo& lgu = local.find("model.layers.2.mlp.experts.gate_up_proj");
      const ParamInfo& ggu = global.find("model.layers.2.mlp.experts.gate_up_proj");
      const ParamInfo& ldn = local.find("model.layers.2.mlp.experts.down_proj");
      const ParamInfo& gdn = global.find("model.layers.2.mlp.experts.down_proj");
      for (std::int64_t e : {std::int64_t{0}, E - 1})
        for (std::int64_t i : {std::int64_t{0}, Iml - 1})
          for (std::int64_t h : {std::int64_t{0}, H - 1}) {
            const std::int64_t col = t * Iml + i;  // the global column of the expert's width
            EXPECT_EQ(mine[lgu.offset + (e * 2 * Iml + i) * H + h],
                      values[ggu.offset + (e * 2 * Im + col) * H + h]) << "gate " << e;
            EXPECT_EQ(mine[lgu.offset + (e * 2 * Iml + Iml + i) * H + h],
                      values[ggu.offset + (e * 2 * Im + Im + col) * H + h]) << "up " << e;
            EXPECT_EQ(mine[ldn.offset + (e * H + h) * Iml + i],
                      values[gdn.offset + (e * H + h) * Im + col]) << "down " << e;
          }
    }
    EXPECT_EQ(std::count(written.begin(), written.end(), 1),
              static_cast<std::ptrdiff_t>(written.size()));
  }
}


// tp 2 x ep 2 and tp 2 x ep 4: rank (t, r) holds experts [r El, (r + 1) El), each with tp rank
// t's columns; TpEpMap writes every expert element once over the (tp, ep) ranks (every other
// element once per ep rank, as EpMap), and places the local ones at their global elements.
TEST(ExpertStorage, TpEpMapPlacesEachRanksExpertColumns) {
  const ModelConfig g = moe_model(true);
  const ParamLayout global(g);
  std::vector<float> values(global.numel());
  for (std::size_t k = 0; k < values.size(); ++k) values[k] = static_cast<float>(k);
  const int tp = 2;
  const std::int64_t Im = 12, Iml = Im / tp, H = 64;
  for (int ep : {2, 4}) {
    SCOPED_TRACE("ep " + std::to_string(ep));
    MeshShape mesh;
    mesh.tp = tp;
    mesh.dp = ep;
    mesh.ep = ep;
    const ModelConfig l = ep_local_config(tp_local_config(g, tp), ep);
    const ParamLayout local(l);
    const ShardPlan plan = plan_qwen3(l, local, mesh, 0);
    const std::int64_t El = 8 / ep;
    EXPECT_EQ(local.find("model.layers.0.mlp.experts.gate_up_proj").shape,
              (std::vector<std::int64_t>{El, 2 * Iml, H}));
    std::vector<int> written(global.numel(), 0);
    for (int t = 0; t < tp; ++t)
      for (int r = 0; r < ep; ++r) {
        const std::unique_ptr<LayoutMap> map = make_model_map(g, global, local, plan, mesh, t, r);
        ASSERT_NE(dynamic_cast<const TpEpMap*>(map.get()), nullptr);
        for (const LayoutMap::Segment& s : map->segments(Range{0, local.numel()}, true))
          for (std::size_t i = 0; i < s.count; ++i) ++written[s.global + i];
        std::vector<float> mine(local.numel(), -1.0f);
        const std::vector<FlatPiece> whole = {{Range{0, local.numel()}, mine.data()}};
        for (const FlatPiece& p : map->to_global(whole, false))
          for (std::size_t k = 0; k < p.range.size(); ++k) p.data[k] = values[p.range.begin + k];
        EXPECT_EQ(std::count(mine.begin(), mine.end(), -1.0f), 0);
        const ParamInfo& lgu = local.find("model.layers.0.mlp.experts.gate_up_proj");
        const ParamInfo& ggu = global.find("model.layers.0.mlp.experts.gate_up_proj");
        const ParamInfo& ldn = local.find("model.layers.0.mlp.experts.down_proj");
        const ParamInfo& gdn = global.find("model.layers.0.mlp.experts.down_proj");
        for (std::int64_t e : {std::int64_t{0}, El - 1}) {
          const std::int64_t ge = r * El + e, i = Iml - 1, h = 3, col = t * Iml + i;
          EXPECT_EQ(mine[lgu.offset + (e * 2 * Iml + Iml + i) * H + h],
                    values[ggu.offset + (ge * 2 * Im + Im + col) * H + h]) << "up " << e;
          EXPECT_EQ(mine[ldn.offset + (e * H + h) * Iml + i],
                    values[gdn.offset + (ge * H + h) * Im + col]) << "down " << e;
        }
      }
    for (const ParamInfo& p : global.params()) {
      const bool expert = p.name.find("mlp.experts.") != std::string::npos;
      for (std::size_t i = p.offset; i < p.offset + p.numel; ++i)
        ASSERT_EQ(written[i], expert ? 1 : ep) << p.name << " element " << i - p.offset;
    }
  }
}

}  // namespace
}  // namespace qt
