// Architecture of a Qwen3 dense model (../shared/docs/qwen3-spec.md, section 1.1).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace qt {

struct ModelConfig {
  std::string preset = "tiny";
  int vocab_size = 256;
  int hidden_size = 64;           // H
  int intermediate_size = 192;    // I (SwiGLU width)
  int num_layers = 2;             // L
  int num_heads = 4;              // nh (query heads)
  int num_kv_heads = 2;           // nkv (GQA)
  int head_dim = 16;              // hd
  double rope_theta = 1e6;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = true;
  double initializer_range = 0.02;
  int max_position_embeddings = 40960;

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
  // Total parameter count, by the spec's formula (section 1.3).
  std::int64_t num_params() const;
  // The same in double, which cannot overflow: for checks of sizes before they are allocated.
  double num_params_f64() const;
};

// The named presets; nullopt for an unknown name.
std::optional<ModelConfig> model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

}  // namespace qt
