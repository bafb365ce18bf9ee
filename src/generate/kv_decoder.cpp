// Qwen3 forward with a key/value cache (kv_decoder.h). Shapes: n new rows; H hidden; Q = nh*hd;
// KV = nkv*hd; I intermediate; V vocabulary; cap cache positions.
#include "generate/kv_decoder.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "model/cpu_ops.h"
#include "model/layer_program.h"
#include "ops/linear.h"
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
struct OwnArena {  // a base before CpuOps: the arena exists before CpuOps takes its buffers
  HostArena arena;
};
}  // namespace

// The program's CPU ops with attention over the cache: the program's k and v of the new rows are
// the cache rows [len, len + n) of layer l (qk_norm_rope and copy_columns write them there), and
// query row i attends to positions [0, len + i]. The rest is CpuOps unchanged (fp32 reference
// ops, RoPE at the positions set_positions gives).
class KvCpuOps : private OwnArena, public CpuOps {
 public:
  KvCpuOps(const ModelConfig& cfg, int capacity)
      : CpuOps(cfg, ForwardOnly{capacity, capacity}, arena), cfg_(cfg), cap_(capacity) {}

  // The cache of the next call's n rows: layers' keys and values at k, v [L, cap, nkv, hd], len
  // positions held before them.
  void set_cache(const float* k, const float* v, int len, int n) {
    k_ = k;
    v_ = v;
    len_ = len;
    n_ = n;
  }

  // Hides CpuOps::attention (the program is a template over the Ops type, not virtual).
  void attention(int l, float* out, float* /*lse*/, const float* q, const float* k,
                 const float* v) {
    const int Q = cfg_.q_dim(), KV = cfg_.kv_dim();
    const std::size_t layer = static_cast<std::size_t>(l) * cap_ * KV;
    const float* kc = k_ + layer;  // [cap, nkv, hd]
    const float* vc = v_ + layer;
    QT_CHECK(k == kc + static_cast<std::size_t>(len_) * KV &&
                 v == vc + static_cast<std::size_t>(len_) * KV,
             "the new keys and values must be written into layer {}'s cache", l);
    for (int i = 0; i < n_; ++i)  // query i sees positions [0, len + i]
      cached_attention(out + static_cast<std::size_t>(i) * Q, q + static_cast<std::size_t>(i) * Q,
                       kc, vc, len_ + i + 1, cfg_.num_heads, cfg_.num_kv_heads, cfg_.head_dim);
  }

 private:
  ModelConfig cfg_;
  int cap_;
  const float *k_ = nullptr, *v_ = nullptr;
  int len_ = 0, n_ = 0;
};

KvDecoder::KvDecoder(const ModelConfig& cfg, const float* params, int capacity)
    : cfg_(cfg), layout_(cfg), P_(params), cap_(capacity) {
  QT_CHECK(cfg.num_heads % cfg.num_kv_heads == 0, "heads {} not divisible by kv heads {}",
           cfg.num_heads, cfg.num_kv_heads);
  QT_CHECK(cfg.head_dim % 2 == 0, "head_dim {} must be even for RoPE", cfg.head_dim);
  QT_CHECK(capacity >= 1, "cache capacity {} < 1", capacity);
  check_fused_layout(cfg, off_);
  ops_ = std::make_unique<KvCpuOps>(cfg, cap_);
  const std::size_t cache = static_cast<std::size_t>(cfg.num_layers) * cap_ * cfg.kv_dim();
  k_.resize(cache);
  v_.resize(cache);
}

KvDecoder::~KvDecoder() = default;

const float* KvDecoder::append(std::span<const std::int32_t> ids, bool all_logits) {
  const int n = static_cast<int>(ids.size());
  const int H = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_layers;
  QT_CHECK(n >= 1 && len_ + n <= cap_, "append of {} tokens to a cache holding {} of {}", n, len_,
           cap_);
  for (int i = 0; i < n; ++i)
    QT_CHECK(ids[i] >= 0 && ids[i] < V, "token id {} at {} outside [0, {})", ids[i], i, V);
  const std::size_t N = n, Q = cfg_.q_dim(), KV = cfg_.kv_dim(), I = cfg_.intermediate_size;
  pos_.resize(N);
  for (int i = 0; i < n; ++i) pos_[i] = len_ + i;
  x_.resize(N * H);
  ln_.resize(N * H);
  tmp_.resize(N * H);
  rstd_.resize(N);
  qkv_.resize(N * (Q + 2 * KV));
  q_.resize(N * Q);
  att_.resize(N * Q);
  q_rstd_.resize(N * cfg_.num_heads);
  k_rstd_.resize(N * cfg_.num_kv_heads);
  gu_.resize(N * 2 * I);
  h_.resize(N * I);
  if (cfg_.is_moe()) {
    moe_probs_.resize(N * cfg_.num_experts);
    moe_w_.resize(N * cfg_.num_experts_per_tok);
    moe_idx_.resize(N * cfg_.num_experts_per_tok);
  }

  KvCpuOps& ops = *ops_;
  ops.set_rows(1, n);
  ops.set_positions(pos_.data());
  ops.set_cache(k_.data(), v_.data(), len_, n);
  ops.embedding(x_.data(), ids.data(), P_ + off_.embed, n);
  ops.rmsnorm(ln_.data(), rstd_.data(), x_.data(), L > 0 ? P_ + off_.layers[0].ln1 : P_ + off_.norm,
              n);
  // The layers in place on x_ and ln_ (LayerIO's in-place form); k and v into the cache.
  const LayerIO<float> io{x_.data(), ln_.data(), x_.data(), ln_.data(), rstd_.data(), tmp_.data()};
  for (int l = 0; l < L; ++l) {
    const std::size_t rows = static_cast<std::size_t>(l) * cap_ + len_;  // first new cache row
    LayerActs<float> a{qkv_.data(),         q_rstd_.data(), k_rstd_.data(), q_.data(),
                       k_.data() + rows * KV, v_.data() + rows * KV, att_.data(),
                       nullptr,             x_.data(),      ln_.data(),     rstd_.data(),
                       gu_.data(),          h_.data(),      moe_probs_.data(), moe_idx_.data(),
                       moe_w_.data()};
    const float* next_norm = l + 1 < L ? P_ + off_.layers[l + 1].ln1 : P_ + off_.norm;
    qwen3_layer_forward(ops, cfg_, l, n, layer_tensors(off_.layers[l], P_), next_norm, io, a);
  }
  len_ += n;
  // ln_ holds the final norm of every row; the lm head only over the rows asked for (the
  // program's lm_head_loss is the training head: every row, with the loss), so it stays here.
  const int rows = all_logits ? n : 1;
  logits_.resize(static_cast<std::size_t>(rows) * V);
  cpu::linear_forward(logits_.data(), ln_.data() + static_cast<std::size_t>(n - rows) * H,
                      P_ + off_.lm_head, rows, H, V);
  return logits_.data();
}

}  // namespace qt::gen
