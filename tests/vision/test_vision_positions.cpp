// Patch coordinates, position-table taps, 2-D RoPE angles and frame offsets on hand-worked tiny
// grids (expected values worked out from qwen3-spec.md 4.1-4.2 by hand, written out below).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "vision/vision_positions.h"

namespace qt {
namespace {

// A 4x4 grid in merge-block order (bh, bw, mh, mw):
//   rows 0-3 block (0,0): (0,0) (0,1) (1,0) (1,1); rows 4-7 block (0,1): (0,2) (0,3) (1,2) (1,3)
//   rows 8-11 block (1,0): (2,0) (2,1) (3,0) (3,1); rows 12-15 block (1,1): (2,2) ..
TEST(VisionPositions, MergeBlockOrder) {
  const auto pc = patch_coordinates({{1, 4, 4}}, 2);
  ASSERT_EQ(pc.size(), 16u);
  const int want[16][2] = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3},
                           {2, 0}, {2, 1}, {3, 0}, {3, 1}, {2, 2}, {2, 3}, {3, 2}, {3, 3}};
  for (int n = 0; n < 16; ++n) {
    EXPECT_EQ(pc[n].row, want[n][0]) << n;
    EXPECT_EQ(pc[n].col, want[n][1]) << n;
  }
  // a second image and a 2-frame video restart their coordinates; frames repeat them
  const auto two = patch_coordinates({{1, 2, 2}, {2, 2, 4}}, 2);
  ASSERT_EQ(two.size(), 4u + 16u);
  EXPECT_EQ(two[4].row, 0);  // video frame 0, block (0,0)
  EXPECT_EQ(two[8].col, 2);  // frame 0, block (0,1), first patch: (0,2)
  EXPECT_EQ(two[12].row, 0);  // frame 1 starts again at (0,0)
  EXPECT_EQ(two[12].col, 0);
  EXPECT_EQ(two[19].row, 1);  // frame 1's last patch: (1,3)
  EXPECT_EQ(two[19].col, 3);
}

// Table 48x48, image 4x6 patches. The patch at (row 1, col 1) is row 3 of the batch (block
// (0,0), mh = mw = 1). sr = 1 * 47/3 = 15.667: r0 15, r1 16, dr = 2/3; sc = 1 * 47/5 = 9.4:
// c0 9, c1 10, dc = 0.4. Taps 15*48+9 = 729, 730, 16*48+9 = 777, 778 with weights
// (1/3)(0.6) = 0.2, (1/3)(0.4) = 0.1333, (2/3)(0.6) = 0.4, (2/3)(0.4) = 0.2667.
// The last patch (3, 5) sits on the far corner: sr = sc = 47, both taps clamp to 47 with
// weight 1 on (47, 47) = 2303 and 0 elsewhere.
TEST(VisionPositions, InterpolationTaps) {
  const auto taps = position_taps({{1, 4, 6}}, 2, 48);
  ASSERT_EQ(taps.size(), 24u);
  const PositionTaps& t = taps[3];
  const int idx[4] = {729, 730, 777, 778};
  const double wgt[4] = {0.2, 0.4 / 3, 0.4, 0.8 / 3};
  for (int j = 0; j < 4; ++j) {
    EXPECT_EQ(t.index[j], idx[j]) << j;
    EXPECT_NEAR(t.weight[j], wgt[j], 1e-6) << j;
  }
  // row (3, 5) is the last of block (1, 2): batch row 23
  const PositionTaps& last = taps[23];
  EXPECT_EQ(last.index[0], 2303);
  EXPECT_NEAR(last.weight[0], 1.0, 1e-6);
  for (int j = 1; j < 4; ++j) {
    EXPECT_EQ(last.index[j], 2303);
    EXPECT_NEAR(last.weight[j], 0.0, 1e-6);
  }
  // the first patch of a one-row grid (h - 1 = 0): row 0 of the table, dr = 0
  const auto flat = position_taps({{1, 2, 2}}, 2, 48);
  EXPECT_EQ(flat[0].index[0], 0);
  EXPECT_NEAR(flat[0].weight[0], 1.0, 1e-6);
  EXPECT_EQ(flat[1].index[0], 47);  // (0, 1): sc = 47
  EXPECT_NEAR(flat[1].weight[0], 1.0, 1e-6);
}

// hd = 8, theta = 1e4: 2 frequencies 1 and 1e4^(-2/4) = 0.01. Patch (row 2, col 3): the four
// angles of the half-table are 2, 0.02, 3, 0.03.
TEST(VisionPositions, Rope2dAngles) {
  std::vector<float> cos, sin;
  rope2d_table(cos, sin, {{1, 4, 4}}, 2, 8, 1e4);
  ASSERT_EQ(cos.size(), 16u * 4);
  const int n = 13;  // block (1,1), mh 0, mw 1: (2, 3)
  const double angles[4] = {2.0, 0.02, 3.0, 0.03};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(cos[n * 4 + i], std::cos(angles[i]), 1e-6) << i;
    EXPECT_NEAR(sin[n * 4 + i], std::sin(angles[i]), 1e-6) << i;
  }
}

TEST(VisionPositions, FrameOffsets) {
  // a 2-frame video of 4x4 then an image of 2x6: frames of 16, 16 and 12 patches
  EXPECT_EQ(frame_offsets({{2, 4, 4}, {1, 2, 6}}), (std::vector<int>{0, 16, 32, 44}));
}

}  // namespace
}  // namespace qt
