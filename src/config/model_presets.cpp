// Model presets (../shared/docs/qwen3-spec.md, table 1.1) and the parameter count (section 1.3).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qtrain/model_config.h"

namespace qt {

namespace {

// A Qwen3 dense model: the values shared by every row of table 1.1 plus the row's own.
ModelConfig qwen3(const char* name, int hidden, int inter, int layers, int heads, int kv,
                  bool tie) {
  ModelConfig m;
  m.preset = name;
  m.vocab_size = 151936;
  m.hidden_size = hidden;
  m.intermediate_size = inter;
  m.num_layers = layers;
  m.num_heads = heads;
  m.num_kv_heads = kv;
  m.head_dim = 128;
  m.rope_theta = 1e6;
  m.rms_norm_eps = 1e-6;
  m.tie_word_embeddings = tie;
  m.initializer_range = 0.02;
  m.max_position_embeddings = 40960;
  return m;
}

const std::vector<ModelConfig>& presets() {
  static const std::vector<ModelConfig> all = {
      ModelConfig{},  // tiny: the struct defaults
      qwen3("qwen3-0.6b", 1024, 3072, 28, 16, 8, true),
      qwen3("qwen3-1.7b", 2048, 6144, 28, 16, 8, true),
      qwen3("qwen3-4b", 2560, 9728, 36, 32, 8, true),
      qwen3("qwen3-8b", 4096, 12288, 36, 32, 8, false),
      qwen3("qwen3-14b", 5120, 17408, 40, 40, 8, false),
      qwen3("qwen3-32b", 5120, 25600, 64, 64, 8, false),
  };
  return all;
}

}  // namespace

namespace {

// The spec's formula in the arithmetic of T (double never overflows, for absurd sizes).
template <class T>
T count_params(const ModelConfig& c) {
  const T H = c.hidden_size, I = c.intermediate_size, L = c.num_layers;
  const T nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim, V = c.vocab_size;
  // q, k, v, o projections + q_norm, k_norm weights
  const T attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 2 * hd;
  // attention + two RMSNorms + SwiGLU MLP (gate, up, down)
  const T layer = attn + 2 * H + 3 * H * I;
  // layers + embedding + untied lm_head + final norm
  return L * layer + V * H + (c.tie_word_embeddings ? 0 : V * H) + H;
}

}  // namespace

std::int64_t ModelConfig::num_params() const { return count_params<std::int64_t>(*this); }
double ModelConfig::num_params_f64() const { return count_params<double>(*this); }

std::optional<ModelConfig> model_preset(const std::string& name) {
  for (const ModelConfig& m : presets()) {
    if (m.preset == name) return m;
  }
  return std::nullopt;
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const ModelConfig& m : presets()) names.push_back(m.preset);
  return names;
}

}  // namespace qt
