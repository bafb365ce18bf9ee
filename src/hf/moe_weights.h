// Qwen3-MoE experts in Hugging Face files (../shared/docs/qwen3-spec.md 6.2).
//
// ParamLayout holds a sparse layer's experts as transformers 5 does at run time, fused:
//   model.layers.{l}.mlp.experts.gate_up_proj [E, 2 Im, H]  (rows [0, Im) gate, [Im, 2 Im) up)
//   model.layers.{l}.mlp.experts.down_proj    [E, H, Im]
// Checkpoint files (the Hub's, and what transformers' save_pretrained writes) name each expert:
//   model.layers.{l}.mlp.experts.{e}.gate_proj.weight [Im, H]
//   model.layers.{l}.mlp.experts.{e}.up_proj.weight   [Im, H]
//   model.layers.{l}.mlp.experts.{e}.down_proj.weight [H, Im]
// so row e (expert e) of gate_up_proj is gate_proj then up_proj of expert e, and row e of
// down_proj is down_proj of expert e. The router, mlp.gate.weight [E, H], has one name in both.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qtrain/params.h"

namespace qt::hf {

// A tensor of a checkpoint file: its name and shape.
struct FileTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t numel() const;
};

// The per-expert file tensors of layout parameter `p`, by expert: row e of `p` (its first
// dimension) is the elements of result[e][0], result[e][1], ... in order. Empty when `p` is not
// a fused expert tensor (its file tensor is then its own name and shape).
std::vector<std::vector<FileTensor>> expert_file_tensors(const ParamInfo& p);

// True when `name` is a per-expert file tensor's (model.layers.{l}.mlp.experts.{e}.*).
bool is_expert_file_tensor(const std::string& name);

}  // namespace qt::hf
