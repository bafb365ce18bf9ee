// The processor's antialiased bicubic resize of 8-bit images (vision/image_resize.h) on cases
// worked by hand from ATen's algorithm: the taps and weights of a halving and a doubling, the
// int16 weights and their precision, two output pixels, and what any resize must keep (a flat
// image stays flat, an unchanged size is a copy). Bit-exactness against torchvision on real
// images comes with the transformers fixture of the processor (issue 20).
#include <gtest/gtest.h>

#include <array>
#include <vector>

#include "vision/image_resize.h"

namespace qt {
namespace {

TEST(ImageResize, HalvingTapsAndWeights) {
  // 4 -> 2: scale 2, support 4, filter argument (j + first - center + 0.5) / 2.
  // Output 0, center 1: taps 0..3 at -0.25, 0.25, 0.75, 1.25: Keys' cubic gives 0.8671875,
  // 0.8671875, 0.2265625, -0.0703125 (sum 1.890625), normalised below. Output 1 mirrors it.
  const ResampleTaps t = bicubic_aa_taps(4, 2);
  EXPECT_EQ(t.max_taps, 9);
  EXPECT_EQ(t.first, (std::vector<int>{0, 0}));
  EXPECT_EQ(t.count, (std::vector<int>{4, 4}));
  const double a = 0.8671875 / 1.890625, b = 0.2265625 / 1.890625, c = -0.0703125 / 1.890625;
  const double want0[] = {a, a, b, c}, want1[] = {c, b, a, a};
  for (int j = 0; j < 4; ++j) {
    EXPECT_NEAR(t.w[j], want0[j], 1e-15) << j;
    EXPECT_NEAR(t.w[9 + j], want1[j], 1e-15) << j;
  }
  // The largest weight 0.4587 x 2^17 >= 2^15 first at precision 16: weights x 65536, rounded.
  EXPECT_EQ(t.precision, 16u);
  EXPECT_EQ(t.w16[0], 30060);
  EXPECT_EQ(t.w16[2], 7853);
  EXPECT_EQ(t.w16[3], -2437);
}

TEST(ImageResize, DoublingTapsAndWeights) {
  // 2 -> 4: scale 0.5, support 2, argument j + first - center + 0.5. Output 0, center 0.25:
  // taps 0, 1 at 0.25, 1.25: 0.8671875 and -0.0703125, normalised.
  const ResampleTaps t = bicubic_aa_taps(2, 4);
  EXPECT_EQ(t.first[0], 0);
  EXPECT_EQ(t.count[0], 2);
  EXPECT_NEAR(t.w[0], 0.8671875 / 0.796875, 1e-15);
  EXPECT_NEAR(t.w[1], -0.0703125 / 0.796875, 1e-15);
}

TEST(ImageResize, OutputPixelsOfAHalving) {
  // Row 10, 20, 30, 40 -> 2 pixels: (2^15 + sum of pixel x int16 weight) >> 16:
  // (32768 + 10 x 30060 + 20 x 30060 + 30 x 7853 - 40 x 2437) >> 16 = 1072678 >> 16 = 16, and
  // the mirror (32768 - 10 x 2437 + 20 x 7853 + 30 x 30060 + 40 x 30060) >> 16 = 34.
  const std::uint8_t row[] = {10, 20, 30, 40};
  EXPECT_EQ(resize_bicubic_aa(row, 1, 1, 4, 1, 2), (std::vector<std::uint8_t>{16, 34}));
  // The same pixels as a column: the height pass alone.
  EXPECT_EQ(resize_bicubic_aa(row, 1, 4, 1, 2, 1), (std::vector<std::uint8_t>{16, 34}));
}

TEST(ImageResize, FlatImagesStayFlatAndEqualSizesAreCopies) {
  for (const auto& [h, w, oh, ow] : {std::array<int, 4>{37, 53, 64, 96},
                                     std::array<int, 4>{37, 53, 13, 20},
                                     std::array<int, 4>{5, 400, 32, 32}}) {
    const std::vector<std::uint8_t> flat(static_cast<std::size_t>(3) * h * w, 200);
    const auto out = resize_bicubic_aa(flat.data(), 3, h, w, oh, ow);
    ASSERT_EQ(out.size(), static_cast<std::size_t>(3) * oh * ow);
    for (std::uint8_t v : out) ASSERT_EQ(v, 200) << h << "x" << w << " -> " << oh << "x" << ow;
  }
  std::vector<std::uint8_t> img(2 * 3 * 4);
  for (std::size_t i = 0; i < img.size(); ++i) img[i] = static_cast<std::uint8_t>(i * 11);
  EXPECT_EQ(resize_bicubic_aa(img.data(), 2, 3, 4, 3, 4), img);
}

TEST(ImageResize, OvershootIsClampedTo8Bits) {
  // A step 0 | 255 doubled: the cubic's negative lobes overshoot below 0 and above 255.
  const std::uint8_t row[] = {0, 0, 255, 255};
  const auto out = resize_bicubic_aa(row, 1, 1, 4, 1, 8);
  EXPECT_EQ(out.front(), 0);
  EXPECT_EQ(out.back(), 255);
  for (std::size_t i = 1; i < out.size(); ++i) EXPECT_GE(out[i], out[i - 1]) << i;
}

}  // namespace
}  // namespace qt
