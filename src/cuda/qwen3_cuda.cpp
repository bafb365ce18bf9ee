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
    : cfg_(cfg), layout_(cfg), B_(B), T_(T), N_(B * T), recompute_(recompute) {
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

void Qwen3Cuda::layer_forward(int l, const bf16* W, cudaStream_t s) {
  const LayerOffsets& w = off_.layers[l];
  LayerActs& a = acts(l);
  const int N = N_, H = cfg_.hidden_size, Q = cfg_.q_dim(), KV = cfg_.kv_dim();
  const int I = cfg_.intermediate_size, nh = cfg_.num_heads, nkv = cfg_.num_kv_heads;
  const int hd = cfg_.head_dim;
  const double eps = cfg_.rms_norm_eps;
  const int QKV = Q + 2 * KV;
  const bf16* ln1 = ln_[l];
  linear_forward(a.qkv_raw, ln1, W + w.wq, N, H, QKV, s);  // wq, wk, wv: one [QKV, H] matrix
  if (lora_) lora_->forward(l, LoraSite::kQKV, ln1, a.qkv_raw, s);
  qk_norm_rope_forward_strided(a.q, a.q_rstd, a.qkv_raw, QKV, W + w.q_norm, cos_, sin_, pos_,
                               B_, T_, nh, hd, eps, s);
  qk_norm_rope_forward_strided(a.k, a.k_rstd, a.qkv_raw + Q, QKV, W + w.k_norm, cos_, sin_,
                               pos_, B_, T_, nkv, hd, eps, s);
  copy_columns(a.v, KV, a.qkv_raw + Q + KV, QKV, N, KV, s);
  attention_forward(a.att, a.lse, a.q, a.k, a.v, B_, T_, nh, nkv, hd, s, pos_);
  linear_forward(tmp_, a.att, W + w.wo, N, Q, H, s);
  if (lora_) lora_->forward(l, LoraSite::kO, a.att, tmp_, s);
  residual_rmsnorm_forward(a.x_mid, a.ln2, a.rstd2, x_[l], tmp_, W + w.ln2, N, H, eps, s);
  linear_forward(a.gu, a.ln2, W + w.w_gate, N, H, 2 * I, s);  // w_gate, w_up: one [2I, H]
  if (lora_) lora_->forward(l, LoraSite::kGateUp, a.ln2, a.gu, s);
  swiglu_forward_strided(a.h, a.gu, a.gu + I, 2 * I, N, I, s);
  linear_forward(tmp_, a.h, W + w.w_down, N, I, H, s);
  if (lora_) lora_->forward(l, LoraSite::kDown, a.h, tmp_, s);
  const bf16* next_norm = l + 1 < cfg_.num_layers ? W + off_.layers[l + 1].ln1 : W + off_.norm;
  residual_rmsnorm_forward(x_[l + 1], ln_[l + 1], rstd_[l + 1], a.x_mid, tmp_, next_norm, N, H,
                           eps, s);
}

Qwen3Cuda::Depth Qwen3Cuda::backward_depth(int l, const float* G) const {
  if (G != nullptr || l > 0) return kBelow;
  // Frozen base, layer 0: down to the adapter nearest the input (every layer has the same).
  if (lora_->adapts(LoraSite::kQKV)) return kQKV;
  if (lora_->adapts(LoraSite::kO)) return kO;
  if (lora_->adapts(LoraSite::kGateUp)) return kGateUp;
  return kDown;
}

void Qwen3Cuda::layer_backward(int l, const bf16* W, float* G, cudaStream_t s) {
  const LayerOffsets& w = off_.layers[l];
  LayerActs& a = acts(l);
  const int N = N_, H = cfg_.hidden_size, Q = cfg_.q_dim(), KV = cfg_.kv_dim();
  const int I = cfg_.intermediate_size, nh = cfg_.num_heads, nkv = cfg_.num_kv_heads;
  const int hd = cfg_.head_dim;
  const int QKV = Q + 2 * KV;
  auto dW = [G](std::size_t off) { return G ? G + off : nullptr; };  // null: frozen
  const bool acc = accumulate_;  // each weight gradient is made once per micro-batch
  // An activation gradient past the depth has no reader: not computed (null dx).
  const Depth depth = backward_depth(l, G);
  auto past = [depth](Depth d, bf16* dx) { return depth > d ? dx : nullptr; };
  // MLP block; dx_ holds d x_out and becomes d x_mid. gu is overwritten by its gradient.
  linear_backward(past(kDown, dh_), dW(w.w_down), dx_, a.h, W + w.w_down, N, I, H, s, acc);
  if (lora_) lora_->backward(l, LoraSite::kDown, a.h, dx_, past(kDown, dh_), s);
  if (depth == kDown) return;
  swiglu_backward_strided(a.gu, a.gu + I, dh_, a.gu, a.gu + I, 2 * I, N, I, s);
  linear_backward(past(kGateUp, dln_), dW(w.w_gate), a.gu, a.ln2, W + w.w_gate, N, H, 2 * I, s,
                  acc);
  if (lora_) lora_->backward(l, LoraSite::kGateUp, a.ln2, a.gu, past(kGateUp, dln_), s);
  if (depth == kGateUp) return;
  residual_rmsnorm_backward(dx_, dW(w.ln2), dln_, a.x_mid, W + w.ln2, a.rstd2, N, H, ws_, s, acc);
  // Attention block; dx_ holds d x_mid and becomes d x_in.
  linear_backward(past(kO, datt_), dW(w.wo), dx_, a.att, W + w.wo, N, Q, H, s, acc);
  if (lora_) lora_->backward(l, LoraSite::kO, a.att, dx_, past(kO, datt_), s);
  if (depth == kO) return;
  attention_backward(dq_, dk_, dv_, datt_, a.q, a.k, a.v, a.att, a.lse, B_, T_, nh, nkv, hd, s,
                     pos_);
  // d q, d k, d v gathered into dqkv_ rows [dq | dk | dv] for one GEMM against [wq; wk; wv].
  qk_norm_rope_backward_strided(dqkv_, QKV, dW(w.q_norm), dq_, a.qkv_raw, QKV, W + w.q_norm,
                                a.q_rstd, cos_, sin_, pos_, B_, T_, nh, hd, ws_, s, acc);
  qk_norm_rope_backward_strided(dqkv_ + Q, QKV, dW(w.k_norm), dk_, a.qkv_raw + Q, QKV,
                                W + w.k_norm, a.k_rstd, cos_, sin_, pos_, B_, T_, nkv, hd, ws_, s,
                                acc);
  copy_columns(dqkv_ + Q + KV, QKV, dv_, KV, N, KV, s);
  linear_backward(past(kQKV, dln_), dW(w.wq), dqkv_, ln_[l], W + w.wq, N, H, QKV, s, acc);
  if (lora_) lora_->backward(l, LoraSite::kQKV, ln_[l], dqkv_, past(kQKV, dln_), s);
  if (depth == kQKV) return;
  residual_rmsnorm_backward(dx_, dW(w.ln1), dln_, x_[l], W + w.ln1, rstd_[l], N, H, ws_, s, acc);
}

// Logits, loss and their backward, chunk by chunk; leaves d(final norm output) in dtmp_.
void Qwen3Cuda::lm_head_loss(const bf16* W, float* G, const std::int32_t* targets,
                             float loss_scale, cudaStream_t s) {
  const int H = cfg_.hidden_size, V = cfg_.vocab_size;
  const bf16* xf = ln_[cfg_.num_layers];
  for (int c0 = 0; c0 < N_; c0 += chunk_) {
    const int rows = std::min(chunk_, N_ - c0);
    const std::size_t r0 = static_cast<std::size_t>(c0);
    linear_forward(logits_, xf + r0 * H, W + off_.lm_head, rows, H, V, s);
    cross_entropy_forward_backward(losses_, chunk_lse_, logits_, targets + r0, loss_scale, rows, V,
                                   loss_sum_, s);
    linear_backward(dtmp_ + r0 * H, G ? G + off_.lm_head : nullptr, logits_, xf + r0 * H,
                    W + off_.lm_head, rows, H, V, s, accumulate_ || c0 > 0);
  }
}

double Qwen3Cuda::forward_backward(const bf16* W, float* G, const std::int32_t* inputs,
                                   const std::int32_t* targets, float loss_scale,
                                   cudaStream_t s, const GradsReady& ready,
                                   const std::int32_t* positions, GradWrite grad_write) {
  const int N = N_, H = cfg_.hidden_size, L = cfg_.num_layers;
  QT_CHECK(G != nullptr || lora_ != nullptr, "a frozen base (G null) without LoRA adapters");
  pos_ = positions;
  accumulate_ = grad_write == GradWrite::kAccumulate;
  QT_CHECK_CUDA(cudaMemsetAsync(loss_sum_, 0, sizeof(double), s));
  embedding_forward(x_[0], inputs, W + off_.embed, N, H, s);
  rmsnorm_forward(ln_[0], rstd_[0], x_[0], W + off_.layers[0].ln1, N, H, cfg_.rms_norm_eps, s);
  for (int l = 0; l < L; ++l) layer_forward(l, W, s);
  lm_head_loss(W, G, targets, loss_scale, s);
  rmsnorm_backward(dx_, G ? G + off_.norm : nullptr, dtmp_, x_[L], W + off_.norm, rstd_[L], N, H,
                   ws_, s, accumulate_);
  // Layers lie between the embedding (offset 0) and the final norm; an untied lm head follows.
  if (ready) ready(off_.norm);
  for (int l = L - 1; l >= 0; --l) {
    // Recomputing rewrites x_[l + 1], ln_[l + 1] and rstd_[l + 1] with the same bits; layer l + 1's
    // backward, their last reader, is already enqueued before it.
    if (recompute_) layer_forward(l, W, s);
    layer_backward(l, W, G, s);
    if (ready) ready(off_.layers[l].ln1);
  }
  if (G != nullptr) {
    // The embedding backward adds rows: it needs them zero when writing, unless the tied lm head
    // (the same table) has already written them.
    if (!accumulate_ && !cfg_.tie_word_embeddings)
      QT_CHECK_CUDA(cudaMemsetAsync(G + off_.embed, 0,
                                    sizeof(float) * cfg_.vocab_size * cfg_.hidden_size, s));
    embedding_backward(G + off_.embed, dx_, inputs, N, H, ws_, ws_bytes_, s);
  }
  if (ready) ready(0);
  double loss = 0;
  QT_CHECK_CUDA(cudaMemcpyAsync(&loss, loss_sum_, sizeof(double), cudaMemcpyDeviceToHost, s));
  QT_CHECK_CUDA(cudaStreamSynchronize(s));
  return loss;
}

}  // namespace qt::cuda
