// LoRA on a pipeline stage of the CPU back end (train/backend_cpu_pipeline.cpp): the frozen base
// of the units the stage holds, and the adapters of its chunks' layers.
//
// The stage's adapter layout is its chunks' lora_layout (of the tp rank's local model), chunk
// after chunk (chunk v P + s for v < pp_chunks, layers ascending); one LoraAdapters a chunk is
// bound into that one buffer (the optimizer's units: plan_adapters). Its tensors keep the
// model's names, so lora_map (model/lora.h: a TpMap, or TpEpMap for the experts' adapters at
// ep > 1) takes them to the model's global adapter layout at any tp and ep: checkpoints and PEFT
// export see the global tensors, and a pipeline's checkpoint resumes on any other mesh.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/lora.h"
#include "model/model_params.h"
#include "optim/sharded_state.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/mesh.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

class StageLora final : public ModelParams {
 public:
  // A chunk's layers [first_layer, last_layer) and its activation slots.
  struct ChunkLayers {
    int first_layer, last_layer, slots;
  };

  // local: the tp rank's model (tp_local_config); model_plan: its plan (the base's units);
  // held: the units this stage holds (its chunks' and a tied copy); pp: the pipeline's
  // communicator (the adapters' gradient norm is summed over it); mesh: the run's.
  StageLora(const Deck& deck, const ModelConfig& local, const ShardPlan& model_plan,
            const std::vector<int>& held, const std::vector<ChunkLayers>& chunks,
            const MeshShape& mesh, Comm* pp, int tp_rank, int ep_rank);

  // ModelParams over the frozen base: the held units' weights, no gradients.
  const float* params(int unit) override;
  float* grads(int) override { return nullptr; }
  // The held units' base pieces in the local layout (fill them to initialise or load).
  std::vector<FlatPiece> base_pieces();
  double base_bytes() const { return 4.0 * static_cast<double>(base_.size()); }

  LoraAdapters& chunk(int v) { return *adapters_.at(static_cast<std::size_t>(v)); }
  // The stage's adapters (local layout), their plan (plan_adapters) and the optimizer's share
  // (every unit of it held).
  const ParamLayout& layout() const { return layout_; }
  const ShardPlan& plan() const { return plan_; }
  const PipelineShare& share() const { return share_; }
  // The model's adapter layout (global) and the map of the stage's into it.
  const ParamLayout& global_layout() const { return global_layout_; }
  const LayoutMap* map() const { return map_.get(); }  // null: the global layout

  // Binds every chunk's adapters to the stage's buffers (plan()'s units of layout()).
  void bind(const AdapterBuffers<float>& buffers);
  // Keys every chunk's dropout masks (LoraAdapters::set_dropout_key).
  void set_dropout_key(std::uint64_t seed, std::int64_t first_sample);

 private:
  static ParamLayout stage_layout(const ModelConfig& local, const LoraConfig& lora,
                                  const std::vector<ChunkLayers>& chunks);

  std::vector<float> base_;              // the held units' frozen weights, one after another
  std::vector<std::int64_t> base_at_;    // [units] each held unit's offset in base_, or -1
  std::vector<Range> base_ranges_;       // [units] each unit's range in the local layout
  ParamLayout layout_;                   // the stage's adapters (local shapes)
  ParamLayout global_layout_;            // the model's adapters
  ShardPlan plan_;                       // layout_'s units (plan_adapters)
  std::unique_ptr<LayoutMap> map_;       // layout_ -> global_layout_ (lora_map)
  PipelineShare share_;                  // every unit held; the norm summed over pp
  std::vector<std::unique_ptr<LoraAdapters>> adapters_;  // [chunks]
  std::vector<std::size_t> offset_;      // [chunks] each chunk's first element in layout_
};

}  // namespace qt
