// Qwen3 forward with a key/value cache (kv_decoder.h). Shapes: n new rows; H hidden; Q = nh*hd;
// KV = nkv*hd; I intermediate; V vocabulary; cap cache positions.
#include "generate/kv_decoder.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"
#include "qtrain/error.h"

namespace qt::gen {

void cached_attention(float* out, const float* q, const float* k, const float* v, int len, int nh,
                      int nkv, int hd) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const int group = nh / nkv;
  const std::size_t ld = static_cast<std::size_t>(nkv) * hd;  // row stride of the cache
  std::vector<double> p(static_cast<std::size_t>(len));       // [len] scores, then weights
  std::vector<double> acc(static_cast<std::size_t>(hd));
  for (int h = 0; h < nh; ++h) {
    const float* qh = q + static_cast<std::size_t>(h) * hd;
    const std::size_t g = static_cast<std::size_t>(h / group) * hd;
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < len; ++j) {
      const float* kj = k + j * ld + g;
      float s = 0.0f;
      for (int d = 0; d < hd; ++d) s += qh[d] * kj[d];
      p[j] = static_cast<double>(s * scale);
      m = std::max(m, p[j]);
    }
    double sum = 0.0;
    for (int j = 0; j < len; ++j) sum += (p[j] = std::exp(p[j] - m));
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < len; ++j) {
      const float* vj = v + j * ld + g;
      for (int d = 0; d < hd; ++d) acc[d] += p[j] * vj[d];
    }
    float* oh = out + static_cast<std::size_t>(h) * hd;
    for (int d = 0; d < hd; ++d) oh[d] = static_cast<float>(acc[d] / sum);
  }
}

namespace {
void add_into(float* y, const float* x, std::size_t n) {  // y += x
  for (std::size_t i = 0; i < n; ++i) y[i] += x[i];
}
}  // namespace

KvDecoder::KvDecoder(const ModelConfig& cfg, const float* params, int capacity)
    : cfg_(cfg), layout_(cfg), P_(params), cap_(capacity) {
  QT_CHECK(cfg.num_heads % cfg.num_kv_heads == 0, "heads {} not divisible by kv heads {}",
           cfg.num_heads, cfg.num_kv_heads);
  QT_CHECK(cfg.head_dim % 2 == 0, "head_dim {} must be even for RoPE", cfg.head_dim);
  QT_CHECK(capacity >= 1, "cache capacity {} < 1", capacity);
  const int hd = cfg.head_dim;
  rope_cos_.resize(static_cast<std::size_t>(cap_) * hd / 2);
  rope_sin_.resize(rope_cos_.size());
  cpu::rope_table(rope_cos_.data(), rope_sin_.data(), cap_, hd, cfg.rope_theta);
  const std::size_t cache = static_cast<std::size_t>(cfg.num_layers) * cap_ * cfg.kv_dim();
  k_.resize(cache);
  v_.resize(cache);
}

void KvDecoder::layer(int l, int n) {
  const LayerOffsets& w = off_.layers[l];
  const int H = cfg_.hidden_size, Q = cfg_.q_dim(), KV = cfg_.kv_dim();
  const int I = cfg_.intermediate_size, nh = cfg_.num_heads, nkv = cfg_.num_kv_heads;
  const int hd = cfg_.head_dim;
  const double eps = cfg_.rms_norm_eps;
  const std::size_t nH = static_cast<std::size_t>(n) * H;
  // This layer's cache, and the rows of the n new positions in it.
  float* kc = k_.data() + static_cast<std::size_t>(l) * cap_ * KV;  // [cap, nkv, hd]
  float* vc = v_.data() + static_cast<std::size_t>(l) * cap_ * KV;
  float* k_new = kc + static_cast<std::size_t>(len_) * KV;  // [n, nkv, hd]
  float* v_new = vc + static_cast<std::size_t>(len_) * KV;
  // attention block: x += o_proj(attn(rmsnorm(x)))
  cpu::rmsnorm_forward(ln_.data(), rstd_.data(), x_.data(), P_ + w.ln1, n, H, eps);
  cpu::linear_forward(q_raw_.data(), ln_.data(), P_ + w.wq, n, H, Q);
  cpu::linear_forward(k_raw_.data(), ln_.data(), P_ + w.wk, n, H, KV);
  cpu::linear_forward(v_new, ln_.data(), P_ + w.wv, n, H, KV);
  cpu::rmsnorm_forward(q_.data(), rstd_.data(), q_raw_.data(), P_ + w.q_norm, n * nh, hd, eps);
  cpu::rmsnorm_forward(k_new, rstd_.data(), k_raw_.data(), P_ + w.k_norm, n * nkv, hd, eps);
  cpu::rope_forward(q_.data(), rope_cos_.data(), rope_sin_.data(), pos_.data(), 1, n, nh, hd);
  cpu::rope_forward(k_new, rope_cos_.data(), rope_sin_.data(), pos_.data(), 1, n, nkv, hd);
  for (int i = 0; i < n; ++i)  // query i sees positions [0, len + i]
    cached_attention(att_.data() + static_cast<std::size_t>(i) * Q,
                     q_.data() + static_cast<std::size_t>(i) * Q, kc, vc, len_ + i + 1, nh, nkv,
                     hd);
  cpu::linear_forward(tmp_.data(), att_.data(), P_ + w.wo, n, Q, H);
  add_into(x_.data(), tmp_.data(), nH);
  // MLP block: x += down(silu(gate(ln2)) * up(ln2))
  cpu::rmsnorm_forward(ln_.data(), rstd_.data(), x_.data(), P_ + w.ln2, n, H, eps);
  cpu::linear_forward(gate_.data(), ln_.data(), P_ + w.w_gate, n, H, I);
  cpu::linear_forward(up_.data(), ln_.data(), P_ + w.w_up, n, H, I);
  cpu::swiglu_forward(h_.data(), gate_.data(), up_.data(), n, I);
  cpu::linear_forward(tmp_.data(), h_.data(), P_ + w.w_down, n, I, H);
  add_into(x_.data(), tmp_.data(), nH);
}

const float* KvDecoder::append(std::span<const std::int32_t> ids, bool all_logits) {
  const int n = static_cast<int>(ids.size());
  const int H = cfg_.hidden_size, V = cfg_.vocab_size;
  QT_CHECK(n >= 1 && len_ + n <= cap_, "append of {} tokens to a cache holding {} of {}", n, len_,
           cap_);
  for (int i = 0; i < n; ++i)
    QT_CHECK(ids[i] >= 0 && ids[i] < V, "token id {} at {} outside [0, {})", ids[i], i, V);
  const std::size_t N = n, Q = cfg_.q_dim(), KV = cfg_.kv_dim(), I = cfg_.intermediate_size;
  pos_.resize(N);
  for (int i = 0; i < n; ++i) pos_[i] = len_ + i;
  x_.resize(N * H);
  ln_.resize(N * H);
  rstd_.resize(N * std::max(cfg_.num_heads, cfg_.num_kv_heads));
  q_raw_.resize(N * Q);
  q_.resize(N * Q);
  k_raw_.resize(N * KV);
  att_.resize(N * Q);
  tmp_.resize(N * H);
  gate_.resize(N * I);
  up_.resize(N * I);
  h_.resize(N * I);

  cpu::embedding_forward(x_.data(), ids.data(), P_ + off_.embed, n, H);
  for (int l = 0; l < cfg_.num_layers; ++l) layer(l, n);
  len_ += n;
  // Final norm and lm head over the rows asked for.
  const int rows = all_logits ? n : 1;
  const float* x_last = x_.data() + static_cast<std::size_t>(n - rows) * H;
  cpu::rmsnorm_forward(ln_.data(), rstd_.data(), x_last, P_ + off_.norm, rows, H,
                       cfg_.rms_norm_eps);
  logits_.resize(static_cast<std::size_t>(rows) * V);
  cpu::linear_forward(logits_.data(), ln_.data(), P_ + off_.lm_head, rows, H, V);
  return logits_.data();
}

}  // namespace qt::gen
