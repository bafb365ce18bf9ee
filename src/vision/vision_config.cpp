// The vision tower's parameter layout (official names, spec 6.3) and configuration checks.
#include "vision/vision_config.h"

#include <cmath>
#include <string>
#include <utility>

#include "qtrain/error.h"

namespace qt {

int VisionConfig::grid_side() const {
  const int side = static_cast<int>(std::lround(std::sqrt(double(num_position_embeddings))));
  QT_CHECK(side * side == num_position_embeddings,
           "vision num_position_embeddings {} is not a square", num_position_embeddings);
  return side;
}

void VisionConfig::validate() const {
  QT_CHECK(hidden_size > 0 && num_heads > 0 && hidden_size % num_heads == 0,
           "vision hidden_size {} must be a multiple of num_heads {}", hidden_size, num_heads);
  QT_CHECK(head_dim() % 4 == 0, "vision head_dim {} must be a multiple of 4 (2-D RoPE)",
           head_dim());
  QT_CHECK(depth > 0 && intermediate_size > 0 && out_hidden_size > 0 && spatial_merge_size > 0,
           "vision depth, intermediate_size, out_hidden_size, spatial_merge_size must be > 0");
  grid_side();
  for (int i : deepstack_visual_indexes)
    QT_CHECK(i >= 0 && i < depth, "vision deepstack index {} outside [0, {})", i, depth);
}

int total_patches(const std::vector<ImageGrid>& grids) {
  int n = 0;
  for (const auto& g : grids) n += g.patches();
  return n;
}

namespace {

using Tensors = std::vector<std::pair<std::string, std::vector<std::int64_t>>>;

void add_merger(Tensors& t, const std::string& p, std::int64_t norm_dim, std::int64_t m,
                std::int64_t out) {
  t.push_back({p + "norm.weight", {norm_dim}});
  t.push_back({p + "norm.bias", {norm_dim}});
  t.push_back({p + "linear_fc1.weight", {m, m}});
  t.push_back({p + "linear_fc1.bias", {m}});
  t.push_back({p + "linear_fc2.weight", {out, m}});
  t.push_back({p + "linear_fc2.bias", {out}});
}

VisionMergerOffsets merger_offsets(const ParamLayout& l, const std::string& p) {
  auto at = [&](const char* n) { return l.find(p + n).offset; };
  return {at("norm.weight"),       at("norm.bias"),       at("linear_fc1.weight"),
          at("linear_fc1.bias"),   at("linear_fc2.weight"), at("linear_fc2.bias")};
}

}  // namespace

ParamLayout vision_param_layout(const VisionConfig& c) {
  c.validate();
  const std::int64_t hv = c.hidden_size, iv = c.intermediate_size, m = c.merged_dim();
  Tensors t;
  t.push_back({"model.visual.patch_embed.proj.weight",
               {hv, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size}});
  t.push_back({"model.visual.patch_embed.proj.bias", {hv}});
  t.push_back({"model.visual.pos_embed.weight", {c.num_position_embeddings, hv}});
  for (int b = 0; b < c.depth; ++b) {
    const std::string p = "model.visual.blocks." + std::to_string(b) + ".";
    t.push_back({p + "norm1.weight", {hv}});
    t.push_back({p + "norm1.bias", {hv}});
    t.push_back({p + "norm2.weight", {hv}});
    t.push_back({p + "norm2.bias", {hv}});
    t.push_back({p + "attn.qkv.weight", {3 * hv, hv}});
    t.push_back({p + "attn.qkv.bias", {3 * hv}});
    t.push_back({p + "attn.proj.weight", {hv, hv}});
    t.push_back({p + "attn.proj.bias", {hv}});
    t.push_back({p + "mlp.linear_fc1.weight", {iv, hv}});
    t.push_back({p + "mlp.linear_fc1.bias", {iv}});
    t.push_back({p + "mlp.linear_fc2.weight", {hv, iv}});
    t.push_back({p + "mlp.linear_fc2.bias", {hv}});
  }
  add_merger(t, "model.visual.merger.", hv, m, c.out_hidden_size);
  for (std::size_t j = 0; j < c.deepstack_visual_indexes.size(); ++j)
    add_merger(t, "model.visual.deepstack_merger_list." + std::to_string(j) + ".", m, m,
               c.out_hidden_size);
  return ParamLayout(t);
}

VisionOffsets vision_offsets(const VisionConfig& c, const ParamLayout& l) {
  VisionOffsets o{};
  o.patch_w = l.find("model.visual.patch_embed.proj.weight").offset;
  o.patch_b = l.find("model.visual.patch_embed.proj.bias").offset;
  o.pos_embed = l.find("model.visual.pos_embed.weight").offset;
  for (int b = 0; b < c.depth; ++b) {
    const std::string p = "model.visual.blocks." + std::to_string(b) + ".";
    auto at = [&](const char* n) { return l.find(p + n).offset; };
    o.blocks.push_back({at("norm1.weight"), at("norm1.bias"), at("attn.qkv.weight"),
                        at("attn.qkv.bias"), at("attn.proj.weight"), at("attn.proj.bias"),
                        at("norm2.weight"), at("norm2.bias"), at("mlp.linear_fc1.weight"),
                        at("mlp.linear_fc1.bias"), at("mlp.linear_fc2.weight"),
                        at("mlp.linear_fc2.bias")});
  }
  o.merger = merger_offsets(l, "model.visual.merger.");
  for (std::size_t j = 0; j < c.deepstack_visual_indexes.size(); ++j)
    o.deepstack.push_back(
        merger_offsets(l, "model.visual.deepstack_merger_list." + std::to_string(j) + "."));
  return o;
}

}  // namespace qt
