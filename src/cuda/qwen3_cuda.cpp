// Qwen3 forward and backward on the GPU. Shapes: N = B*T rows, H hidden, Q = nh*hd,
// KV = nkv*hd, I intermediate, V vocabulary. Every residual add is fused with the norm that
// follows it (residual_rmsnorm_forward): layer l's output add produces layer l+1's input norm,
// or the final norm after the last layer. LoRA adapters (lora_) add into each fused projection's
// output right after its GEMM, and take their gradients right after the projection's backward.
#include "cuda/qwen3_cuda.h"

#include <algorithm>

#include "cuda/check.h"
#include "cuda/lora_cuda.h"
#include "ops/rope.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/cross_entropy.cuh"
#include "ops/cuda/embedding.cuh"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/qk_norm_rope.cuh"
#include "ops/cuda/rmsnorm.cuh"
#include "ops/cuda/swiglu.cuh"
#include "qtrain/error.h"

namespace qt::cuda {

namespace {
// bf16 logits per lm-head chunk. Each chunk's weight-gradient GEMM reads and writes the whole fp32
// lm-head gradient (1.2 GB for Qwen3-1.7B), so fewer, larger chunks move less: 1 GiB (3533 rows
// of Qwen3's vocabulary) ran 1.9% (1.7B) and 3.5% (8B-shaped layers) faster than 256 MiB on an
// H100; all 8192 rows (2.5 GB) gained only 0.1% more (docs/performance.md).
constexpr std::size_t kLogitsChunkBytes = std::size_t{1} << 30;

// dst[r, 0:cols] = src[r, 0:cols] for r < rows; row strides in elements.
void copy_columns(bf16* dst, int dst_ld, const bf16* src, int src_ld, int rows, int cols,
                  cudaStream_t s) {
  const std::size_t e = sizeof(bf16);
  QT_CHECK_CUDA(cudaMemcpy2DAsync(dst, dst_ld * e, src, src_ld * e, cols * e, rows,
                                  cudaMemcpyDeviceToDevice, s));
}
}  // namespace

Qwen3Cuda::Qwen3Cuda(const ModelConfig& cfg, int B, int T, DeviceArena& arena, bool recompute)
    : cfg_(cfg),
      layout_(cfg),
      plan_(plan_qwen3(cfg, layout_, MeshShape{}, 0)),
      unit_{cfg.num_layers},
      B_(B),
      T_(T),
      N_(B * T),
      recompute_(recompute) {
  QT_CHECK(cfg.head_dim == 64 || cfg.head_dim == 128,
           "the CUDA attention supports head_dim 64 and 128, not {}", cfg.head_dim);
  const std::size_t N = N_, H = cfg.hidden_size, Q = cfg.q_dim(), KV = cfg.kv_dim();
  const std::size_t I = cfg.intermediate_size, V = cfg.vocab_size, L = cfg.num_layers;
  // forward_backward's gradient watermark relies on the order embedding, layers, norm, lm head.
  QT_CHECK(off_.embed == 0 && off_.norm > (L > 0 ? off_.layers.back().w_down : 0) &&
               (cfg.tie_word_embeddings || off_.lm_head > off_.norm),
           "unexpected parameter layout order");
  for (const LayerOffsets& o : off_.layers)  // the fused q/k/v and gate/up GEMMs rely on it
    QT_CHECK(o.wk == o.wq + Q * H && o.wv == o.wk + KV * H && o.w_up == o.w_gate + I * H,
             "q/k/v_proj and gate/up_proj must be adjacent in the parameter layout");
  const int hd = cfg.head_dim, nh = cfg.num_heads, nkv = cfg.num_kv_heads;

  std::vector<float> cos(static_cast<std::size_t>(T) * hd / 2), sin(cos.size());
  cpu::rope_table(cos.data(), sin.data(), T, hd, cfg.rope_theta);
  cos_ = arena.allocate<float>(cos.size());
  sin_ = arena.allocate<float>(sin.size());
  upload(cos_, cos.data(), cos.size() * 4);
  upload(sin_, sin.data(), sin.size() * 4);

  for (std::size_t l = 0; l <= L; ++l) {
    x_.push_back(arena.allocate<bf16>(N * H));
    ln_.push_back(arena.allocate<bf16>(N * H));
    rstd_.push_back(arena.allocate<float>(N));
  }
  acts_.resize(recompute ? 1 : L);
  for (LayerActs& a : acts_) {
    a.qkv_raw = arena.allocate<bf16>(N * (Q + 2 * KV));
    a.q_rstd = arena.allocate<float>(N * nh);
    a.k_rstd = arena.allocate<float>(N * nkv);
    a.q = arena.allocate<bf16>(N * Q);
    a.k = arena.allocate<bf16>(N * KV);
    a.v = arena.allocate<bf16>(N * KV);
    a.att = arena.allocate<bf16>(N * Q);
    a.lse = arena.allocate<float>(static_cast<std::size_t>(B) * nh * T);
    a.x_mid = arena.allocate<bf16>(N * H);
    a.ln2 = arena.allocate<bf16>(N * H);
    a.rstd2 = arena.allocate<float>(N);
    a.gu = arena.allocate<bf16>(N * 2 * I);
    a.h = arena.allocate<bf16>(N * I);
  }
  tmp_ = arena.allocate<bf16>(N * H);
  dx_ = arena.allocate<bf16>(N * H);
  dtmp_ = arena.allocate<bf16>(N * H);
  dln_ = arena.allocate<bf16>(N * H);
  dh_ = arena.allocate<bf16>(N * I);
  datt_ = arena.allocate<bf16>(N * Q);
  dq_ = arena.allocate<bf16>(N * Q);
  dk_ = arena.allocate<bf16>(N * KV);
  dv_ = arena.allocate<bf16>(N * KV);
  dqkv_ = arena.allocate<bf16>(N * (Q + 2 * KV));
  chunk_ = static_cast<int>(std::clamp<std::size_t>(kLogitsChunkBytes / (V * 2), 1, N));
  logits_ = arena.allocate<bf16>(static_cast<std::size_t>(chunk_) * V);
  losses_ = arena.allocate<float>(chunk_);
  chunk_lse_ = arena.allocate<float>(chunk_);
  loss_sum_ = arena.allocate<double>(1);
  ws_bytes_ = std::max({rmsnorm_backward_workspace_bytes(N_, cfg.hidden_size),
                        qk_norm_rope_backward_workspace_bytes(B, T, nh, hd),
                        qk_norm_rope_backward_workspace_bytes(B, T, nkv, hd),
                        embedding_backward_workspace_bytes(N_)});
  ws_ = arena.allocate(ws_bytes_);
}

template <class T>
Qwen3Cuda::LayerTensors<T> Qwen3Cuda::layer_tensors(int l, T* unit) const {
  const LayerOffsets& o = off_.layers[l];
  const std::size_t base = plan_.units[unit_.layer(l)].range.begin;
  auto at = [&](std::size_t off) { return unit ? unit + (off - base) : nullptr; };
  return {at(o.ln1), at(o.wq), at(o.wo), at(o.q_norm), at(o.k_norm), at(o.ln2), at(o.w_gate),
          at(o.w_down)};
}

void Qwen3Cuda::layer_forward(int l, const LayerTensors<const bf16>& w, const bf16* next_norm,
                              cudaStream_t s) {
  LayerActs& a = acts(l);
  const int N = N_, H = cfg_.hidden_size, Q = cfg_.q_dim(), KV = cfg_.kv_dim();
  const int I = cfg_.intermediate_size, nh = cfg_.num_heads, nkv = cfg_.num_kv_heads;
  const int hd = cfg_.head_dim;
  const double eps = cfg_.rms_norm_eps;
  const int QKV = Q + 2 * KV;
  const bf16* ln1 = ln_[l];
  linear_forward(a.qkv_raw, ln1, w.wq, N, H, QKV, s);  // wq, wk, wv: one [QKV, H] matrix
  if (lora_) lora_->forward(l, LoraSite::kQKV, ln1, a.qkv_raw, s);
  qk_norm_rope_forward_strided(a.q, a.q_rstd, a.qkv_raw, QKV, w.q_norm, cos_, sin_, pos_,
                               B_, T_, nh, hd, eps, s);
  qk_norm_rope_forward_strided(a.k, a.k_rstd, a.qkv_raw + Q, QKV, w.k_norm, cos_, sin_,
                               pos_, B_, T_, nkv, hd, eps, s);
  copy_columns(a.v, KV, a.qkv_raw + Q + KV, QKV, N, KV, s);
  attention_forward(a.att, a.lse, a.q, a.k, a.v, B_, T_, nh, nkv, hd, s, pos_);
  linear_forward(tmp_, a.att, w.wo, N, Q, H, s);
  if (lora_) lora_->forward(l, LoraSite::kO, a.att, tmp_, s);
  residual_rmsnorm_forward(a.x_mid, a.ln2, a.rstd2, x_[l], tmp_, w.ln2, N, H, eps, s);
  linear_forward(a.gu, a.ln2, w.w_gate, N, H, 2 * I, s);  // w_gate, w_up: one [2I, H]
  if (lora_) lora_->forward(l, LoraSite::kGateUp, a.ln2, a.gu, s);
  swiglu_forward_strided(a.h, a.gu, a.gu + I, 2 * I, N, I, s);
  linear_forward(tmp_, a.h, w.w_down, N, I, H, s);
  if (lora_) lora_->forward(l, LoraSite::kDown, a.h, tmp_, s);
  residual_rmsnorm_forward(x_[l + 1], ln_[l + 1], rstd_[l + 1], a.x_mid, tmp_, next_norm, N, H,
                           eps, s);
}

Qwen3Cuda::Depth Qwen3Cuda::backward_depth(int l, bool frozen) const {
  if (!frozen || l > 0) return kBelow;
  // Frozen base, layer 0: down to the adapter nearest the input (every layer has the same).
  if (lora_->adapts(LoraSite::kQKV)) return kQKV;
  if (lora_->adapts(LoraSite::kO)) return kO;
  if (lora_->adapts(LoraSite::kGateUp)) return kGateUp;
  return kDown;
}

void Qwen3Cuda::layer_backward(int l, const LayerTensors<const bf16>& w,
                               const LayerTensors<float>& g, cudaStream_t s) {
  LayerActs& a = acts(l);
  const int N = N_, H = cfg_.hidden_size, Q = cfg_.q_dim(), KV = cfg_.kv_dim();
  const int I = cfg_.intermediate_size, nh = cfg_.num_heads, nkv = cfg_.num_kv_heads;
  const int hd = cfg_.head_dim;
  const int QKV = Q + 2 * KV;
  const bool acc = accumulate_;  // each weight gradient is made once per micro-batch
  // An activation gradient past the depth has no reader: not computed (null dx).
  const Depth depth = backward_depth(l, g.wq == nullptr);
  auto past = [depth](Depth d, bf16* dx) { return depth > d ? dx : nullptr; };
  // MLP block; dx_ holds d x_out and becomes d x_mid. gu is overwritten by its gradient.
  linear_backward(past(kDown, dh_), g.w_down, dx_, a.h, w.w_down, N, I, H, s, acc);
  if (lora_) lora_->backward(l, LoraSite::kDown, a.h, dx_, past(kDown, dh_), s);
  if (depth == kDown) return;
  swiglu_backward_strided(a.gu, a.gu + I, dh_, a.gu, a.gu + I, 2 * I, N, I, s);
  linear_backward(past(kGateUp, dln_), g.w_gate, a.gu, a.ln2, w.w_gate, N, H, 2 * I, s,
                  acc);
  if (lora_) lora_->backward(l, LoraSite::kGateUp, a.ln2, a.gu, past(kGateUp, dln_), s);
  if (depth == kGateUp) return;
  residual_rmsnorm_backward(dx_, g.ln2, dln_, a.x_mid, w.ln2, a.rstd2, N, H, ws_, s, acc);
  // Attention block; dx_ holds d x_mid and becomes d x_in.
  linear_backward(past(kO, datt_), g.wo, dx_, a.att, w.wo, N, Q, H, s, acc);
  if (lora_) lora_->backward(l, LoraSite::kO, a.att, dx_, past(kO, datt_), s);
  if (depth == kO) return;
  attention_backward(dq_, dk_, dv_, datt_, a.q, a.k, a.v, a.att, a.lse, B_, T_, nh, nkv, hd, s,
                     pos_);
  // d q, d k, d v gathered into dqkv_ rows [dq | dk | dv] for one GEMM against [wq; wk; wv].
  qk_norm_rope_backward_strided(dqkv_, QKV, g.q_norm, dq_, a.qkv_raw, QKV, w.q_norm,
                                a.q_rstd, cos_, sin_, pos_, B_, T_, nh, hd, ws_, s, acc);
  qk_norm_rope_backward_strided(dqkv_ + Q, QKV, g.k_norm, dk_, a.qkv_raw + Q, QKV,
                                w.k_norm, a.k_rstd, cos_, sin_, pos_, B_, T_, nkv, hd, ws_, s,
                                acc);
  copy_columns(dqkv_ + Q + KV, QKV, dv_, KV, N, KV, s);
  linear_backward(past(kQKV, dln_), g.wq, dqkv_, ln_[l], w.wq, N, H, QKV, s, acc);
  if (lora_) lora_->backward(l, LoraSite::kQKV, ln_[l], dqkv_, past(kQKV, dln_), s);
  if (depth == kQKV) return;
  residual_rmsnorm_backward(dx_, g.ln1, dln_, x_[l], w.ln1, rstd_[l], N, H, ws_, s, acc);
}

// Logits, loss and their backward, chunk by chunk; leaves d(final norm output) in dtmp_.
void Qwen3Cuda::lm_head_loss(const bf16* lm_head, float* g_lm_head,
                             const std::int32_t* targets, float loss_scale, cudaStream_t s) {
  const int H = cfg_.hidden_size, V = cfg_.vocab_size;
  const bf16* xf = ln_[cfg_.num_layers];
  for (int c0 = 0; c0 < N_; c0 += chunk_) {
    const int rows = std::min(chunk_, N_ - c0);
    const std::size_t r0 = static_cast<std::size_t>(c0);
    linear_forward(logits_, xf + r0 * H, lm_head, rows, H, V, s);
    cross_entropy_forward_backward(losses_, chunk_lse_, logits_, targets + r0, loss_scale, rows, V,
                                   loss_sum_, s);
    linear_backward(dtmp_ + r0 * H, g_lm_head, logits_, xf + r0 * H, lm_head, rows, H, V, s,
                    accumulate_ || c0 > 0);
  }
}

namespace {

// The whole flat layout as units: pointers into W and G; a unit's gradients done is the
// watermark `ready` at the unit's first offset (units lie in flat order).
class FlatUnits final : public UnitSource {
 public:
  FlatUnits(const ShardPlan& plan, const bf16* W, float* G, const Qwen3Cuda::GradsReady& ready)
      : plan_(plan), W_(W), G_(G), ready_(ready) {}
  const bf16* weights(int u, cudaStream_t) override { return W_ + plan_.units[u].range.begin; }
  float* grads(int u, cudaStream_t) override {
    return G_ ? G_ + plan_.units[u].range.begin : nullptr;
  }
  void grads_done(int u, cudaStream_t) override {
    if (ready_) ready_(plan_.units[u].range.begin);
  }

 private:
  const ShardPlan& plan_;
  const bf16* W_;
  float* G_;
  const Qwen3Cuda::GradsReady& ready_;
};

}  // namespace

double Qwen3Cuda::forward_backward(const bf16* W, float* G, const std::int32_t* inputs,
                                   const std::int32_t* targets, float loss_scale,
                                   cudaStream_t s, const GradsReady& ready,
                                   const std::int32_t* positions, GradWrite grad_write) {
  FlatUnits units(plan_, W, G, ready);
  return forward_backward(units, inputs, targets, loss_scale, s, positions, grad_write);
}

double Qwen3Cuda::forward_backward(UnitSource& units, const std::int32_t* inputs,
                                   const std::int32_t* targets, float loss_scale,
                                   cudaStream_t s, const std::int32_t* positions,
                                   GradWrite grad_write) {
  const int N = N_, H = cfg_.hidden_size, L = cfg_.num_layers;
  const int E = unit_.embed(), Hd = unit_.head();
  const bool tied = cfg_.tie_word_embeddings;
  pos_ = positions;
  accumulate_ = grad_write == GradWrite::kAccumulate;
  // The unit after layer l's (layer l + 1, or the head), whose input norm layer l's last op uses.
  auto next = [&](int l) { return l + 1 < L ? unit_.layer(l + 1) : Hd; };
  // A unit's tensor at flat offset `off`.
  auto at = [&](int u, const bf16* base, std::size_t off) {
    return base + (off - plan_.units[u].range.begin);
  };
  auto grad_at = [&](int u, float* base, std::size_t off) {
    return base ? base + (off - plan_.units[u].range.begin) : nullptr;
  };
  QT_CHECK_CUDA(cudaMemsetAsync(loss_sum_, 0, sizeof(double), s));
  embedding_forward(x_[0], inputs, units.weights(E, s), N, H, s);
  if (!tied) units.release(E, s);  // tied: the lm head needs it again
  const int first = L > 0 ? unit_.layer(0) : Hd;
  const std::size_t first_norm = L > 0 ? off_.layers[0].ln1 : off_.norm;
  rmsnorm_forward(ln_[0], rstd_[0], x_[0], at(first, units.weights(first, s), first_norm), N, H,
                  cfg_.rms_norm_eps, s);
  for (int l = 0; l < L; ++l) {
    const int u = unit_.layer(l), n = next(l);
    const bf16* wn = units.weights(n, s);
    const bf16* next_norm = at(n, wn, l + 1 < L ? off_.layers[l + 1].ln1 : off_.norm);
    layer_forward(l, layer_tensors(l, units.weights(u, s)), next_norm, s);
    units.release(u, s);
  }
  const bf16* head = units.weights(Hd, s);
  float* g_head = units.grads(Hd, s);
  QT_CHECK(g_head != nullptr || lora_ != nullptr, "a frozen base (no gradients) without LoRA");
  const bf16* lm_head = tied ? units.weights(E, s) : at(Hd, head, off_.lm_head);
  float* g_lm_head = tied ? units.grads(E, s) : grad_at(Hd, g_head, off_.lm_head);
  lm_head_loss(lm_head, g_lm_head, targets, loss_scale, s);
  rmsnorm_backward(dx_, grad_at(Hd, g_head, off_.norm), dtmp_, x_[L], at(Hd, head, off_.norm),
                   rstd_[L], N, H, ws_, s, accumulate_);
  units.grads_done(Hd, s);
  for (int l = L - 1; l >= 0; --l) {
    const int u = unit_.layer(l), n = next(l);
    const LayerTensors<const bf16> w = layer_tensors(l, units.weights(u, s));
    // Recomputing rewrites x_[l + 1], ln_[l + 1] and rstd_[l + 1] with the same bits; layer l + 1's
    // backward, their last reader, is already enqueued before it. It reads the next unit's norm.
    if (recompute_) {
      const bf16* wn = units.weights(n, s);
      layer_forward(l, w, at(n, wn, l + 1 < L ? off_.layers[l + 1].ln1 : off_.norm), s);
    }
    units.release(n, s);
    layer_backward(l, w, layer_tensors(l, units.grads(u, s)), s);
    units.grads_done(u, s);
  }
  if (L > 0) units.release(unit_.layer(0), s);
  if (float* g_embed = units.grads(E, s)) {
    // The embedding backward adds rows: it needs them zero when writing, unless the tied lm head
    // (the same table) has already written them.
    if (!accumulate_ && !tied)
      QT_CHECK_CUDA(cudaMemsetAsync(g_embed, 0,
                                    sizeof(float) * cfg_.vocab_size * cfg_.hidden_size, s));
    embedding_backward(g_embed, dx_, inputs, N, H, ws_, ws_bytes_, s);
  }
  units.grads_done(E, s);
  if (tied) units.release(E, s);
  if (L == 0) units.release(Hd, s);
  double loss = 0;
  QT_CHECK_CUDA(cudaMemcpyAsync(&loss, loss_sum_, sizeof(double), cudaMemcpyDeviceToHost, s));
  QT_CHECK_CUDA(cudaStreamSynchronize(s));
  return loss;
}

}  // namespace qt::cuda
