// The image processor's arithmetic against torchvision and transformers
// (tests/reference/make_vl_processor_fixtures.py, run on the GPU machine): for each image of the
// fixture, smart_resize's size, resize_bicubic_aa's 8-bit pixels (exactly), and the normalised
// patch rows and grid of the processor. The file: $QTRAIN_VL_PROCESSOR_FIXTURE, else the
// compiled-in tests/reference/fixtures_vl/processor.h5; CMake registers the test only where
// that file exists; run by hand, a missing file fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "reference/fixture.h"
#include "vision/image_patches.h"
#include "vision/image_resize.h"

namespace qt {
namespace {

std::string fixture_path() {
  if (const char* env = std::getenv("QTRAIN_VL_PROCESSOR_FIXTURE")) return env;
  return QT_VL_PROCESSOR_FIXTURE;
}

TEST(ProcessorFixture, ResizeNormaliseAndPatchesMatchTransformers) {
  const std::string path = fixture_path();
  ASSERT_TRUE(std::filesystem::exists(path)) << "no fixture at " << path;
  test::Fixture f(path);
  ASSERT_GE(f.file, 0) << path;
  const int count = static_cast<int>(f.attr("count"));
  ASSERT_GT(count, 0);
  const VisionConfig cfg;  // patch 16, temporal 2, merge 2, 3 channels
  for (int k = 0; k < count; ++k) {
    SCOPED_TRACE("image " + std::to_string(k));
    const std::string g = "images/" + std::to_string(k) + "/";
    const auto in_shape = f.shape(g + "input"), out_shape = f.shape(g + "resized");
    ASSERT_EQ(in_shape.size(), 3u);
    ASSERT_EQ(out_shape.size(), 3u);
    const int h = static_cast<int>(in_shape[1]), w = static_cast<int>(in_shape[2]);
    const ImageSize size = smart_resize(h, w, "fixture");
    EXPECT_EQ(size.h, out_shape[1]);
    EXPECT_EQ(size.w, out_shape[2]);
    const auto input = f.read<std::uint8_t>(g + "input", H5T_NATIVE_UINT8);
    const auto want = f.read<std::uint8_t>(g + "resized", H5T_NATIVE_UINT8);
    const auto got = resize_bicubic_aa(input.data(), 3, h, w, size.h, size.w);
    ASSERT_EQ(got.size(), want.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
    EXPECT_EQ(differ, 0u) << "of " << got.size() << " resized values";
    // The processor's rows from torchvision's pixels (so a resize difference shows above only).
    std::vector<float> plane(want.size());
    for (std::size_t i = 0; i < want.size(); ++i) plane[i] = normalize_pixel(want[i]);
    ImageGrid grid;
    const auto rows = image_patch_rows(plane.data(), size.h, size.w, cfg, grid);
    const auto thw = f.read<std::int64_t>(g + "grid", H5T_NATIVE_INT64);
    ASSERT_EQ(thw.size(), 3u);
    EXPECT_EQ(grid.t, thw[0]);
    EXPECT_EQ(grid.h, thw[1]);
    EXPECT_EQ(grid.w, thw[2]);
    const auto pixels = f.read<float>(g + "pixel_values", H5T_NATIVE_FLOAT);
    ASSERT_EQ(rows.size(), pixels.size());
    double worst = 0;
    for (std::size_t i = 0; i < rows.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(rows[i] - pixels[i])));
    EXPECT_LE(worst, 1e-6) << "largest difference of the normalised rows";
  }
}

}  // namespace
}  // namespace qt
