#include "vision/image_patches.h"

#include <algorithm>
#include <cmath>

#include "qtrain/error.h"

namespace qt {

namespace {

// Python's round() of a non-negative x / factor, ties to even, times factor.
std::int64_t round_to_multiple(double x, int factor) {
  return static_cast<std::int64_t>(std::nearbyint(x / factor)) * factor;  // FE_TONEAREST: even
}

}  // namespace

ImageSize smart_resize(int h, int w, const char* what, int factor, std::int64_t min_pixels,
                       std::int64_t max_pixels) {
  if (h < 1 || w < 1) fail_user("{}: the image is {} x {} pixels", what, h, w);
  if (static_cast<double>(std::max(h, w)) / std::min(h, w) > 200)
    fail_user("{}: the image is {} x {} pixels, an aspect ratio above 200 (the Qwen3-VL image "
              "processor refuses it)", what, h, w);
  std::int64_t hb = round_to_multiple(h, factor), wb = round_to_multiple(w, factor);
  if (hb * wb > max_pixels) {
    const double beta = std::sqrt(static_cast<double>(h) * w / static_cast<double>(max_pixels));
    hb = std::max<std::int64_t>(factor, static_cast<std::int64_t>(std::floor(h / beta / factor)) * factor);
    wb = std::max<std::int64_t>(factor, static_cast<std::int64_t>(std::floor(w / beta / factor)) * factor);
  } else if (hb * wb < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / (static_cast<double>(h) * w));
    hb = static_cast<std::int64_t>(std::ceil(h * beta / factor)) * factor;
    wb = static_cast<std::int64_t>(std::ceil(w * beta / factor)) * factor;
  }
  return {static_cast<int>(hb), static_cast<int>(wb)};
}

std::vector<float> patch_rows(const std::vector<const float*>& frames, int h, int w,
                              const VisionConfig& cfg, ImageGrid& grid) {
  const int P = cfg.patch_size, T = cfg.temporal_patch_size, M = cfg.spatial_merge_size;
  const int C = cfg.in_channels;
  QT_CHECK(h % (P * M) == 0 && w % (P * M) == 0, "frame {} x {} is not in whole merge blocks of "
           "{} pixels", h, w, P * M);
  QT_CHECK(!frames.empty() && frames.size() % T == 0, "{} frames are not whole temporal patches "
           "of {}", frames.size(), T);
  grid = {static_cast<int>(frames.size()) / T, h / P, w / P};
  const int D = cfg.patch_dim();  // (c, t, py, px)
  std::vector<float> out(static_cast<std::size_t>(grid.patches()) * D);
  std::size_t row = 0;
  for (int g = 0; g < grid.t; ++g)
    for (int bh = 0; bh < grid.h / M; ++bh)
      for (int bw = 0; bw < grid.w / M; ++bw)
        for (int mh = 0; mh < M; ++mh)
          for (int mw = 0; mw < M; ++mw, ++row) {
            const int y0 = (bh * M + mh) * P, x0 = (bw * M + mw) * P;
            float* dst = out.data() + row * D;
            for (int c = 0; c < C; ++c)
              for (int t = 0; t < T; ++t) {
                const float* src = frames[static_cast<std::size_t>(g) * T + t] +
                                   static_cast<std::size_t>(c) * h * w;
                for (int py = 0; py < P; ++py)
                  for (int px = 0; px < P; ++px)
                    *dst++ = src[static_cast<std::size_t>(y0 + py) * w + x0 + px];
              }
          }
  return out;
}

std::vector<float> image_patch_rows(const float* frame, int h, int w, const VisionConfig& cfg,
                                    ImageGrid& grid) {
  return patch_rows(std::vector<const float*>(cfg.temporal_patch_size, frame), h, w, cfg, grid);
}

}  // namespace qt
