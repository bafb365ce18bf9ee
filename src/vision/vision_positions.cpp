// Patch coordinates, position-table taps, 2-D RoPE tables and frame offsets (spec 4.2).
#include "vision/vision_positions.h"

#include <algorithm>
#include <cmath>

#include "qtrain/error.h"

namespace qt {

std::vector<PatchCoord> patch_coordinates(const std::vector<ImageGrid>& grids, int merge) {
  std::vector<PatchCoord> out;
  for (const auto& g : grids) {
    QT_CHECK(g.t >= 1 && g.h % merge == 0 && g.w % merge == 0,
             "image grid {}x{}x{} is not a whole number of {}x{} blocks", g.t, g.h, g.w, merge,
             merge);
    for (int t = 0; t < g.t; ++t)
      for (int bh = 0; bh < g.h / merge; ++bh)
        for (int bw = 0; bw < g.w / merge; ++bw)
          for (int mh = 0; mh < merge; ++mh)
            for (int mw = 0; mw < merge; ++mw) out.push_back({bh * merge + mh, bw * merge + mw});
  }
  return out;
}

namespace {

// The source coordinate of grid index i of n on a table side (align_corners=True), fp32.
float source_coord(int i, int n, int side) {
  return static_cast<float>(double(i) * (side - 1) / std::max(n - 1, 1));
}

}  // namespace

std::vector<PositionTaps> position_taps(const std::vector<ImageGrid>& grids, int merge, int side) {
  std::vector<PositionTaps> out;
  std::size_t at = 0;
  const auto coords = patch_coordinates(grids, merge);
  for (const auto& g : grids) {
    for (int p = 0; p < g.patches(); ++p, ++at) {
      const PatchCoord pc = coords[at];
      const float sr = source_coord(pc.row, g.h, side), sc = source_coord(pc.col, g.w, side);
      const int r0 = static_cast<int>(sr), c0 = static_cast<int>(sc);
      const int r1 = std::min(r0 + 1, side - 1), c1 = std::min(c0 + 1, side - 1);
      const float dr = sr - static_cast<float>(r0), dc = sc - static_cast<float>(c0);
      PositionTaps t;
      t.index = {r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1};
      t.weight = {(1 - dr) * (1 - dc), (1 - dr) * dc, dr * (1 - dc), dr * dc};
      out.push_back(t);
    }
  }
  return out;
}

void rope2d_table(std::vector<float>& cos, std::vector<float>& sin,
                  const std::vector<ImageGrid>& grids, int merge, int hd, double theta) {
  QT_CHECK(hd % 4 == 0, "2-D RoPE needs a head_dim multiple of 4, got {}", hd);
  const int half = hd / 2, quarter = hd / 4;
  std::vector<float> inv(quarter);
  for (int j = 0; j < quarter; ++j)  // fp32 as transformers: 1 / theta ** (float(2j) / half)
    inv[j] = 1.0f / std::pow(static_cast<float>(theta),
                             static_cast<float>(2 * j) / static_cast<float>(half));
  const auto coords = patch_coordinates(grids, merge);
  cos.assign(coords.size() * half, 0.0f);
  sin.assign(coords.size() * half, 0.0f);
  for (std::size_t n = 0; n < coords.size(); ++n) {
    for (int i = 0; i < half; ++i) {
      const int p = i < quarter ? coords[n].row : coords[n].col;
      const float angle = static_cast<float>(p) * inv[i % quarter];
      cos[n * half + i] = std::cos(angle);
      sin[n * half + i] = std::sin(angle);
    }
  }
}

std::vector<int> frame_offsets(const std::vector<ImageGrid>& grids) {
  std::vector<int> seg{0};
  for (const auto& g : grids)
    for (int t = 0; t < g.t; ++t) seg.push_back(seg.back() + g.h * g.w);
  return seg;
}

VisionBatch make_vision_batch(const VisionConfig& cfg, const std::vector<ImageGrid>& grids) {
  cfg.validate();
  VisionBatch b;
  b.grids = grids;
  b.patches = total_patches(grids);
  b.taps = position_taps(grids, cfg.spatial_merge_size, cfg.grid_side());
  rope2d_table(b.rope_cos, b.rope_sin, grids, cfg.spatial_merge_size, cfg.head_dim(),
               cfg.rope_theta);
  b.frames = frame_offsets(grids);
  return b;
}

}  // namespace qt
