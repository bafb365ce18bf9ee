// The image processor's arithmetic (vision/image_patches.h): smart_resize against the values of
// transformers' smart_resize in Python (its formula evaluated there: round ties to even, floor
// and ceil of the scaled sides), the normalisation, and the patch rows' order worked by hand.
#include <gtest/gtest.h>

#include <vector>

#include "qtrain/error.h"
#include "vision/image_patches.h"

namespace qt {
namespace {

TEST(SmartResize, MatchesTransformersValues) {
  struct Case {
    int h, w;
    ImageSize want;
  };
  const Case cases[] = {
      {768, 1024, {768, 1024}},    // the benchmark's images: 48 x 64 patches, 768 tokens
      {80, 2000, {64, 1984}},      // 2.5 and 62.5 blocks round to even: 2 and 62
      {112, 2000, {128, 1984}},    // 3.5 rounds to 4
      {80, 1000, {96, 928}},       // below min_pixels: scaled up, ceil
      {8000, 6000, {4704, 3520}},  // above max_pixels: scaled down, floor
      {10, 10, {256, 256}},
      {1, 150, {32, 3136}},
      {4096, 4096, {4096, 4096}},  // exactly max_pixels
      {4097, 4096, {4096, 4096}},
      {35, 7000, {32, 7008}},      // aspect ratio exactly 200: allowed
  };
  for (const Case& c : cases)
    EXPECT_EQ(smart_resize(c.h, c.w, "img"), c.want) << c.h << " x " << c.w;
}

TEST(SmartResize, RefusesExtremeAspectRatiosAndEmptyImages) {
  EXPECT_NO_THROW(smart_resize(10, 2000, "a.png"));  // exactly 200
  try {
    smart_resize(10, 2001, "data.jsonl:3: a.png");
    ADD_FAILURE() << "aspect ratio 200.1 accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("data.jsonl:3: a.png: the image is 10 x 2001 pixels, an "
                                         "aspect ratio above 200"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(smart_resize(0, 10, "b.png"), UserError);
}

TEST(ImagePatches, NormalisesToMinusOneToOne) {
  EXPECT_EQ(normalize_pixel(0), -1.0f);
  EXPECT_EQ(normalize_pixel(255), 1.0f);
  EXPECT_FLOAT_EQ(normalize_pixel(128), 0.5f / 127.5f);
}

// Pixel value encoding (frame f, channel c, row y, column x): exact in fp32 for these sizes.
float code(int f, int c, int y, int x) { return f * 100000.0f + c * 10000.0f + y * 100.0f + x; }

std::vector<float> coded_frame(int f, int C, int h, int w) {
  std::vector<float> v(static_cast<std::size_t>(C) * h * w);
  for (int c = 0; c < C; ++c)
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) v[(static_cast<std::size_t>(c) * h + y) * w + x] = code(f, c, y, x);
  return v;
}

TEST(ImagePatches, RowsAreMergeBlocksAndVectorsAreChannelTimeRowColumn) {
  const VisionConfig cfg;  // patch 16, temporal 2, merge 2, 3 channels
  const int h = 64, w = 96;  // 4 x 6 patches, 2 x 3 merge blocks
  const std::vector<float> frame = coded_frame(0, 3, h, w);
  ImageGrid grid;
  const std::vector<float> rows = image_patch_rows(frame.data(), h, w, cfg, grid);
  EXPECT_EQ(grid.t, 1);
  EXPECT_EQ(grid.h, 4);
  EXPECT_EQ(grid.w, 6);
  ASSERT_EQ(rows.size(), 24u * 1536);
  // Block (bh 1, bw 2), patch (mh 1, mw 0): row (1 x 3 + 2) x 4 + 1 x 2 + 0 = 22, which is patch
  // (row 3, column 4) of the image, pixels from (48, 64). Element (c 2, t 1, py 5, px 7) sits at
  // ((2 x 2 + 1) x 16 + 5) x 16 + 7 = 1367: pixel (53, 71) of channel 2.
  EXPECT_EQ(rows[22 * 1536 + 1367], code(0, 2, 53, 71));
  // The image's frame fills both temporal slots: t 0 holds the same pixel.
  EXPECT_EQ(rows[22 * 1536 + ((2 * 2 + 0) * 16 + 5) * 16 + 7], code(0, 2, 53, 71));
  // The first row is patch (0, 0); the second patch (0, 1); the third (1, 0); the fifth (0, 2).
  EXPECT_EQ(rows[0 * 1536], code(0, 0, 0, 0));
  EXPECT_EQ(rows[1 * 1536], code(0, 0, 0, 16));
  EXPECT_EQ(rows[2 * 1536], code(0, 0, 16, 0));
  EXPECT_EQ(rows[4 * 1536], code(0, 0, 0, 32));
}

TEST(ImagePatches, VideoFramesPairIntoTemporalPatches) {
  const VisionConfig cfg;
  const int h = 32, w = 32;  // one merge block a frame
  std::vector<std::vector<float>> f;
  for (int i = 0; i < 4; ++i) f.push_back(coded_frame(i, 3, h, w));
  ImageGrid grid;
  const std::vector<float> rows =
      patch_rows({f[0].data(), f[1].data(), f[2].data(), f[3].data()}, h, w, cfg, grid);
  EXPECT_EQ(grid.t, 2);
  ASSERT_EQ(rows.size(), 8u * 1536);
  // Temporal patch 1 (frames 2 and 3), its patch (1, 1) = row 4 + 3 = 7; element (c 1, t 1, py 2,
  // px 3) at ((1 x 2 + 1) x 16 + 2) x 16 + 3 = 803: frame 3, pixel (18, 19) of channel 1.
  EXPECT_EQ(rows[7 * 1536 + 803], code(3, 1, 18, 19));
  EXPECT_EQ(rows[7 * 1536 + ((1 * 2 + 0) * 16 + 2) * 16 + 3], code(2, 1, 18, 19));
}

}  // namespace
}  // namespace qt
