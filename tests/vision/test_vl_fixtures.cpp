// The vision tower and M-RoPE against transformers (tests/reference/make_vl_fixtures.py, run on
// the GPU machine): the fixture's weights and pixels through the program, its merged and
// deepstack outputs, the gradients of its objective sum(merged R) + sum_j sum(deepstack_j R_j),
// and get_rope_index's positions. The file: $QTRAIN_VL_FIXTURE, else the compiled-in
// tests/reference/fixtures_vl/vision_tiny.h5. CMake registers the test only where that file
// exists; run by hand, a missing file fails.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "reference/fixture.h"
#include "support/compare.h"
#include "vision/mrope.h"
#include "vision/vision_cpu_ops.h"
#include "vision/vision_program.h"

namespace qt {
namespace {

std::string fixture_path() {
  if (const char* env = std::getenv("QTRAIN_VL_FIXTURE")) return env;
  return QT_VL_FIXTURE;
}

VisionConfig config_of(const test::Fixture& f) {
  VisionConfig c;
  c.depth = static_cast<int>(f.attr("depth"));
  c.hidden_size = static_cast<int>(f.attr("hidden_size"));
  c.intermediate_size = static_cast<int>(f.attr("intermediate_size"));
  c.num_heads = static_cast<int>(f.attr("num_heads"));
  c.out_hidden_size = static_cast<int>(f.attr("out_hidden_size"));
  c.patch_size = static_cast<int>(f.attr("patch_size"));
  c.temporal_patch_size = static_cast<int>(f.attr("temporal_patch_size"));
  c.spatial_merge_size = static_cast<int>(f.attr("spatial_merge_size"));
  c.in_channels = static_cast<int>(f.attr("in_channels"));
  c.num_position_embeddings = static_cast<int>(f.attr("num_position_embeddings"));
  c.deepstack_visual_indexes.clear();
  for (std::int64_t i : f.attr_list("deepstack_visual_indexes"))
    c.deepstack_visual_indexes.push_back(static_cast<int>(i));
  return c;
}

std::vector<ImageGrid> grids_of(const test::Fixture& f) {
  const auto thw = f.read<std::int64_t>("image_grid_thw", H5T_NATIVE_INT64);
  std::vector<ImageGrid> g;
  for (std::size_t i = 0; i + 2 < thw.size(); i += 3)
    g.push_back({static_cast<int>(thw[i]), static_cast<int>(thw[i + 1]), static_cast<int>(thw[i + 2])});
  return g;
}

TEST(VisionFixture, ForwardAndGradientsMatchTransformers) {
  const std::string path = fixture_path();
  ASSERT_TRUE(std::filesystem::exists(path)) << "no fixture at " << path;
  test::Fixture f(path);
  ASSERT_GE(f.file, 0) << path;
  const VisionConfig c = config_of(f);
  const auto grids = grids_of(f);
  ASSERT_FALSE(grids.empty());
  VisionCpuOps ops;
  VisionProgram<VisionCpuOps> prog(c, ops);
  const auto params = f.params(prog.layout());
  ASSERT_FALSE(params.empty()) << "a parameter is missing or misshapen in " << path;
  const auto pixels = f.read<float>("pixel_values", H5T_NATIVE_FLOAT);
  const VisionBatch batch = make_vision_batch(c, grids);
  ASSERT_EQ(pixels.size(), static_cast<std::size_t>(batch.patches) * c.patch_dim());
  prog.forward(pixels.data(), batch, params.data());

  const std::size_t out_n = static_cast<std::size_t>(prog.merged_rows()) * c.out_hidden_size;
  const auto merged = f.read<float>("merged", H5T_NATIVE_FLOAT);
  ASSERT_EQ(merged.size(), out_n);
  EXPECT_LT(test::rel_error(prog.merged(), merged.data(), out_n), 1e-5);
  std::vector<std::vector<float>> r_ds;
  std::vector<const float*> d_ds;
  for (std::size_t j = 0; j < prog.num_deepstack(); ++j) {
    const auto ds = f.read<float>("deepstack/" + std::to_string(j), H5T_NATIVE_FLOAT);
    ASSERT_EQ(ds.size(), out_n) << j;
    EXPECT_LT(test::rel_error(prog.deepstack(j), ds.data(), out_n), 1e-5) << "deepstack " << j;
    r_ds.push_back(f.read<float>("objective_weights/deepstack/" + std::to_string(j), H5T_NATIVE_FLOAT));
    ASSERT_EQ(r_ds.back().size(), out_n);
  }
  for (const auto& r : r_ds) d_ds.push_back(r.data());
  const auto r_merged = f.read<float>("objective_weights/merged", H5T_NATIVE_FLOAT);
  ASSERT_EQ(r_merged.size(), out_n);
  std::vector<float> grads(prog.layout().numel(), 0.0f);
  prog.backward(r_merged.data(), d_ds, grads.data());
  for (const ParamInfo& p : prog.layout().params()) {
    const auto want = f.read<float>("grads/" + p.name, H5T_NATIVE_FLOAT);
    ASSERT_EQ(want.size(), p.numel) << p.name;
    EXPECT_LT(test::rel_error(grads.data() + p.offset, want.data(), p.numel), 1e-4) << p.name;
  }
}

TEST(VisionFixture, MRopePositionsMatchGetRopeIndex) {
  const std::string path = fixture_path();
  ASSERT_TRUE(std::filesystem::exists(path)) << "no fixture at " << path;
  test::Fixture f(path);
  const VisionConfig c = config_of(f);
  const auto types64 = f.read<std::int64_t>("mrope/mm_token_type_ids", H5T_NATIVE_INT64);
  const auto want = f.read<std::int64_t>("mrope/position_ids", H5T_NATIVE_INT64);  // [3, S]
  const auto delta = f.read<std::int64_t>("mrope/rope_deltas", H5T_NATIVE_INT64);
  const std::size_t S = types64.size();
  ASSERT_GT(S, 0u);
  ASSERT_EQ(want.size(), 3 * S);
  ASSERT_EQ(delta.size(), 1u);
  std::vector<TokenType> types;
  for (std::int64_t t : types64) types.push_back(static_cast<TokenType>(t));
  const MRopePositions p = mrope_positions(types, grids_of(f), {}, c.spatial_merge_size);
  EXPECT_EQ(p.t, std::vector<std::int64_t>(want.begin(), want.begin() + S));
  EXPECT_EQ(p.h, std::vector<std::int64_t>(want.begin() + S, want.begin() + 2 * S));
  EXPECT_EQ(p.w, std::vector<std::int64_t>(want.begin() + 2 * S, want.end()));
  EXPECT_EQ(p.rope_delta, delta[0]);
}

}  // namespace
}  // namespace qt
