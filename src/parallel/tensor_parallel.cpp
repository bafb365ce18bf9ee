// Tensor parallelism's arithmetic: the local model and the local-to-global element map.
#include "parallel/tensor_parallel.h"

#include <fmt/format.h>

#include <algorithm>

#include "qtrain/error.h"

namespace qt {

int tp_kv_replicas(const ModelConfig& cfg, int tp) {
  return tp > cfg.num_kv_heads ? tp / cfg.num_kv_heads : 1;
}

ModelConfig tp_local_config(const ModelConfig& cfg, int tp) {
  QT_CHECK(tp >= 1 && cfg.num_heads % tp == 0 &&
               tp_fits_kv_heads(cfg.num_kv_heads, tp) &&
               cfg.intermediate_size % tp == 0 && cfg.vocab_size % tp == 0,
           "tp {} must divide the heads {}, the MLP width {} and the vocabulary {}, and divide or "
           "be a multiple of the key/value heads {}",
           tp, cfg.num_heads, cfg.intermediate_size, cfg.vocab_size, cfg.num_kv_heads);
  ModelConfig c = cfg;
  c.num_heads /= tp;
  c.num_kv_heads /= tp / tp_kv_replicas(cfg, tp);  // one kv head a rank when tp exceeds them
  c.intermediate_size /= tp;
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
    QT_CHECK(!plan.specs[i].sharded_by || l[i].shape.size() == 2, "TpMap: {} sharded but not 2-D",
             l[i].name);
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
    } else if (spec.axis == 0) {  // rows t * rows_local ...: one contiguous global range
      // (tp_replicas ranks in a row share one block: its first writes it)
      if (writing && tp_rank_ % spec.tp_replicas != 0) continue;
      const std::size_t block = static_cast<std::size_t>(L.numel);
      out.push_back({lo, g0 + (tp_rank_ / spec.tp_replicas) * block + at, hi - lo});
    } else {  // columns t * cols_local ... of every row: a global range per row
      const std::size_t cols = static_cast<std::size_t>(L.shape[1]);
      const std::size_t global_cols = static_cast<std::size_t>(G.shape[1]);
      for (std::size_t pos = lo; pos < hi;) {
        const std::size_t row = (pos - L.offset) / cols, col = (pos - L.offset) % cols;
        const std::size_t n = std::min(hi - pos, cols - col);
        out.push_back({pos, g0 + row * global_cols + tp_rank_ * cols + col, n});
        pos += n;
      }
    }
  }
  return out;
}

std::string describe_tp(const ModelConfig& local, int tp, bool sequence_parallel) {
  return fmt::format("tensor parallel over {} ranks: each runs {} query and {} key/value heads "
                     "and {} MLP columns{}",
                     tp, local.num_heads, local.num_kv_heads, local.intermediate_size,
                     sequence_parallel ? ", and the norms and residual adds on 1/" +
                                             std::to_string(tp) + " of the rows (sequence "
                                             "parallel)"
                                       : "");
}

}  // namespace qt
