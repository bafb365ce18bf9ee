// Tensor parallelism's arithmetic (Megatron's split, include/qtrain/shard_plan.h's TpRole): the
// model a tp rank runs, and where the elements of its local layout live in the global one.
//
// A tp rank runs the layer program on a local model: tp_local_config divides the query and
// key/value heads, the MLP width and the vocabulary by tp (the embedding and the lm head are
// vocabulary-parallel: model/vocab_parallel.h); the local layout (ParamLayout of that config)
// keeps the global tensor names and order with local shapes. Column-parallel tensors [out, in] hold
// rows [t * out/tp, (t + 1) * out/tp) of the global tensor (one contiguous global range),
// row-parallel tensors hold columns [t * in/tp, (t + 1) * in/tp) of every row (one global range
// per row), replicated tensors all of it.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "parallel/layout_map.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

// The model of one tp rank: num_heads, num_kv_heads, intermediate_size, vocab_size and a
// Qwen3-MoE model's moe_intermediate_size (each expert's width; the experts and the router stay
// whole in number) divided by tp (which must divide each: the deck checks it with a clear
// message), except that with more tp
// ranks than key/value heads (tp a multiple of them) each rank holds one kv head, shared by
// tp_kv_replicas consecutive ranks (Megatron's replication; the plan's ShardSpec::tp_replicas).
ModelConfig tp_local_config(const ModelConfig& cfg, int tp);
// tp splits `kv_heads` key/value heads evenly: it divides them, or is a multiple of them (each
// head shared by tp / kv_heads ranks).
inline bool tp_fits_kv_heads(int kv_heads, int tp) {
  return kv_heads % tp == 0 || tp % kv_heads == 0;
}
int tp_kv_replicas(const ModelConfig& cfg, int tp);
// The first of the model's widths that tp does not split evenly (the heads, the key/value
// heads, the MLP width, the vocabulary, a Qwen3-MoE model's expert width), as its deck key and
// value; none when tp splits them all.
struct TpSplitMiss {
  const char* key;
  int n;
};
std::optional<TpSplitMiss> tp_split_miss(const ModelConfig& cfg, int tp);

class TpMap final : public LayoutMap {
 public:
  // global: the model's layout; local: ParamLayout(tp_local_config(cfg, tp)); plan: made for
  // the local layout; tp_rank: this rank's index in its tp group. The local layout may hold
  // only some of the global one's tensors (a pipeline stage's LoRA adapters), found by name in
  // the same order; with tp = 1 the map then only moves them to their global offsets.
  TpMap(const ParamLayout& global, const ParamLayout& local, const ShardPlan& plan, int tp_rank);

  // The segments of the local flat range r, in local order. writing: leave out tensors
  // replicated over tp unless this is tp rank 0, so that over all ranks a checkpoint gets each
  // global element once.
  std::vector<Segment> segments(Range r, bool writing) const override;

 private:
  const ParamLayout& global_;
  const ParamLayout& local_;
  const ShardPlan& plan_;
  int tp_rank_;
  std::vector<std::size_t> global_of_;  // [local tensors] the index of each in global_
};

// "tensor parallel over tp ranks: each runs ..." for a back end's description (local: the tp
// rank's model, tp_local_config), with sequence parallelism or without.
std::string describe_tp(const ModelConfig& local, int tp, bool sequence_parallel);

}  // namespace qt
