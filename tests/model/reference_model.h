// An independent fp64 evaluation of the Qwen3 dense forward and loss, written straight from
// ../shared/docs/qwen3-spec.md with plain loops (no engine code), used as the oracle for the
// engine's forward and, through central finite differences, for its backward.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "qtrain/model_config.h"
#include "qtrain/params.h"

namespace qt::test {

class ReferenceModel {
 public:
  ReferenceModel(const ModelConfig& c, const ParamLayout& layout) : c_(c), layout_(layout) {}

  // Mean cross-entropy over counted targets; logits [B*T, V] written if non-null.
  double loss(const std::vector<double>& P, const std::vector<std::int32_t>& in,
              const std::vector<std::int32_t>& tg, int B, int T,
              std::vector<double>* logits_out = nullptr) const {
    const int H = c_.hidden_size, V = c_.vocab_size, hd = c_.head_dim, nh = c_.num_heads;
    const int nkv = c_.num_kv_heads, I = c_.intermediate_size;
    auto W = [&](const std::string& n) { return &P[layout_.find(n).offset]; };
    const double* E = W("model.embed_tokens.weight");
    const double* LM = c_.tie_word_embeddings ? E : W("lm_head.weight");
    double total = 0;
    long counted = 0;
    if (logits_out) logits_out->assign(static_cast<std::size_t>(B) * T * V, 0.0);
    for (int b = 0; b < B; ++b) {
      Mat x(T, H);
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) x(t, h) = E[in[b * T + t] * H + h];
      for (int l = 0; l < c_.num_layers; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        Mat ln = rmsnorm(x, W(p + "input_layernorm.weight"));
        Mat q = matmul_t(ln, W(p + "self_attn.q_proj.weight"), nh * hd);
        Mat k = matmul_t(ln, W(p + "self_attn.k_proj.weight"), nkv * hd);
        Mat v = matmul_t(ln, W(p + "self_attn.v_proj.weight"), nkv * hd);
        head_norm_rope(q, nh, W(p + "self_attn.q_norm.weight"));
        head_norm_rope(k, nkv, W(p + "self_attn.k_norm.weight"));
        Mat att(T, nh * hd);
        for (int j = 0; j < nh; ++j) {
          const int g = j / (nh / nkv);
          for (int t = 0; t < T; ++t) {
            std::vector<double> s(t + 1);
            double mx = -1e300;
            for (int u = 0; u <= t; ++u) {
              double d = 0;
              for (int i = 0; i < hd; ++i) d += q(t, j * hd + i) * k(u, g * hd + i);
              s[u] = d / std::sqrt(static_cast<double>(hd));
              mx = std::max(mx, s[u]);
            }
            double z = 0;
            for (auto& e : s) z += (e = std::exp(e - mx));
            for (int u = 0; u <= t; ++u)
              for (int i = 0; i < hd; ++i) att(t, j * hd + i) += s[u] / z * v(u, g * hd + i);
          }
        }
        Mat o = matmul_t(att, W(p + "self_attn.o_proj.weight"), H);
        for (std::size_t i = 0; i < x.a.size(); ++i) x.a[i] += o.a[i];
        Mat ln2 = rmsnorm(x, W(p + "post_attention_layernorm.weight"));
        Mat gt = matmul_t(ln2, W(p + "mlp.gate_proj.weight"), I);
        Mat up = matmul_t(ln2, W(p + "mlp.up_proj.weight"), I);
        for (std::size_t i = 0; i < gt.a.size(); ++i)
          gt.a[i] = gt.a[i] / (1.0 + std::exp(-gt.a[i])) * up.a[i];
        Mat dn = matmul_t(gt, W(p + "mlp.down_proj.weight"), H);
        for (std::size_t i = 0; i < x.a.size(); ++i) x.a[i] += dn.a[i];
      }
      Mat xf = rmsnorm(x, W("model.norm.weight"));
      Mat logits = matmul_t(xf, LM, V);
      for (int t = 0; t < T; ++t) {
        if (logits_out)
          for (int v = 0; v < V; ++v) (*logits_out)[(static_cast<std::size_t>(b) * T + t) * V + v] = logits(t, v);
        const int y = tg[b * T + t];
        if (y == -100) continue;
        double mx = -1e300, z = 0;
        for (int v = 0; v < V; ++v) mx = std::max(mx, logits(t, v));
        for (int v = 0; v < V; ++v) z += std::exp(logits(t, v) - mx);
        total += mx + std::log(z) - logits(t, y);
        ++counted;
      }
    }
    return total / static_cast<double>(counted);
  }

 private:
  struct Mat {
    int r, c;
    std::vector<double> a;
    Mat(int r_, int c_) : r(r_), c(c_), a(static_cast<std::size_t>(r_) * c_, 0.0) {}
    double& operator()(int i, int j) { return a[static_cast<std::size_t>(i) * c + j]; }
    double operator()(int i, int j) const { return a[static_cast<std::size_t>(i) * c + j]; }
  };

  Mat rmsnorm(const Mat& x, const double* w) const {
    Mat y(x.r, x.c);
    for (int i = 0; i < x.r; ++i) {
      double ss = 0;
      for (int j = 0; j < x.c; ++j) ss += x(i, j) * x(i, j);
      const double r = 1.0 / std::sqrt(ss / x.c + c_.rms_norm_eps);
      for (int j = 0; j < x.c; ++j) y(i, j) = w[j] * x(i, j) * r;
    }
    return y;
  }

  // y = x W^T with W [out, x.c]
  static Mat matmul_t(const Mat& x, const double* w, int out) {
    Mat y(x.r, out);
    for (int i = 0; i < x.r; ++i)
      for (int o = 0; o < out; ++o) {
        double s = 0;
        for (int j = 0; j < x.c; ++j) s += x(i, j) * w[static_cast<std::size_t>(o) * x.c + j];
        y(i, o) = s;
      }
    return y;
  }

  // Per-head RMSNorm over head_dim, then rotate_half RoPE at position t (angles in fp32, as
  // transformers computes them).
  void head_norm_rope(Mat& m, int heads, const double* w) const {
    const int hd = c_.head_dim;
    for (int t = 0; t < m.r; ++t)
      for (int h = 0; h < heads; ++h) {
        double* x = &m(t, h * hd);
        double ss = 0;
        for (int i = 0; i < hd; ++i) ss += x[i] * x[i];
        const double r = 1.0 / std::sqrt(ss / hd + c_.rms_norm_eps);
        std::vector<double> y(hd);
        for (int i = 0; i < hd; ++i) y[i] = w[i] * x[i] * r;
        for (int i = 0; i < hd / 2; ++i) {
          const float inv = 1.0f / std::pow(static_cast<float>(c_.rope_theta),
                                            static_cast<float>(2 * i) / static_cast<float>(hd));
          const double ang = static_cast<float>(static_cast<float>(t) * inv);
          const double cs = std::cos(ang), sn = std::sin(ang);
          x[i] = y[i] * cs - y[i + hd / 2] * sn;
          x[i + hd / 2] = y[i + hd / 2] * cs + y[i] * sn;
        }
      }
  }

  ModelConfig c_;
  const ParamLayout& layout_;
};

}  // namespace qt::test
