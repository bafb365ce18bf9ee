// Tensor parallelism's arithmetic: the local model and the local-to-global element map.
#include "parallel/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>

#include "qtrain/error.h"

namespace qt {

int tp_kv_replicas(const ModelConfig& cfg, int tp) {
  return tp > cfg.num_kv_heads ? tp / cfg.num_kv_heads : 1;
}

std::optional<TpSplitMiss> tp_split_miss(const ModelConfig& cfg, int tp) {
  if (cfg.num_heads % tp != 0) return TpSplitMiss{"model.num_heads", cfg.num_heads};
  if (!tp_fits_kv_heads(cfg.num_kv_heads, tp))
    return TpSplitMiss{"model.num_kv_heads", cfg.num_kv_heads};
  if (cfg.intermediate_size % tp != 0)
    return TpSplitMiss{"model.intermediate_size", cfg.intermediate_size};
  if (cfg.vocab_size % tp != 0) return TpSplitMiss{"model.vocab_size", cfg.vocab_size};
  if (cfg.is_moe() && cfg.moe_intermediate_size % tp != 0)  // every expert's width
    return TpSplitMiss{"model.moe_intermediate_size", cfg.moe_intermediate_size};
  return std::nullopt;
}

ModelConfig tp_local_config(const ModelConfig& cfg, int tp) {
  QT_CHECK(tp >= 1 && cfg.num_heads % tp == 0 &&
               tp_fits_kv_heads(cfg.num_kv_heads, tp) &&
               cfg.intermediate_size % tp == 0 && cfg.vocab_size % tp == 0 &&
               (!cfg.is_moe() || cfg.moe_intermediate_size % tp == 0),
           "tp {} must divide the heads {}, the MLP width {}, the experts' width {} and the "
           "vocabulary {}, and divide or be a multiple of the key/value heads {}",
           tp, cfg.num_heads, cfg.intermediate_size, cfg.moe_intermediate_size, cfg.vocab_size,
           cfg.num_kv_heads);
  ModelConfig c = cfg;
  c.num_heads /= tp;
  c.num_kv_heads /= tp / tp_kv_replicas(cfg, tp);  // one kv head a rank when tp exceeds them
  c.intermediate_size /= tp;
  if (c.is_moe()) c.moe_intermediate_size /= tp;  // every expert split as the dense MLP
  c.vocab_size /= tp;
  return c;
}

TpMap::TpMap(const ParamLayout& global, const ParamLayout& local, const ShardPlan& plan,
             int tp_rank)
    : global_(global), local_(local), plan_(plan), tp_rank_(tp_rank) {
  const auto& g = global.params();
  const auto& l = local.params();
  QT_CHECK(g.size() >= l.size() && plan.specs.size() == l.size(),
           "TpMap: {} global tensors, {} local, {} specs", g.size(), l.size(), plan.specs.size());
  // Each local tensor's global one, by name, in the same order (a forward scan).
  std::size_t j = 0;
  for (std::size_t i = 0; i < l.size(); ++i, ++j) {
    while (j < g.size() && g[j].name != l[i].name) ++j;
    QT_CHECK(j < g.size() && g[j].shape == plan.specs[i].global_shape,
             "TpMap: local tensor {} ({}) has no global tensor of its name and shape", i,
             l[i].name);
    const ShardSpec& spec = plan.specs[i];
    QT_CHECK(!spec.sharded_by || (spec.axis >= 0 && spec.axis < static_cast<int>(l[i].shape.size()) &&
                                  l[i].shape[spec.axis] % spec.tp_blocks == 0),
             "TpMap: {} sharded on axis {} in {} blocks", l[i].name, spec.axis, spec.tp_blocks);
    global_of_.push_back(j);
  }
}

std::vector<TpMap::Segment> TpMap::segments(Range r, bool writing) const {
  std::vector<Segment> out;
  const auto& ls = local_.params();
  const auto& gs = global_.params();
  for (std::size_t i = 0; i < ls.size(); ++i) {
    const ParamInfo& L = ls[i];
    const std::size_t lo = std::max(r.begin, L.offset), hi = std::min(r.end, L.offset + L.numel);
    if (lo >= hi) continue;
    const ShardSpec& spec = plan_.specs[i];
    const ParamInfo& G = gs[global_of_[i]];
    const std::size_t g0 = G.offset, at = lo - L.offset;
    if (!spec.sharded_by) {
      if (writing && tp_rank_ != 0 && spec.replicated_over_dim(MeshDim::kTp)) continue;
      out.push_back({lo, g0 + at, hi - lo});
    } else {
      // The tensor as [outer, row]: outer = the axes before the sharded one (times tp_blocks,
      // its stacked tensors), row = the sharded axis and those after it. The local row is
      // block t of the global one ([outer, shards x row]), t = tp_rank / tp_replicas (a group of
      // tp_replicas ranks shares one block: its first writes it). [out, in] by rows: one range;
      // by columns, and every expert tensor: a range per outer row.
      if (writing && tp_rank_ % spec.tp_replicas != 0) continue;
      std::size_t outer = static_cast<std::size_t>(spec.tp_blocks);
      for (int d = 0; d < spec.axis; ++d) outer *= static_cast<std::size_t>(L.shape[d]);
      const std::size_t row = L.numel / outer;      // local elements of one outer row
      const std::size_t shards = G.numel / L.numel;  // tp / tp_replicas
      const std::size_t t = static_cast<std::size_t>(tp_rank_ / spec.tp_replicas);
      for (std::size_t pos = lo; pos < hi;) {
        const std::size_t o = (pos - L.offset) / row, in_row = (pos - L.offset) % row;
        const std::size_t n = std::min(hi - pos, row - in_row);
        out.push_back({pos, g0 + (o * shards + t) * row + in_row, n});
        pos += n;
      }
    }
  }
  return out;
}

std::string describe_tp(const ModelConfig& local, int tp, bool sequence_parallel) {
  return fmt::format("tensor parallel over {} ranks: each runs {} query and {} key/value heads "
                     "and {} MLP columns{}{}",
                     tp, local.num_heads, local.num_kv_heads, local.intermediate_size,
                     local.is_moe() ? fmt::format(" ({} of each expert, the router whole)",
                                                  local.moe_intermediate_size)
                                    : std::string(),
                     sequence_parallel ? ", and the norms and residual adds on 1/" +
                                             std::to_string(tp) + " of the rows (sequence "
                                             "parallel)"
                                       : "");
}

}  // namespace qt
