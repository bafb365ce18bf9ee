// The vision tower's parameter layout: official names and shapes (qwen3-spec.md 6.3) and the
// parameter count of the spec's formula (1.3) for the published configurations (1.2).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "vision/vision_config.h"

namespace qt {
namespace {

// vision = hv*3*2*16*16 + hv + 2304 hv + depth (4hv + hv 3hv + 3hv + hv hv + hv + hv iv + iv +
//          iv hv + hv) + merger (2hv + (4hv)^2 + 4hv + 4hv out + out)
//          + n_ds (2 4hv + (4hv)^2 + 4hv + 4hv out + out)
std::int64_t spec_formula(std::int64_t hv, std::int64_t iv, std::int64_t depth, std::int64_t out,
                          std::int64_t n_ds) {
  const std::int64_t m = 4 * hv;
  return hv * 3 * 2 * 16 * 16 + hv + 2304 * hv +
         depth * (4 * hv + hv * 3 * hv + 3 * hv + hv * hv + hv + hv * iv + iv + iv * hv + hv) +
         (2 * hv + m * m + m + m * out + out) + n_ds * (2 * m + m * m + m + m * out + out);
}

TEST(VisionLayout, ParameterCountIsTheSpecFormula) {
  struct Row {
    int depth, hv, iv, heads, out;
    std::vector<int> ds;
  };
  const Row rows[] = {{24, 1024, 4096, 16, 2048, {5, 11, 17}},   // Qwen3-VL-2B
                      {27, 1152, 4304, 16, 4096, {8, 16, 24}},   // Qwen3-VL-8B
                      {27, 1152, 4304, 16, 2048, {8, 16, 24}}};  // Qwen3-VL-30B-A3B
  for (const Row& r : rows) {
    VisionConfig c;
    c.depth = r.depth;
    c.hidden_size = r.hv;
    c.intermediate_size = r.iv;
    c.num_heads = r.heads;
    c.out_hidden_size = r.out;
    c.deepstack_visual_indexes = r.ds;
    EXPECT_EQ(static_cast<std::int64_t>(vision_param_layout(c).numel()),
              spec_formula(r.hv, r.iv, r.depth, r.out, static_cast<std::int64_t>(r.ds.size())))
        << "hv " << r.hv << " out " << r.out;
  }
}

TEST(VisionLayout, OfficialNamesAndShapes) {
  VisionConfig c;  // 8B / 30B-A3B sizes: hv 1152, iv 4304, out 2048
  const ParamLayout l = vision_param_layout(c);
  using S = std::vector<std::int64_t>;
  EXPECT_EQ(l.find("model.visual.patch_embed.proj.weight").shape, (S{1152, 3, 2, 16, 16}));
  EXPECT_EQ(l.find("model.visual.pos_embed.weight").shape, (S{2304, 1152}));
  EXPECT_EQ(l.find("model.visual.blocks.26.attn.qkv.weight").shape, (S{3456, 1152}));
  EXPECT_EQ(l.find("model.visual.blocks.0.attn.proj.bias").shape, (S{1152}));
  EXPECT_EQ(l.find("model.visual.blocks.3.mlp.linear_fc1.weight").shape, (S{4304, 1152}));
  EXPECT_EQ(l.find("model.visual.blocks.3.mlp.linear_fc2.weight").shape, (S{1152, 4304}));
  EXPECT_EQ(l.find("model.visual.merger.norm.weight").shape, (S{1152}));
  EXPECT_EQ(l.find("model.visual.merger.linear_fc1.weight").shape, (S{4608, 4608}));
  EXPECT_EQ(l.find("model.visual.merger.linear_fc2.weight").shape, (S{2048, 4608}));
  EXPECT_EQ(l.find("model.visual.deepstack_merger_list.2.norm.bias").shape, (S{4608}));
  EXPECT_EQ(l.find("model.visual.deepstack_merger_list.0.linear_fc2.bias").shape, (S{2048}));
  // offsets tile the buffer: each tensor starts where the previous ended
  std::size_t at = 0;
  for (const auto& p : l.params()) {
    EXPECT_EQ(p.offset, at) << p.name;
    at += p.numel;
  }
  EXPECT_EQ(at, l.numel());
}

}  // namespace
}  // namespace qt
