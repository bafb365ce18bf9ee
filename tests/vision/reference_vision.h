// An independent fp64 evaluation of the Qwen3-VL vision tower's forward, written straight from
// ../shared/docs/qwen3-spec.md 4.2 with plain loops (no engine code: its own patch order,
// interpolation, 2-D RoPE, attention, norms), used as the oracle for the program's forward and,
// through central finite differences, for its backward. Parameters are looked up by their
// official names (spec 6.3) in fp64.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "vision/vision_config.h"

namespace qt::test {

class ReferenceVision {
 public:
  using Lookup = std::function<const double*(const std::string&)>;
  struct Outputs {
    std::vector<double> merged;                  // [N/4, out]
    std::vector<std::vector<double>> deepstack;  // [n_ds][N/4, out]
  };

  ReferenceVision(const VisionConfig& c, std::vector<ImageGrid> grids)
      : c_(c), grids_(std::move(grids)) {
    for (const auto& g : grids_)
      for (int t = 0; t < g.t; ++t) {
        frame_start_.push_back(static_cast<int>(rc_.size()));
        // merge-block order: blocks (bh, bw) in raster order, inside each the 2x2 in raster order
        const int m = c_.spatial_merge_size;
        for (int bh = 0; bh < g.h / m; ++bh)
          for (int bw = 0; bw < g.w / m; ++bw)
            for (int i = 0; i < m * m; ++i) {
              rc_.push_back({bh * m + i / m, bw * m + i % m});
              hw_.push_back({g.h, g.w});
            }
      }
    frame_start_.push_back(static_cast<int>(rc_.size()));
  }

  int patches() const { return static_cast<int>(rc_.size()); }

  // The position-table rows that some patch reads with a non-zero weight.
  std::set<int> used_table_rows() const {
    std::set<int> rows;
    for (std::size_t n = 0; n < rc_.size(); ++n)
      for (const auto& [row, wgt] : taps(n))
        if (wgt != 0) rows.insert(row);
    return rows;
  }

  // pixels [N, 1536] in the program's row order.
  Outputs forward(const std::vector<double>& pixels, const Lookup& W) const {
    const int N = patches(), hv = c_.hidden_size, K = c_.patch_dim();
    Mat x = affine(Mat(N, K, pixels), W("model.visual.patch_embed.proj.weight"),
                   W("model.visual.patch_embed.proj.bias"), hv);
    const double* table = W("model.visual.pos_embed.weight");
    for (int n = 0; n < N; ++n)
      for (const auto& [row, wgt] : taps(n))
        for (int c = 0; c < hv; ++c) x(n, c) += wgt * table[static_cast<std::size_t>(row) * hv + c];
    Outputs out;
    for (int b = 0; b < c_.depth; ++b) {
      const std::string p = "model.visual.blocks." + std::to_string(b) + ".";
      Mat a = attention(affine(layernorm(x, W(p + "norm1.weight"), W(p + "norm1.bias")),
                               W(p + "attn.qkv.weight"), W(p + "attn.qkv.bias"), 3 * hv));
      x = add(x, affine(a, W(p + "attn.proj.weight"), W(p + "attn.proj.bias"), hv));
      Mat h = affine(layernorm(x, W(p + "norm2.weight"), W(p + "norm2.bias")),
                     W(p + "mlp.linear_fc1.weight"), W(p + "mlp.linear_fc1.bias"),
                     c_.intermediate_size);
      for (double& e : h.v) {
        const double u = std::sqrt(2.0 / M_PI) * (e + 0.044715 * e * e * e);
        e = 0.5 * e * (1.0 + std::tanh(u));
      }
      x = add(x, affine(h, W(p + "mlp.linear_fc2.weight"), W(p + "mlp.linear_fc2.bias"), hv));
      for (std::size_t j = 0; j < c_.deepstack_visual_indexes.size(); ++j)
        if (c_.deepstack_visual_indexes[j] == b) {
          const std::string q = "model.visual.deepstack_merger_list." + std::to_string(j) + ".";
          Mat v = shuffle(x);
          out.deepstack.push_back(merger_mlp(layernorm(v, W(q + "norm.weight"), W(q + "norm.bias")), W, q).v);
        }
    }
    const std::string q = "model.visual.merger.";
    out.merged = merger_mlp(shuffle(layernorm(x, W(q + "norm.weight"), W(q + "norm.bias"))), W, q).v;
    return out;
  }

 private:
  struct Mat {
    int r = 0, c = 0;
    std::vector<double> v;
    Mat(int rows, int cols) : r(rows), c(cols), v(static_cast<std::size_t>(rows) * cols, 0.0) {}
    Mat(int rows, int cols, std::vector<double> d) : r(rows), c(cols), v(std::move(d)) {}
    double& operator()(int i, int j) { return v[static_cast<std::size_t>(i) * c + j]; }
    double operator()(int i, int j) const { return v[static_cast<std::size_t>(i) * c + j]; }
  };
  struct RC {
    int row, col;
  };

  // The 4 bilinear taps (align_corners=True) of patch n as (table row, weight).
  std::vector<std::pair<int, double>> taps(std::size_t n) const {
    const int side = static_cast<int>(std::lround(std::sqrt(double(c_.num_position_embeddings))));
    auto axis = [&](int i, int len) {
      const double s = len > 1 ? double(i) * (side - 1) / (len - 1) : 0.0;
      const int lo = static_cast<int>(std::floor(s));
      const int hi = std::min(lo + 1, side - 1);
      return std::vector<std::pair<int, double>>{{lo, 1.0 - (s - lo)}, {hi, s - lo}};
    };
    std::vector<std::pair<int, double>> out;
    for (const auto& [r, wr] : axis(rc_[n].row, hw_[n].row))
      for (const auto& [cc, wc] : axis(rc_[n].col, hw_[n].col)) out.push_back({r * side + cc, wr * wc});
    return out;
  }

  // y = x w^T + b, w [out, x.c]
  static Mat affine(const Mat& x, const double* w, const double* b, int out) {
    Mat y(x.r, out);
    for (int i = 0; i < x.r; ++i)
      for (int o = 0; o < out; ++o) {
        double s = b[o];
        for (int k = 0; k < x.c; ++k) s += x(i, k) * w[static_cast<std::size_t>(o) * x.c + k];
        y(i, o) = s;
      }
    return y;
  }
  static Mat add(Mat a, const Mat& b) {
    for (std::size_t i = 0; i < a.v.size(); ++i) a.v[i] += b.v[i];
    return a;
  }
  Mat layernorm(const Mat& x, const double* w, const double* b) const {
    Mat y(x.r, x.c);
    for (int i = 0; i < x.r; ++i) {
      double mu = 0, var = 0;
      for (int k = 0; k < x.c; ++k) mu += x(i, k) / x.c;
      for (int k = 0; k < x.c; ++k) var += (x(i, k) - mu) * (x(i, k) - mu) / x.c;
      for (int k = 0; k < x.c; ++k)
        y(i, k) = (x(i, k) - mu) / std::sqrt(var + c_.layer_norm_eps) * w[k] + b[k];
    }
    return y;
  }
  // [N, hv] -> [N/4, 4hv]: the same numbers, 4 rows to one.
  Mat shuffle(const Mat& x) const {
    const int m = c_.spatial_merge_size * c_.spatial_merge_size;
    return Mat(x.r / m, x.c * m, x.v);
  }
  Mat merger_mlp(const Mat& x, const Lookup& W, const std::string& q) const {
    Mat h = affine(x, W(q + "linear_fc1.weight"), W(q + "linear_fc1.bias"), x.c);
    for (double& e : h.v) e = 0.5 * e * (1.0 + std::erf(e / std::sqrt(2.0)));
    return affine(h, W(q + "linear_fc2.weight"), W(q + "linear_fc2.bias"), c_.out_hidden_size);
  }
  // 2-D RoPE on one head's vector of patch n: emb = concat(f, f), f = (row inv, col inv),
  // x' = x cos(emb) + rotate_half(x) sin(emb).
  void rotate(double* x, int n, int hd) const {
    const int q = hd / 4;
    std::vector<double> emb(hd), y(hd);
    for (int j = 0; j < q; ++j) {
      const double inv = 1.0 / std::pow(c_.rope_theta, 2.0 * j / (hd / 2));
      emb[j] = emb[j + hd / 2] = rc_[n].row * inv;
      emb[j + q] = emb[j + q + hd / 2] = rc_[n].col * inv;
    }
    for (int d = 0; d < hd; ++d) {
      const double rh = d < hd / 2 ? -x[d + hd / 2] : x[d - hd / 2];
      y[d] = x[d] * std::cos(emb[d]) + rh * std::sin(emb[d]);
    }
    std::copy(y.begin(), y.end(), x);
  }
  // qkv [N, 3hv] -> attention output [N, hv], each frame attending to itself only.
  Mat attention(Mat qkv) const {
    const int N = qkv.r, hv = c_.hidden_size, nh = c_.num_heads, hd = hv / nh;
    for (int n = 0; n < N; ++n)
      for (int h = 0; h < nh; ++h) {
        rotate(&qkv(n, h * hd), n, hd);
        rotate(&qkv(n, hv + h * hd), n, hd);
      }
    Mat out(N, hv);
    for (std::size_t f = 0; f + 1 < frame_start_.size(); ++f) {
      const int lo = frame_start_[f], hi = frame_start_[f + 1];
      for (int h = 0; h < nh; ++h)
        for (int i = lo; i < hi; ++i) {
          std::vector<double> s(hi - lo);
          for (int j = lo; j < hi; ++j) {
            double d = 0;
            for (int e = 0; e < hd; ++e) d += qkv(i, h * hd + e) * qkv(j, hv + h * hd + e);
            s[j - lo] = d / std::sqrt(double(hd));
          }
          const double mx = *std::max_element(s.begin(), s.end());
          double z = 0;
          for (double& e : s) z += (e = std::exp(e - mx));
          for (int j = lo; j < hi; ++j)
            for (int e = 0; e < hd; ++e) out(i, h * hd + e) += s[j - lo] / z * qkv(j, 2 * hv + h * hd + e);
        }
    }
    return out;
  }

  VisionConfig c_;
  std::vector<ImageGrid> grids_;
  std::vector<RC> rc_;  // [N] (row, col) of each patch in its frame
  std::vector<RC> hw_;  // [N] (h, w) of its image's grid
  std::vector<int> frame_start_;
};

}  // namespace qt::test
