// The sharding plan: where every trained parameter lives on the mesh. Decided in one place
// (plan_qwen3), read by the optimizer driver, the checkpoints and the memory plan; the model code
// never sees a mesh.
//
// Two things are planned:
//   - ShardSpec, per parameter: its global shape, which mesh dimension shards it along which
//     axis (tensor parallelism: q/k/v and gate/up along their rows, o and down along their
//     columns; expert parallelism: the experts along axis 0 over ep), and over which dimensions
//     its copies are replicated (so that the gradient norm counts it once).
// Under expert parallelism (mesh.ep > 1) the layout is the ep rank's local one
// (ParamLayout(ep_local_config(cfg, ep)), parallel/expert_parallel.h): each sparse layer's
// experts, E / ep of them, are a unit of their own after the head, whose ZeRO shards spread over
// the expert-data-parallel group (Mesh::edp(), dp / ep ranks) instead of dp.
// Under tensor parallelism the layout the plan is made for is the tp rank's local one
// (ParamLayout(tp_local_config(cfg, tp)), parallel/tensor_parallel.h): the units and ZeRO shards
// below are ranges of it.
//   - Units: groups of parameters gathered, freed and reduced together (the embedding, each
//     decoder layer, the head). Each unit is a contiguous flat range of the layout; ZeRO splits
//     every unit evenly over dp, so gathering one layer touches each dp rank once:
//
//       unit u = [begin, end), chunk = ceil((end - begin) / dp)
//       dp rank r owns [begin + r * chunk, min(end, begin + (r + 1) * chunk))
//
// Every element of the layout is owned by exactly one dp rank at every ZeRO stage: the owner
// updates it (ZeRO >= 1), counts it in the gradient norm and writes it to checkpoints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qtrain/mesh.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"

namespace qt {

struct ShardSpec {
  std::vector<std::int64_t> global_shape;
  std::optional<MeshDim> sharded_by;      // none: every rank holding it holds all of it
  int axis = -1;                          // the sharded axis, when sharded_by is set
  std::vector<MeshDim> replicated_over;   // dimensions whose ranks hold identical copies
  // Dimensions over which each copy's gradient is only a partial sum, to be summed before the
  // update (q_norm and k_norm under tensor parallelism: each tp rank sees its own heads; with
  // sequence parallelism the other norms too: each tp rank sees its own rows).
  std::vector<MeshDim> partial_over;
  // Sharded over tp by groups of this many consecutive tp ranks holding the same rows (k_proj
  // and v_proj when the model has fewer key/value heads than tp ranks: tp rank r holds kv head
  // r / tp_replicas); the gradient is then partial over the group only (each rank's query heads),
  // and rank r % tp_replicas == 0's copy is the one checkpoints and the norm take.
  int tp_replicas = 1;
  // The sharded axis stacks this many tensors, each split over tp on its own: 2 for a Qwen3-MoE
  // layer's fused experts gate_up_proj [E, 2 Im, H] (gate rows [0, Im), up rows [Im, 2 Im)),
  // whose local [E, 2 Im/tp, H] holds each expert's gate and up rows of its tp rank.
  int tp_blocks = 1;

  bool replicated_over_dim(MeshDim d) const;
};

struct ParamUnit {
  std::string name;                 // "embed", "layers.3", "head", "experts.3", "adapters"
  Range range;                      // flat range of the layout
  // The group the unit's ZeRO shards spread over and its gradients are summed over: dp, or
  // for an expert unit the expert-data-parallel group (kEdp); dp: that group's size.
  MeshDim group = MeshDim::kDp;
  int dp = 1;                       // ranks the unit's ZeRO shards spread over
  std::size_t chunk = 0;            // ZeRO shard length: ceil(range.size() / dp); >= 1
  std::vector<std::size_t> params;  // indices into layout.params(), in flat order
  int stage = 0;                    // the pipeline stage that holds it (mesh.pp > 1)

  std::size_t padded() const { return chunk * dp; }  // range.size() rounded up to dp shards
  Range shard(int dp_rank) const;  // the flat range rank r of the unit's group owns
};

struct ShardPlan {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int zero_stage = 0;
  // Pipeline (pp > 1, plan_qwen3): the layers cut into pp x pp_chunks chunks, chunk c running
  // decoder layers [stage_layers[c], stage_layers[c + 1]) on stage c % pp, balanced by cost
  // (split_layers in parallel/pipeline_schedule.h), with the embedding on the first chunk and
  // the head on the last; each unit's `stage` says which stage holds it. A tied embedding is
  // also held, as a copy, by the last stage (for its lm head).
  int pp_chunks = 1;
  std::vector<int> stage_layers;
  std::vector<ShardSpec> specs;  // [layout.params().size()]
  std::vector<ParamUnit> units;  // in flat order; together they cover the layout exactly

  // The flat ranges rank r owns: one per unit (some may be empty); r is the rank in each unit's
  // group (dp, or expert-dp for expert units).
  std::vector<Range> owned(int rank) const;

  // One line per unit kind, for the start-up banner.
  std::string describe() const;
  // 0, 1, ..., units.size() - 1 (a pipeline stage holding every unit of its plan: LoRA's).
  std::vector<int> unit_indices() const;
};

// The units of a Qwen3 model's plan, by role: unit 0 the embedding, 1 + l decoder layer l,
// L + 1 the head (final norm, and lm_head unless tied to the embedding); in an expert-parallel
// rank's local layout (ModelConfig::expert_shards > 1) then L + 2 + m the experts of the m-th
// sparse layer (the layer unit keeps its router).
struct Qwen3Units {
  int num_layers = 0;
  int embed() const { return 0; }
  int layer(int l) const { return 1 + l; }
  int head() const { return num_layers + 1; }
  int experts(int m) const { return num_layers + 2 + m; }
};

// How tensor parallelism splits a Qwen3 tensor, by its name (Megatron's split): q/k/v_proj,
// gate/up_proj, the embedding and lm_head by rows over tp (the last two: vocabulary-parallel),
// o_proj and down_proj by columns, q_norm and k_norm replicated with partial gradients, the
// other norms replicated (with partial gradients too under sequence parallelism: plan_qwen3).
// Qwen3-MoE: every expert split as the dense MLP (experts.gate_up_proj [E, 2 Im, H] column-wise:
// axis 1, gate and up each; experts.down_proj [E, H, Im] row-wise: axis 2), the router
// (mlp.gate.weight) replicated with a partial gradient (each tp rank's routing-weight gradient
// is its experts' columns' part; model/cpu_ops_moe.cpp). kColumn splits a tensor's
// second-to-last axis, kRow its last.
enum class TpRole { kColumn, kRow, kPartial, kReplicated };
TpRole tp_role(const std::string& name);

// Collective-free and deterministic: every rank computes the same plan. Checks that the layout is
// the model's (embedding, layers, norm, lm head [, experts] in flat order). With mesh.tp > 1,
// `layout` is the tp rank's local layout (parallel/tensor_parallel.h) and `cfg` the local config;
// kv_replicas: the tp ranks sharing each key/value head (tp_kv_replicas), 1 when tp divides them.
// A MoE model at mesh.ep > 1 needs the ep rank's local config and layout (cfg.expert_shards =
// mesh.ep); a local config with mesh.ep = 1 is planned for dp 1 only (the program's unit ranges).
ShardPlan plan_qwen3(const ModelConfig& cfg, const ParamLayout& layout, const MeshShape& mesh,
                     int zero_stage, int kv_replicas = 1);
// The decoder layers of each of mesh.pp x mesh.pp_chunks pipeline chunks, as [chunks + 1]
// boundaries (chunk c runs layers [b[c], b[c + 1]) on stage c % pp): mesh.pp_layers when given,
// else balanced by FLOPs a token (a layer's projections each; the lm head on the last chunk).
// The same for the global model and a tp rank's (tp divides every term). {0, L} at pp 1.
std::vector<int> pipeline_layer_bounds(const ModelConfig& cfg, const MeshShape& mesh);

// Every tensor of `layout` in one unit named `name` (e.g. LoRA adapters), replicated over dp;
// kv_replicas as plan_qwen3's (the k/v adapters' B factors share their kv head's rows).
ShardPlan plan_one_unit(const ParamLayout& layout, const std::string& name, const MeshShape& mesh,
                        int zero_stage, int kv_replicas = 1);

// LoRA adapters (model/lora.h lora_layout of a rank's local model): one unit over dp, as
// plan_one_unit, unless adapters on every expert meet mesh.ep > 1: then each run of dense
// adapters is a unit over dp and each run of the experts' stacked adapters (the ep rank's
// E / ep rows) a unit over the expert-data-parallel group, sharded over ep like the experts.
ShardPlan plan_adapters(const ParamLayout& layout, const MeshShape& mesh, int zero_stage,
                        int kv_replicas = 1);

}  // namespace qt
