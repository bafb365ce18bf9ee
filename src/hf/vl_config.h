// A Hugging Face Qwen3-VL config.json (transformers' Qwen3VLConfig, model_type "qwen3_vl", and
// Qwen3VLMoeConfig, "qwen3_vl_moe"): the language model's ModelConfig (its text_config), the
// vision tower's VisionConfig (vision_config), the M-RoPE sections and the vision token ids
// (../shared/docs/qwen3-spec.md 1.1-1.2, 4.3-4.4). The model itself comes with issue 20's
// training integration; this reads and checks the file.
#pragma once

#include <array>
#include <string>

#include "qtrain/model_config.h"
#include "vision/vision_config.h"

namespace qt::hf {

struct VlConfig {
  ModelConfig text;                        // Qwen3 dense, or Qwen3-MoE for qwen3_vl_moe
  VisionConfig vision;
  std::array<int, 3> mrope_section{};      // frequency slots of (time, height, width)
  int image_token_id = 151655;             // <|image_pad|>
  int video_token_id = 151656;             // <|video_pad|>
  int vision_start_token_id = 151652;      // <|vision_start|>
  int vision_end_token_id = 151653;        // <|vision_end|>
};

// Whether config.json text names a Qwen3-VL model (model_type qwen3_vl or qwen3_vl_moe).
bool is_vl_config_text(const std::string& text, const std::string& where);

// Parses config.json text; `where` names the file in errors (UserError "<where>: ..."). The
// architecture keys must be there, as the official files have them (transformers' defaults for
// Qwen3-VL differ from Qwen3's): text_config's vocab_size, hidden_size, intermediate_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
// max_position_embeddings, rope_theta and mrope_section; vision_config's depth, hidden_size,
// intermediate_size, num_heads, out_hidden_size and deepstack_visual_indexes. Defaults: the
// vision keys the same in every release (patch_size 16, temporal_patch_size 2,
// spatial_merge_size 2, in_channels 3, num_position_embeddings 2304) and the token ids above.
// Refused: a vision activation other than gelu_pytorch_tanh, out_hidden_size other than the
// language model's hidden_size, sections that do not fill head_dim / 2 slots, deepstack indexes
// outside the blocks or not ascending, more deepstack features than language layers, and
// tie_word_embeddings given differently at the top and in text_config. A Qwen3-VL-MoE router
// always renormalises its k weights (spec 1.1), so norm_topk_prob is read as true.
VlConfig parse_vl_config(const std::string& text, const std::string& where);

// Reads <dir>/config.json.
VlConfig read_vl_config(const std::string& dir);

}  // namespace qt::hf
