// Layout of all model parameters in one flat fp32 buffer.
//
// Every parameter is a row-major tensor with transformers' name and shape ([out, in] for
// Linear), stored at `offset` in the flat buffer. Gradients and AdamW moments use the same layout,
// so ZeRO-1 shards are plain ranges of the flat buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "qtrain/model_config.h"

namespace qt {

struct ParamInfo {
  std::string name;                  // e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<std::int64_t> shape;   // global shape
  std::size_t offset = 0;            // elements from the start of the flat buffer
  std::size_t numel = 0;
  bool weight_decay = true;          // false for norm weights (1-D)
};

// Flat-buffer offsets of one decoder layer's parameters: a dense MLP's w_gate, w_up, w_down, or a
// sparse block's (moe) router [E, H], experts_gate_up [El, 2 Im, H] and experts_down [El, H, Im]
// (the other set 0). El = E, right after the router, except in an expert-parallel rank's local
// layout (ModelConfig::expert_shards > 1): El = E / expert_shards, after the head.
struct LayerOffsets {
  std::size_t ln1 = 0, wq = 0, wk = 0, wv = 0, wo = 0, q_norm = 0, k_norm = 0, ln2 = 0;
  std::size_t w_gate = 0, w_up = 0, w_down = 0;
  bool moe = false;
  std::size_t router = 0, experts_gate_up = 0, experts_down = 0;
};

// Flat-buffer offsets of a whole model's parameters. lm_head is the embedding's offset when the
// embeddings are tied.
struct ModelOffsets {
  std::size_t embed = 0, norm = 0, lm_head = 0;
  std::vector<LayerOffsets> layers;  // [num_layers]
};

class ParamLayout {
 public:
  explicit ParamLayout(const ModelConfig& cfg);
  // A layout of other tensors (e.g. LoRA adapters), in the given order: (name, shape) each;
  // weight decay for tensors of two or more dimensions, as in the model's layout.
  explicit ParamLayout(
      const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& tensors);

  const std::vector<ParamInfo>& params() const { return params_; }
  std::size_t numel() const { return numel_; }
  const ParamInfo& find(const std::string& name) const;  // aborts if absent
  // Only for a model's layout (the ModelConfig constructor); aborts for another.
  const ModelOffsets& model_offsets() const;

 private:
  std::size_t add(std::string name, std::vector<std::int64_t> shape);  // returns its offset
  void add_experts(const ModelConfig& c, int l, LayerOffsets& o);      // layer l's two tensors

  std::vector<ParamInfo> params_;
  std::size_t numel_ = 0;
  std::optional<ModelOffsets> model_;  // set by the ModelConfig constructor
};

// An even split of [0, n) into `parts` ranges; range i is [begin, end).
// Used for ZeRO-1 shards and for the partition of checkpoint writes.
struct Range {
  std::size_t begin = 0, end = 0;
  std::size_t size() const { return end - begin; }
};
Range split_range(std::size_t n, int parts, int i);

// A flat range of a layout held in memory: elements [range.begin, range.end) of the layout's
// flat order at data[0 .. range.size()). A rank holding a sharded state holds several.
struct FlatPiece {
  Range range;
  float* data = nullptr;
};
struct ConstFlatPiece {
  Range range;
  const float* data = nullptr;
};

}  // namespace qt
