// Interleaved M-RoPE positions (get_rope_index) and tables on hand-worked sequences (qwen3-spec
// 4.4); the expected positions are written out by hand below.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vision/mrope.h"

namespace qt {
namespace {

using V = std::vector<std::int64_t>;
constexpr TokenType X = TokenType::kText, I = TokenType::kImage, D = TokenType::kVideo;

TEST(MRope, TextOnlyIsPlainPositions) {
  const auto p = mrope_positions({X, X, X, X, X}, {}, {}, 2);
  EXPECT_EQ(p.t, (V{0, 1, 2, 3, 4}));
  EXPECT_EQ(p.h, p.t);
  EXPECT_EQ(p.w, p.t);
  EXPECT_EQ(p.rope_delta, 0);
}

// 2 text, an image of 4x6 patches (2x3 merged tokens), 3 text. The image starts at cur = 2:
// T 2 2 2 2 2 2, H 2 2 2 3 3 3, W 2 3 4 2 3 4; then cur = 4 + 1 = 5: text 5 6 7.
// S = 11, max 7: rope_delta = 8 - 11 = -3.
TEST(MRope, TextAndOneImage) {
  const auto p = mrope_positions({X, X, I, I, I, I, I, I, X, X, X}, {{1, 4, 6}}, {}, 2);
  EXPECT_EQ(p.t, (V{0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7}));
  EXPECT_EQ(p.h, (V{0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7}));
  EXPECT_EQ(p.w, (V{0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(p.rope_delta, -3);
}

// 1 text; image A 2x2 patches = 1 token at cur 1 -> (1,1,1), cur 2; 2 text 2 3; image B of
// 6x2 patches = 3x1 tokens at cur 4: T 4 4 4, H 4 5 6, W 4 4 4, cur 7; 1 text 7.
// S = 8, max 7: delta 0.
TEST(MRope, TwoImages) {
  const auto p = mrope_positions({X, I, X, X, I, I, I, X}, {{1, 2, 2}, {1, 6, 2}}, {}, 2);
  EXPECT_EQ(p.t, (V{0, 1, 2, 3, 4, 4, 4, 7}));
  EXPECT_EQ(p.h, (V{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(p.w, (V{0, 1, 2, 3, 4, 4, 4, 7}));
  EXPECT_EQ(p.rope_delta, 0);
}

// A 2-frame video of 2x4 patches (1x2 tokens a frame), frames separated by a text token (a
// timestamp): frame 0 at cur 1: T 1 1, H 1 1, W 1 2, cur 3; text 3; frame 1 at 4: W 4 5, cur 6.
TEST(MRope, VideoFramesAreSeparateItems) {
  const auto p = mrope_positions({X, D, D, X, D, D}, {}, {{2, 2, 4}}, 2);
  EXPECT_EQ(p.t, (V{0, 1, 1, 3, 4, 4}));
  EXPECT_EQ(p.h, (V{0, 1, 1, 3, 4, 4}));
  EXPECT_EQ(p.w, (V{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(p.rope_delta, 0);
}

// mrope_section [24, 20, 20] (hd 128): H at 1, 4, .., 58; W at 2, 5, .., 59; T at 0, 3, .., 57
// and 60..63: 24 slots.
TEST(MRope, InterleaveSlotRule) {
  const std::array<int, 3> s{24, 20, 20};
  EXPECT_EQ(mrope_axis(0, s), 0);
  EXPECT_EQ(mrope_axis(1, s), 1);
  EXPECT_EQ(mrope_axis(2, s), 2);
  EXPECT_EQ(mrope_axis(57, s), 0);
  EXPECT_EQ(mrope_axis(58, s), 1);
  EXPECT_EQ(mrope_axis(59, s), 2);
  for (int i = 60; i < 64; ++i) EXPECT_EQ(mrope_axis(i, s), 0) << i;
  int counts[3] = {0, 0, 0};
  for (int i = 0; i < 64; ++i) ++counts[mrope_axis(i, s)];
  EXPECT_EQ(counts[0], 24);
  EXPECT_EQ(counts[1], 20);
  EXPECT_EQ(counts[2], 20);
}

// hd 12, theta 100, section [4, 1, 1]: slots 0..5 take T H W T T T (slot 4 is i%3 == 1 but
// not < 3). One token at (T 5, H 7, W 9): angle[i] = pos * 100^(-2i/12).
TEST(MRope, InterleavedTable) {
  MRopePositions p;
  p.t = {5};
  p.h = {7};
  p.w = {9};
  std::vector<float> cos, sin;
  mrope_table(cos, sin, p, 12, 100.0, {4, 1, 1});
  ASSERT_EQ(cos.size(), 6u);
  const double pos[6] = {5, 7, 9, 5, 5, 5};
  for (int i = 0; i < 6; ++i) {
    const double a = pos[i] * std::pow(100.0, -2.0 * i / 12);
    EXPECT_NEAR(cos[i], std::cos(a), 2e-6) << i;
    EXPECT_NEAR(sin[i], std::sin(a), 2e-6) << i;
  }
}

}  // namespace
}  // namespace qt
