#include "vision/image_resize.h"

#include <algorithm>
#include <cmath>

#include "qtrain/error.h"

namespace qt {

namespace {

// Keys' cubic convolution kernel, a = -0.5.
double keys_cubic(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2.0) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0.0;
}

// One pass over `lines` lines along a dimension: element k of line l is at
// base(l) + k * stride, in and out alike.
template <class In, class Out>
void resample_pass(const ResampleTaps& t, int lines, const In& in_at, const Out& out_at, int out) {
  const std::int32_t round = std::int32_t{1} << (t.precision - 1);
  for (int l = 0; l < lines; ++l)
    for (int i = 0; i < out; ++i) {
      std::int32_t acc = round;
      const std::int16_t* k = t.w16.data() + static_cast<std::size_t>(i) * t.max_taps;
      for (int j = 0; j < t.count[i]; ++j) acc += static_cast<std::int32_t>(in_at(l, t.first[i] + j)) * k[j];
      out_at(l, i) = static_cast<std::uint8_t>(std::clamp(acc >> t.precision, 0, 255));
    }
}

}  // namespace

ResampleTaps bicubic_aa_taps(int in, int out) {
  QT_CHECK(in >= 1 && out >= 1, "resize {} -> {} pixels", in, out);
  ResampleTaps t;
  const double scale = static_cast<double>(in) / out;
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;  // interp size 4, halved
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  t.max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.first.resize(out);
  t.count.resize(out);
  t.w.assign(static_cast<std::size_t>(out) * t.max_taps, 0.0);
  for (int i = 0; i < out; ++i) {
    const double center = scale * (i + 0.5);
    const auto lo = std::max<std::int64_t>(static_cast<std::int64_t>(center - support + 0.5), 0);
    const auto hi = std::min<std::int64_t>(static_cast<std::int64_t>(center + support + 0.5), in);
    t.first[i] = static_cast<int>(lo);
    t.count[i] = static_cast<int>(hi - lo);
    double* w = t.w.data() + static_cast<std::size_t>(i) * t.max_taps;
    double total = 0;
    for (int j = 0; j < t.count[i]; ++j) total += w[j] = keys_cubic((j + lo - center + 0.5) * invscale);
    if (total != 0.0)
      for (int j = 0; j < t.count[i]; ++j) w[j] /= total;
  }
  const double w_max = *std::max_element(t.w.begin(), t.w.end());
  for (t.precision = 0; t.precision < 22; ++t.precision)
    if (static_cast<int>(0.5 + w_max * (1 << (t.precision + 1))) >= (1 << 15)) break;
  t.w16.resize(t.w.size());
  for (std::size_t k = 0; k < t.w.size(); ++k) {
    const double v = t.w[k] * (1 << t.precision);
    t.w16[k] = static_cast<std::int16_t>(v < 0 ? static_cast<int>(-0.5 + v) : static_cast<int>(0.5 + v));
  }
  return t;
}

std::vector<std::uint8_t> resize_bicubic_aa(const std::uint8_t* src, int C, int h, int w,
                                            int out_h, int out_w) {
  std::vector<std::uint8_t> cur(src, src + static_cast<std::size_t>(C) * h * w);
  if (out_w != w) {  // rows: C h lines of w -> out_w
    const ResampleTaps t = bicubic_aa_taps(w, out_w);
    std::vector<std::uint8_t> next(static_cast<std::size_t>(C) * h * out_w);
    resample_pass(
        t, C * h, [&](int l, int k) { return cur[static_cast<std::size_t>(l) * w + k]; },
        [&](int l, int i) -> std::uint8_t& { return next[static_cast<std::size_t>(l) * out_w + i]; },
        out_w);
    cur.swap(next);
    w = out_w;
  }
  if (out_h != h) {  // columns: C w lines of h -> out_h (line l: channel l / w, column l % w)
    const ResampleTaps t = bicubic_aa_taps(h, out_h);
    std::vector<std::uint8_t> next(static_cast<std::size_t>(C) * out_h * w);
    resample_pass(
        t, C * w,
        [&](int l, int k) { return cur[(static_cast<std::size_t>(l / w) * h + k) * w + l % w]; },
        [&](int l, int i) -> std::uint8_t& {
          return next[(static_cast<std::size_t>(l / w) * out_h + i) * w + l % w];
        },
        out_h);
    cur.swap(next);
  }
  return cur;
}

}  // namespace qt
