// The sharding plan (include/qtrain/shard_plan.h).
#include "qtrain/shard_plan.h"

#include "parallel/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>

#include "qtrain/error.h"

namespace qt {

Range ParamUnit::shard(int dp_rank) const {
  QT_CHECK(dp_rank >= 0 && dp_rank < dp, "dp rank {} of {}", dp_rank, dp);
  const std::size_t lo = std::min(range.size(), chunk * static_cast<std::size_t>(dp_rank));
  const std::size_t hi = std::min(range.size(), chunk * static_cast<std::size_t>(dp_rank + 1));
  return Range{range.begin + lo, range.begin + hi};
}

std::vector<Range> ShardPlan::owned(int rank) const {
  std::vector<Range> out;
  out.reserve(units.size());
  for (const ParamUnit& u : units) out.push_back(u.shard(rank));
  return out;
}

std::vector<int> ShardPlan::unit_indices() const {
  std::vector<int> u(units.size());
  for (std::size_t i = 0; i < u.size(); ++i) u[i] = static_cast<int>(i);
  return u;
}

std::string ShardPlan::describe() const {
  const char* what[4] = {"everything replicated", "AdamW state sharded",
                         "AdamW state and gradients sharded",
                         "AdamW state, gradients and parameters sharded"};
  std::size_t largest = 0;
  for (const ParamUnit& u : units) largest = std::max(largest, u.range.size());
  std::string d = fmt::format("ZeRO-{} over dp {} ({}), {} units, the largest {} parameters",
                              zero_stage, dp, what[std::clamp(zero_stage, 0, 3)], units.size(),
                              largest);
  int experts = 0, edp = 1;
  for (const ParamUnit& u : units)
    if (u.group == MeshDim::kEdp) ++experts, edp = u.dp;
  if (experts > 0)
    d += fmt::format("; each sparse layer's experts a unit of their own ({}), this rank's share "
                     "of them sharded over expert-dp {}",
                     experts, edp);
  if (pp > 1) {
    d += pp_chunks > 1 ? fmt::format("; pipeline chunks (stage {}) of layers", "c % " +
                                                                             std::to_string(pp))
                       : std::string("; pipeline stages of layers");
    for (std::size_t c = 0; c + 1 < stage_layers.size(); ++c)
      d += fmt::format(" {}..{}", stage_layers[c], stage_layers[c + 1] - 1);
  }
  return d;
}

namespace {

// A unit of the layout's tensors [first, last), contiguous in flat order.
ParamUnit make_unit(const ParamLayout& layout, std::string name, std::size_t first,
                    std::size_t last, int dp) {
  const auto& ps = layout.params();
  QT_CHECK(first < last && last <= ps.size(), "unit {}: tensors [{}, {})", name, first, last);
  ParamUnit u;
  u.name = std::move(name);
  u.range = Range{ps[first].offset, ps[first].offset};
  for (std::size_t i = first; i < last; ++i) {
    QT_CHECK(ps[i].offset == u.range.end, "unit {}: {} is not contiguous", u.name, ps[i].name);
    u.range.end += ps[i].numel;
    u.params.push_back(i);
  }
  u.dp = dp;
  u.chunk = std::max<std::size_t>(1, (u.range.size() + dp - 1) / dp);
  return u;
}

bool ends_with(const std::string& name, const std::string& tail) {
  return name.size() >= tail.size() &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

// Rows of the key/value projections (their LoRA B factors too): one kv head's on each tp rank.
bool holds_kv_rows(const std::string& name) {
  for (const char* t : {"k_proj.weight", "v_proj.weight", "k_proj.lora_B.weight",
                        "v_proj.lora_B.weight"})
    if (ends_with(name, t)) return true;
  return false;
}

// kv_replicas > 1: tp ranks in groups of that many share a kv head (tp_kv_replicas).
ShardPlan plan_base(const ParamLayout& layout, const MeshShape& mesh, int zero_stage,
                    int kv_replicas) {
  QT_CHECK(zero_stage >= 0 && zero_stage <= 3, "ZeRO stage {}", zero_stage);
  QT_CHECK(kv_replicas >= 1 && mesh.tp % kv_replicas == 0, "kv heads shared by {} of {} tp ranks",
           kv_replicas, mesh.tp);
  ShardPlan plan;
  plan.dp = mesh.dp;
  plan.tp = mesh.tp;
  plan.pp = mesh.pp;
  plan.zero_stage = zero_stage;
  for (const ParamInfo& p : layout.params()) {
    ShardSpec s;
    s.global_shape = p.shape;
    s.replicated_over = {MeshDim::kDp};  // ZeRO shards storage, not the tensor's meaning
    if (mesh.tp > 1) {  // the layout is the tp rank's local one
      const int rank = static_cast<int>(p.shape.size());
      switch (tp_role(p.name)) {
        case TpRole::kColumn:  // [out, in] by rows; an experts' [E, out, in] by each's rows
          s.sharded_by = MeshDim::kTp, s.axis = rank - 2, s.global_shape[rank - 2] *= mesh.tp;
          if (ends_with(p.name, "experts.gate_up_proj") ||
              ends_with(p.name, "experts.gate_up_proj.lora_B.weight"))
            s.tp_blocks = 2;  // gate; up (an expert adapter's B [E, 2 Im, r] alike)
          break;
        case TpRole::kRow:  // [out, in] by columns; an experts' [E, out, in] by each's columns
          s.sharded_by = MeshDim::kTp, s.axis = rank - 1, s.global_shape[rank - 1] *= mesh.tp;
          break;
        case TpRole::kPartial:
          s.partial_over = {MeshDim::kTp};
          s.replicated_over.push_back(MeshDim::kTp);
          break;
        case TpRole::kReplicated:
          // Sequence parallelism: each tp rank norms its own rows, so its gradient is partial.
          if (mesh.seq_parallel() > 1) s.partial_over = {MeshDim::kTp};
          s.replicated_over.push_back(MeshDim::kTp);
          break;
      }
      if (kv_replicas > 1 && holds_kv_rows(p.name)) {  // the kv head's rows on its group
        s.global_shape[0] = p.shape[0] * (mesh.tp / kv_replicas);
        s.tp_replicas = kv_replicas;
        s.partial_over = {MeshDim::kTp};  // each rank's query heads' part, summed over the group
      }
    }
    plan.specs.push_back(std::move(s));
  }
  return plan;
}

}  // namespace

bool ShardSpec::replicated_over_dim(MeshDim d) const {
  for (MeshDim r : replicated_over)
    if (r == d) return true;
  return false;
}

TpRole tp_role(const std::string& name) {
  auto ends = [&name](const std::string& t) {
    return name.size() >= t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
  };
  for (const char* c : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                        "up_proj.weight", "embed_tokens.weight", "lm_head.weight"})
    if (ends(c)) return TpRole::kColumn;
  if (ends("o_proj.weight") || ends("down_proj.weight")) return TpRole::kRow;
  if (ends("q_norm.weight") || ends("k_norm.weight")) return TpRole::kPartial;
  if (ends("mlp.experts.gate_up_proj")) return TpRole::kColumn;  // Qwen3-MoE
  if (ends("mlp.experts.down_proj")) return TpRole::kRow;
  if (ends("mlp.gate.weight")) return TpRole::kPartial;
  // Adapters on every expert (stacked A [E, r, in], B [E, out, r]) as the dense ones below.
  if (ends("mlp.experts.gate_up_proj.lora_A.weight")) return TpRole::kPartial;
  if (ends("mlp.experts.gate_up_proj.lora_B.weight")) return TpRole::kColumn;
  if (ends("mlp.experts.down_proj.lora_A.weight")) return TpRole::kRow;
  if (ends("mlp.experts.down_proj.lora_B.weight")) return TpRole::kPartial;
  // LoRA adapters follow their base projection (A [r, in], B [out, r]): beside a
  // column-parallel one, B holds its rows and A is whole with a gradient partial over tp (each
  // rank's rows of B see part of it); beside a row-parallel one, A holds its columns and B is
  // whole with a partial gradient.
  for (const char* c : {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}) {
    if (ends(std::string(c) + ".lora_A.weight")) return TpRole::kPartial;
    if (ends(std::string(c) + ".lora_B.weight")) return TpRole::kColumn;
  }
  for (const char* r : {"o_proj", "down_proj"}) {
    if (ends(std::string(r) + ".lora_A.weight")) return TpRole::kRow;
    if (ends(std::string(r) + ".lora_B.weight")) return TpRole::kPartial;
  }
  return TpRole::kReplicated;
}

ShardPlan plan_qwen3(const ModelConfig& cfg, const ParamLayout& layout, const MeshShape& mesh,
                     int zero_stage, int kv_replicas) {
  ShardPlan plan = plan_base(layout, mesh, zero_stage, kv_replicas);
  const auto& ps = layout.params();
  const ModelOffsets& off = layout.model_offsets();
  const int L = cfg.num_layers, shards = cfg.expert_shards;
  QT_CHECK(static_cast<int>(off.layers.size()) == L && !ps.empty() &&
               ps.front().name == "model.embed_tokens.weight",
           "plan_qwen3: the layout is not the model's ({} tensors)", ps.size());
  // Experts stored split (shards > 1) need the mesh's ep, or a dp-1 plan of unit ranges.
  QT_CHECK(!cfg.is_moe() || mesh.ep == shards || (shards > 1 && mesh.ep == 1 && mesh.dp == 1),
           "plan_qwen3: mesh.ep = {} for a layout of experts stored over {} ranks "
           "(ep_local_config)", mesh.ep, shards);
  // The tensor index at flat offset `o` (offsets ascend with the index).
  auto index_at = [&](std::size_t o) {
    auto it = std::lower_bound(ps.begin(), ps.end(), o,
                               [](const ParamInfo& p, std::size_t x) { return p.offset < x; });
    QT_CHECK(it != ps.end() && it->offset == o, "plan_qwen3: no tensor at offset {}", o);
    return static_cast<std::size_t>(it - ps.begin());
  };
  const std::size_t head = index_at(off.norm);
  std::vector<std::size_t> first(L + 1, head);  // each layer's first tensor, then the head's
  for (int l = 0; l < L; ++l) first[l] = index_at(off.layers[l].ln1);
  std::vector<int> sparse;  // layers whose experts are units of their own
  if (shards > 1)
    for (int l = 0; l < L; ++l)
      if (off.layers[l].moe) sparse.push_back(l);
  const std::size_t head_end =
      sparse.empty() ? ps.size() : index_at(off.layers[sparse.front()].experts_gate_up);
  plan.units.push_back(make_unit(layout, "embed", 0, L > 0 ? first[0] : head, mesh.dp));
  for (int l = 0; l < L; ++l)
    plan.units.push_back(make_unit(layout, fmt::format("layers.{}", l), first[l], first[l + 1],
                                   mesh.dp));
  plan.units.push_back(make_unit(layout, "head", head, head_end, mesh.dp));
  QT_CHECK(ps[head].name == "model.norm.weight", "plan_qwen3: {} where the final norm belongs",
           ps[head].name);
  // Each sparse layer's experts (gate_up, down): rows [r El, (r + 1) El) of the global tensors on
  // ep rank r, replicated over (and ZeRO-sharded over) the expert-data-parallel group. With
  // tp > 1 too, each holds its tp rank's columns (plan_base's split, kept in global_shape;
  // parallel/expert_parallel.h's TpEpMap maps both).
  const int edp = mesh.dp / mesh.ep;
  for (int l : sparse) {
    const std::size_t i = index_at(off.layers[l].experts_gate_up);
    ParamUnit u = make_unit(layout, fmt::format("experts.{}", l), i, i + 2, edp);
    u.group = MeshDim::kEdp;
    for (std::size_t t : u.params) {
      ShardSpec& spec = plan.specs[t];
      spec.sharded_by = MeshDim::kEp;
      spec.axis = 0;
      spec.global_shape[0] *= shards;
      spec.replicated_over = {MeshDim::kEdp};
    }
    plan.units.push_back(std::move(u));
  }
  QT_CHECK(plan.units.back().range.end == layout.numel(), "plan_qwen3: tensors after the {}",
           plan.units.back().name);
  plan.pp_chunks = mesh.pp > 1 ? mesh.pp_chunks : 1;
  plan.stage_layers = pipeline_layer_bounds(cfg, mesh);
  if (mesh.pp > 1) {
    const Qwen3Units units{L};
    for (int c = 0; c + 1 < static_cast<int>(plan.stage_layers.size()); ++c)
      for (int l = plan.stage_layers[c]; l < plan.stage_layers[c + 1]; ++l)
        plan.units[units.layer(l)].stage = c % mesh.pp;
    plan.units[units.head()].stage = mesh.pp - 1;  // the embedding stays on stage 0
    for (std::size_t m = 0; m < sparse.size(); ++m)  // a layer's experts on its stage
      plan.units[units.experts(static_cast<int>(m))].stage =
          plan.units[units.layer(sparse[m])].stage;
  }
  return plan;
}

std::vector<int> pipeline_layer_bounds(const ModelConfig& cfg, const MeshShape& mesh) {
  if (mesh.pp <= 1) return {0, cfg.num_layers};
  // Costs in FLOPs a token: a layer's projections, and the lm head on the last stage.
  const double H = cfg.hidden_size;
  const double layer = 2 * H * (cfg.q_dim() + 2.0 * cfg.kv_dim()) + 2.0 * cfg.q_dim() * H +
                       6.0 * H * cfg.intermediate_size;
  const int chunks = mesh.pp * mesh.pp_chunks;
  return mesh.pp_layers.empty()
             ? split_layers(cfg.num_layers, chunks, layer, 0, 2 * H * cfg.vocab_size)
             : layer_bounds_from_counts(mesh.pp_layers, chunks, cfg.num_layers);
}

ShardPlan plan_one_unit(const ParamLayout& layout, const std::string& name, const MeshShape& mesh,
                        int zero_stage, int kv_replicas) {
  ShardPlan plan = plan_base(layout, mesh, zero_stage, kv_replicas);
  plan.units.push_back(make_unit(layout, name, 0, layout.params().size(), mesh.dp));
  return plan;
}

ShardPlan plan_adapters(const ParamLayout& layout, const MeshShape& mesh, int zero_stage,
                        int kv_replicas) {
  const auto& ps = layout.params();
  const auto on_experts = [&](std::size_t i) {
    return ps[i].name.find(".mlp.experts.") != std::string::npos;
  };
  bool any_experts = false;
  for (std::size_t i = 0; i < ps.size(); ++i) any_experts = any_experts || on_experts(i);
  if (mesh.ep == 1 || !any_experts)
    return plan_one_unit(layout, "adapters", mesh, zero_stage, kv_replicas);
  // Each run of consecutive tensors of one kind a unit: the dense adapters over dp; the experts'
  // (this ep rank's E / ep rows of the stacked [E, ...] tensors) over expert-dp, as plan_qwen3's
  // expert units (a tp split, if any, kept in global_shape for TpEpMap).
  ShardPlan plan = plan_base(layout, mesh, zero_stage, kv_replicas);
  const int edp = mesh.dp / mesh.ep;
  for (std::size_t first = 0; first < ps.size();) {
    std::size_t last = first + 1;
    while (last < ps.size() && on_experts(last) == on_experts(first)) ++last;
    if (!on_experts(first)) {
      plan.units.push_back(
          make_unit(layout, fmt::format("adapters.{}", plan.units.size()), first, last, mesh.dp));
    } else {
      ParamUnit u = make_unit(layout, fmt::format("expert_adapters.{}", plan.units.size()), first,
                              last, edp);
      u.group = MeshDim::kEdp;
      for (std::size_t t : u.params) {
        ShardSpec& spec = plan.specs[t];
        spec.sharded_by = MeshDim::kEp;
        spec.axis = 0;
        spec.global_shape[0] *= mesh.ep;
        spec.replicated_over = {MeshDim::kEdp};
      }
      plan.units.push_back(std::move(u));
    }
    first = last;
  }
  return plan;
}

}  // namespace qt
