// Flat parameter layout with transformers' names and shapes.
#include "qtrain/params.h"

#include <fmt/format.h>

#include <algorithm>

#include "qtrain/error.h"

namespace qt {

void ParamLayout::add(std::string name, std::vector<std::int64_t> shape) {
  ParamInfo p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = 1;
  for (auto d : p.shape) p.numel *= static_cast<std::size_t>(d);
  p.offset = numel_;
  p.weight_decay = p.shape.size() >= 2;  // no decay on norm weights
  numel_ += p.numel;
  params_.push_back(std::move(p));
}

ParamLayout::ParamLayout(
    const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& tensors) {
  for (const auto& [name, shape] : tensors) add(name, shape);
}

ParamLayout::ParamLayout(const ModelConfig& c) {
  const std::int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const std::int64_t Q = c.q_dim(), KV = c.kv_dim(), hd = c.head_dim;
  add("model.embed_tokens.weight", {V, H});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    add(p + "input_layernorm.weight", {H});
    add(p + "self_attn.q_proj.weight", {Q, H});
    add(p + "self_attn.k_proj.weight", {KV, H});
    add(p + "self_attn.v_proj.weight", {KV, H});
    add(p + "self_attn.o_proj.weight", {H, Q});
    add(p + "self_attn.q_norm.weight", {hd});
    add(p + "self_attn.k_norm.weight", {hd});
    add(p + "post_attention_layernorm.weight", {H});
    add(p + "mlp.gate_proj.weight", {I, H});
    add(p + "mlp.up_proj.weight", {I, H});
    add(p + "mlp.down_proj.weight", {H, I});
  }
  add("model.norm.weight", {H});
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H});
  is_model_ = true;
  model_.embed = find("model.embed_tokens.weight").offset;
  model_.norm = find("model.norm.weight").offset;
  model_.lm_head = c.tie_word_embeddings ? model_.embed : find("lm_head.weight").offset;
  for (int l = 0; l < c.num_layers; ++l) model_.layers.push_back(layer_offsets(l));
}

const ModelOffsets& ParamLayout::model_offsets() const {
  QT_CHECK(is_model_, "model_offsets() of a layout that is not a model's");
  return model_;
}

const ParamInfo& ParamLayout::find(const std::string& name) const {
  auto it = std::find_if(params_.begin(), params_.end(),
                         [&](const ParamInfo& p) { return p.name == name; });
  QT_CHECK(it != params_.end(), "no parameter named {}", name);
  return *it;
}

LayerOffsets ParamLayout::layer_offsets(int l) const {
  const std::string p = fmt::format("model.layers.{}.", l);
  auto at = [&](const char* s) { return find(p + s).offset; };
  return {at("input_layernorm.weight"),  at("self_attn.q_proj.weight"),
          at("self_attn.k_proj.weight"), at("self_attn.v_proj.weight"),
          at("self_attn.o_proj.weight"), at("self_attn.q_norm.weight"),
          at("self_attn.k_norm.weight"), at("post_attention_layernorm.weight"),
          at("mlp.gate_proj.weight"),    at("mlp.up_proj.weight"),
          at("mlp.down_proj.weight")};
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
