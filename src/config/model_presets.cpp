// Model presets (../shared/docs/qwen3-spec.md, table 1.1) and the parameter count (section 1.3).
#include <algorithm>
#include <cmath>
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

// A Qwen3-MoE model: every layer sparse, E experts of width moe, k a token, renormalised.
ModelConfig qwen3_moe(const char* name, int hidden, int inter, int moe, int layers, int heads,
                      int kv, int experts, int k) {
  ModelConfig m = qwen3(name, hidden, inter, layers, heads, kv, false);
  m.num_experts = experts;
  m.num_experts_per_tok = k;
  m.moe_intermediate_size = moe;
  m.norm_topk_prob = true;
  m.decoder_sparse_step = 1;
  m.router_aux_loss_coef = 0.001;
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
      qwen3_moe("qwen3-30b-a3b", 2048, 6144, 768, 48, 32, 4, 128, 8),
      qwen3_moe("qwen3-235b-a22b", 4096, 12288, 1536, 94, 64, 4, 128, 8),
  };
  return all;
}

}  // namespace

namespace {

// The spec's formula in the arithmetic of T (double never overflows, for absurd sizes); with
// `active`, a sparse layer's experts count k of E.
template <class T>
T count_params(const ModelConfig& c, bool active = false) {
  const T H = c.hidden_size, I = c.intermediate_size, L = c.num_layers;
  const T nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim, V = c.vocab_size;
  const T E = c.num_experts, Im = c.moe_intermediate_size;
  const T routed = active ? static_cast<T>(c.num_experts_per_tok) : E;
  // q, k, v, o projections + q_norm, k_norm weights
  const T attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 2 * hd;
  // attention + two RMSNorms + SwiGLU MLP (gate, up, down), or the router and the experts
  const T dense = attn + 2 * H + 3 * H * I;
  const T sparse = attn + 2 * H + E * H + routed * 3 * H * Im;
  const T moe_layers = c.num_moe_layers();
  // layers + embedding + untied lm_head + final norm
  return (L - moe_layers) * dense + moe_layers * sparse + V * H +
         (c.tie_word_embeddings ? 0 : V * H) + H;
}

}  // namespace

std::int64_t ModelConfig::num_params() const { return count_params<std::int64_t>(*this); }
double ModelConfig::num_params_f64() const { return count_params<double>(*this); }
double ModelConfig::active_params_f64() const { return count_params<double>(*this, true); }

bool ModelConfig::is_moe_layer(int l) const {
  return num_experts > 0 && decoder_sparse_step > 0 && (l + 1) % decoder_sparse_step == 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) == mlp_only_layers.end();
}

double ModelConfig::rope_cos_sin_scale() const {
  if (!is_yarn()) return 1.0;
  if (rope_attention_factor > 0) return rope_attention_factor;
  return rope_factor <= 1 ? 1.0 : 0.1 * std::log(rope_factor) + 1.0;  // transformers' get_mscale
}

int ModelConfig::moe_layers_before(int l) const {
  int n = 0;
  for (int i = 0; i < l; ++i) n += is_moe_layer(i);
  return n;
}

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
