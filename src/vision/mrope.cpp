// Interleaved M-RoPE positions and tables (spec 4.4).
#include "vision/mrope.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "qtrain/error.h"

namespace qt {
namespace {

// Appends the positions of one visual item (grid t x gh x gw of merged tokens) starting at cur;
// returns the next cur: cur + max(gh, gw), as transformers 5.17 (whatever t is).
std::int64_t place_grid(MRopePositions& p, std::int64_t cur, int t, int gh, int gw) {
  for (int ti = 0; ti < t; ++ti)
    for (int hi = 0; hi < gh; ++hi)
      for (int wi = 0; wi < gw; ++wi) {
        p.t.push_back(cur + ti);
        p.h.push_back(cur + hi);
        p.w.push_back(cur + wi);
      }
  return cur + std::max(gh, gw);
}

}  // namespace

MRopePositions mrope_positions(const std::vector<TokenType>& types,
                               const std::vector<ImageGrid>& images,
                               const std::vector<ImageGrid>& videos, int merge) {
  MRopePositions p;
  std::int64_t cur = 0;
  std::size_t next_image = 0, next_video = 0;
  int next_frame = 0;  // of videos[next_video]
  const std::size_t S = types.size();
  for (std::size_t s = 0; s < S;) {
    std::size_t e = s;
    while (e < S && types[e] == types[s]) ++e;
    const std::int64_t n = static_cast<std::int64_t>(e - s);
    if (types[s] == TokenType::kText) {
      for (std::int64_t i = 0; i < n; ++i) {
        p.t.push_back(cur + i);
        p.h.push_back(cur + i);
        p.w.push_back(cur + i);
      }
      cur += n;
    } else if (types[s] == TokenType::kImage) {
      QT_CHECK(next_image < images.size(), "image run at token {} but only {} image grids", s,
               images.size());
      const ImageGrid g = images[next_image++];
      const int gh = g.h / merge, gw = g.w / merge;
      QT_CHECK(n == static_cast<std::int64_t>(g.t) * gh * gw,
               "image run at token {} has {} tokens, its grid {}x{}x{} gives {}", s, n, g.t, g.h,
               g.w, g.t * gh * gw);
      cur = place_grid(p, cur, g.t, gh, gw);
    } else {
      QT_CHECK(next_video < videos.size(), "video run at token {} but only {} video grids", s,
               videos.size());
      const ImageGrid g = videos[next_video];
      const int gh = g.h / merge, gw = g.w / merge;
      QT_CHECK(n == static_cast<std::int64_t>(gh) * gw,
               "video frame run at token {} has {} tokens, its grid {}x{} gives {}", s, n, g.h,
               g.w, gh * gw);
      cur = place_grid(p, cur, 1, gh, gw);
      if (++next_frame == g.t) {
        next_frame = 0;
        ++next_video;
      }
    }
    s = e;
  }
  std::int64_t top = -1;
  for (std::size_t i = 0; i < S; ++i) top = std::max({top, p.t[i], p.h[i], p.w[i]});
  p.rope_delta = top + 1 - static_cast<std::int64_t>(S);
  return p;
}

int mrope_axis(int i, const std::array<int, 3>& section) {
  if (i % 3 == 1 && i < 3 * section[1]) return 1;
  if (i % 3 == 2 && i < 3 * section[2]) return 2;
  return 0;
}

void mrope_table(std::vector<float>& cos, std::vector<float>& sin, const MRopePositions& pos,
                 int hd, double theta, const std::array<int, 3>& section) {
  const int half = hd / 2;
  QT_CHECK(section[0] + section[1] + section[2] == half,
           "mrope_section {}+{}+{} must sum to head_dim/2 = {}", section[0], section[1],
           section[2], half);
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i)
    inv[i] = 1.0f / std::pow(static_cast<float>(theta),
                             static_cast<float>(2 * i) / static_cast<float>(hd));
  const std::size_t S = pos.t.size();
  cos.assign(S * half, 0.0f);
  sin.assign(S * half, 0.0f);
  const std::vector<std::int64_t>* rows[3] = {&pos.t, &pos.h, &pos.w};
  for (std::size_t s = 0; s < S; ++s)
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>((*rows[mrope_axis(i, section)])[s]) * inv[i];
      cos[s * half + i] = std::cos(angle);
      sin[s * half + i] = std::sin(angle);
    }
}

}  // namespace qt
