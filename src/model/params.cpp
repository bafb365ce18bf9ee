// Flat parameter layout with transformers' names and shapes.
#include "qtrain/params.h"

#include <fmt/format.h>

#include <algorithm>

#include "qtrain/error.h"

namespace qt {

std::size_t ParamLayout::add(std::string name, std::vector<std::int64_t> shape) {
  ParamInfo p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = 1;
  for (auto d : p.shape) p.numel *= static_cast<std::size_t>(d);
  p.offset = numel_;
  p.weight_decay = p.shape.size() >= 2;  // no decay on norm weights
  numel_ += p.numel;
  params_.push_back(std::move(p));
  return params_.back().offset;
}

ParamLayout::ParamLayout(
    const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& tensors) {
  for (const auto& [name, shape] : tensors) add(name, shape);
}

void ParamLayout::add_experts(const ModelConfig& c, int l, LayerOffsets& o) {
  const std::string p = fmt::format("model.layers.{}.mlp.experts.", l);
  const std::int64_t El = c.local_experts(), H = c.hidden_size, Im = c.moe_intermediate_size;
  o.experts_gate_up = add(p + "gate_up_proj", {El, 2 * Im, H});
  o.experts_down = add(p + "down_proj", {El, H, Im});
}

ParamLayout::ParamLayout(const ModelConfig& c) {
  QT_CHECK(c.expert_shards >= 1 && (!c.is_moe() || c.num_experts % c.expert_shards == 0),
           "{} experts stored over {} expert-parallel ranks", c.num_experts, c.expert_shards);
  const std::int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const std::int64_t Q = c.q_dim(), KV = c.kv_dim(), hd = c.head_dim;
  ModelOffsets m;
  m.embed = add("model.embed_tokens.weight", {V, H});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    LayerOffsets o;
    o.ln1 = add(p + "input_layernorm.weight", {H});
    o.wq = add(p + "self_attn.q_proj.weight", {Q, H});
    o.wk = add(p + "self_attn.k_proj.weight", {KV, H});
    o.wv = add(p + "self_attn.v_proj.weight", {KV, H});
    o.wo = add(p + "self_attn.o_proj.weight", {H, Q});
    o.q_norm = add(p + "self_attn.q_norm.weight", {hd});
    o.k_norm = add(p + "self_attn.k_norm.weight", {hd});
    o.ln2 = add(p + "post_attention_layernorm.weight", {H});
    if (c.is_moe_layer(l)) {  // transformers 5's runtime names (qwen3-spec.md 6.2)
      o.moe = true;
      o.router = add(p + "mlp.gate.weight", {c.num_experts, H});
      if (c.expert_shards == 1) add_experts(c, l, o);
    } else {
      o.w_gate = add(p + "mlp.gate_proj.weight", {I, H});
      o.w_up = add(p + "mlp.up_proj.weight", {I, H});
      o.w_down = add(p + "mlp.down_proj.weight", {H, I});
    }
    m.layers.push_back(o);
  }
  m.norm = add("model.norm.weight", {H});
  m.lm_head = c.tie_word_embeddings ? m.embed : add("lm_head.weight", {V, H});
  // An expert-parallel rank's local model: its experts of each sparse layer after the head.
  if (c.expert_shards > 1)
    for (int l = 0; l < c.num_layers; ++l)
      if (m.layers[l].moe) add_experts(c, l, m.layers[l]);
  model_ = std::move(m);
}

const ModelOffsets& ParamLayout::model_offsets() const {
  QT_CHECK(model_.has_value(), "model_offsets() of a layout that is not a model's");
  return *model_;
}

const ParamInfo& ParamLayout::find(const std::string& name) const {
  auto it = std::find_if(params_.begin(), params_.end(),
                         [&](const ParamInfo& p) { return p.name == name; });
  QT_CHECK(it != params_.end(), "no parameter named {}", name);
  return *it;
}

Range split_range(std::size_t n, int parts, int i) {
  QT_CHECK(parts > 0 && i >= 0 && i < parts, "split_range part {} of {}", i, parts);
  const std::size_t chunk = (n + parts - 1) / parts;
  Range r;
  r.begin = std::min(n, chunk * static_cast<std::size_t>(i));
  r.end = std::min(n, chunk * static_cast<std::size_t>(i + 1));
  return r;
}

}  // namespace qt
