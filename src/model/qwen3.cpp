// Qwen3 dense forward and backward on the CPU (fp32). Shapes: N = B*T rows; H hidden; Q = nh*hd;
// KV = nkv*hd; I intermediate; V vocabulary.
#include "model/qwen3.h"

#include "model/lora.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"
#include "qtrain/error.h"

namespace qt {

namespace {
void add_into(float* y, const float* x, std::size_t n) {  // y += x
  for (std::size_t i = 0; i < n; ++i) y[i] += x[i];
}
}  // namespace

void Qwen3Model::LayerActs::allocate(const ModelConfig& c, int B, int T) {
  const std::size_t N = static_cast<std::size_t>(B) * T;
  const std::size_t H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim(), I = c.intermediate_size;
  ln1.resize(N * H);
  rstd1.resize(N);
  q_raw.resize(N * Q);
  k_raw.resize(N * KV);
  q_rstd.resize(N * c.num_heads);
  k_rstd.resize(N * c.num_kv_heads);
  q.resize(N * Q);
  k.resize(N * KV);
  v.resize(N * KV);
  att.resize(N * Q);
  lse.resize(static_cast<std::size_t>(B) * c.num_heads * T);
  x_mid.resize(N * H);
  ln2.resize(N * H);
  rstd2.resize(N);
  gate.resize(N * I);
  up.resize(N * I);
  h.resize(N * I);
}

Qwen3Model::Qwen3Model(const ModelConfig& cfg, int B, int T, bool recompute)
    : cfg_(cfg),
      layout_(cfg),
      plan_(plan_qwen3(cfg, layout_, MeshShape{}, 0)),
      unit_{cfg.num_layers},
      B_(B),
      T_(T),
      N_(B * T),
      recompute_(recompute) {
  QT_CHECK(cfg.num_heads % cfg.num_kv_heads == 0, "heads {} not divisible by kv heads {}",
           cfg.num_heads, cfg.num_kv_heads);
  QT_CHECK(cfg.head_dim % 2 == 0, "head_dim {} must be even for RoPE", cfg.head_dim);
  const int hd = cfg.head_dim;
  rope_cos_.resize(static_cast<std::size_t>(T) * hd / 2);
  rope_sin_.resize(rope_cos_.size());
  cpu::rope_table(rope_cos_.data(), rope_sin_.data(), T, hd, cfg.rope_theta);

  const std::size_t N = N_, H = cfg.hidden_size, V = cfg.vocab_size;
  const std::size_t Q = cfg.q_dim(), KV = cfg.kv_dim(), I = cfg.intermediate_size;
  inputs_.resize(N);
  targets_.resize(N);
  pos_.resize(N);
  x_.assign(cfg.num_layers + 1, std::vector<float>(N * H));
  acts_.resize(recompute ? 1 : cfg.num_layers);
  for (auto& a : acts_) a.allocate(cfg, B, T);
  xf_.resize(N * H);
  rstdf_.resize(N);
  logits_.resize(N * V);
  losses_.resize(N);
  lse_.resize(N);
  dx_.resize(N * H);
  dtmp_.resize(N * H);
  dln_.resize(N * H);
  dq_.resize(N * Q);
  dk_.resize(N * KV);
  dv_.resize(N * KV);
  datt_.resize(N * Q);
  dgate_.resize(N * I);
  dup_.resize(N * I);
  dh_.resize(N * I);
}

double Qwen3Model::buffer_bytes(const ModelConfig& c, int B, int T, bool recompute) {
  // Floats of each buffer of the constructor and LayerActs::allocate, in their order.
  const double N = static_cast<double>(B) * T, H = c.hidden_size, V = c.vocab_size;
  const double Q = static_cast<double>(c.num_heads) * c.head_dim;
  const double KV = static_cast<double>(c.num_kv_heads) * c.head_dim, I = c.intermediate_size;
  const double layer = N * (3 * H + 3 * Q + 3 * KV + 3 * I + 2 + c.num_heads + c.num_kv_heads) +
                       static_cast<double>(B) * c.num_heads * T;
  const double floats = static_cast<double>(T) * c.head_dim + 3 * N +
                        (c.num_layers + 1.0) * N * H + (recompute ? 1.0 : c.num_layers) * layer +
                        N * H + N + N * V + 2 * N + 3 * N * H + 2 * N * Q + 2 * N * KV + 3 * N * I;
  return 4 * floats;
}

template <class T>
Qwen3Model::LayerTensors<T> Qwen3Model::layer_tensors(int l, T* unit) const {
  const LayerOffsets& o = off_.layers[l];
  const std::size_t base = plan_.units[unit_.layer(l)].range.begin;
  auto at = [&](std::size_t off) { return unit ? unit + (off - base) : nullptr; };
  return {at(o.ln1),    at(o.wq),  at(o.wk),     at(o.wv),   at(o.wo),    at(o.q_norm),
          at(o.k_norm), at(o.ln2), at(o.w_gate), at(o.w_up), at(o.w_down)};
}

void Qwen3Model::layer_forward(int l, const LayerTensors<const float>& w, const float* x_in,
                               float* x_out, LayerActs& a) {
  const int N = N_, H = cfg_.hidden_size, Q = cfg_.q_dim(), KV = cfg_.kv_dim();
  const int I = cfg_.intermediate_size, nh = cfg_.num_heads, nkv = cfg_.num_kv_heads;
  const int hd = cfg_.head_dim;
  const double eps = cfg_.rms_norm_eps;
  // attention block: x_mid = x_in + o_proj(attn(rmsnorm(x_in)))
  cpu::rmsnorm_forward(a.ln1.data(), a.rstd1.data(), x_in, w.ln1, N, H, eps);
  cpu::linear_forward(a.q_raw.data(), a.ln1.data(), w.wq, N, H, Q);
  cpu::linear_forward(a.k_raw.data(), a.ln1.data(), w.wk, N, H, KV);
  cpu::linear_forward(a.v.data(), a.ln1.data(), w.wv, N, H, KV);
  if (lora_) {  // q, k, v += scale * drop(ln1) A^T B^T
    lora_->forward(l, kLoraQ, a.ln1.data(), a.q_raw.data());
    lora_->forward(l, kLoraK, a.ln1.data(), a.k_raw.data());
    lora_->forward(l, kLoraV, a.ln1.data(), a.v.data());
  }
  cpu::rmsnorm_forward(a.q.data(), a.q_rstd.data(), a.q_raw.data(), w.q_norm, N * nh, hd, eps);
  cpu::rmsnorm_forward(a.k.data(), a.k_rstd.data(), a.k_raw.data(), w.k_norm, N * nkv, hd, eps);
  cpu::rope_forward(a.q.data(), rope_cos_.data(), rope_sin_.data(), pos_ptr_, B_, T_, nh, hd);
  cpu::rope_forward(a.k.data(), rope_cos_.data(), rope_sin_.data(), pos_ptr_, B_, T_, nkv, hd);
  cpu::attention_forward(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), B_, T_,
                         nh, nkv, hd, pos_ptr_);
  cpu::linear_forward(a.x_mid.data(), a.att.data(), w.wo, N, Q, H);
  if (lora_) lora_->forward(l, kLoraO, a.att.data(), a.x_mid.data());
  add_into(a.x_mid.data(), x_in, a.x_mid.size());
  // MLP block: x_out = x_mid + down(silu(gate(ln2)) * up(ln2))
  cpu::rmsnorm_forward(a.ln2.data(), a.rstd2.data(), a.x_mid.data(), w.ln2, N, H, eps);
  cpu::linear_forward(a.gate.data(), a.ln2.data(), w.w_gate, N, H, I);
  cpu::linear_forward(a.up.data(), a.ln2.data(), w.w_up, N, H, I);
  if (lora_) {
    lora_->forward(l, kLoraGate, a.ln2.data(), a.gate.data());
    lora_->forward(l, kLoraUp, a.ln2.data(), a.up.data());
  }
  cpu::swiglu_forward(a.h.data(), a.gate.data(), a.up.data(), N, I);
  cpu::linear_forward(x_out, a.h.data(), w.w_down, N, I, H);
  if (lora_) lora_->forward(l, kLoraDown, a.h.data(), x_out);
  add_into(x_out, a.x_mid.data(), a.x_mid.size());
}

void Qwen3Model::layer_backward(int l, const LayerTensors<const float>& w,
                                const LayerTensors<float>& g, const float* x_in, float* dx,
                                LayerActs& a) {
  const int N = N_, H = cfg_.hidden_size, Q = cfg_.q_dim(), KV = cfg_.kv_dim();
  const int I = cfg_.intermediate_size, nh = cfg_.num_heads, nkv = cfg_.num_kv_heads;
  const int hd = cfg_.head_dim;
  const std::size_t NH = static_cast<std::size_t>(N) * H;
  // MLP block; dx holds d x_out, becomes d x_mid.
  cpu::linear_backward(dh_.data(), g.w_down, dx, a.h.data(), w.w_down, N, I, H);
  if (lora_) lora_->backward(l, kLoraDown, a.h.data(), dx, dh_.data());
  cpu::swiglu_backward(dgate_.data(), dup_.data(), dh_.data(), a.gate.data(), a.up.data(), N, I);
  cpu::linear_backward(dln_.data(), g.w_gate, dgate_.data(), a.ln2.data(), w.w_gate, N, H, I);
  cpu::linear_backward(dtmp_.data(), g.w_up, dup_.data(), a.ln2.data(), w.w_up, N, H, I);
  if (lora_) {
    lora_->backward(l, kLoraGate, a.ln2.data(), dgate_.data(), dln_.data());
    lora_->backward(l, kLoraUp, a.ln2.data(), dup_.data(), dtmp_.data());
  }
  add_into(dln_.data(), dtmp_.data(), NH);
  cpu::rmsnorm_backward(dtmp_.data(), g.ln2, dln_.data(), a.x_mid.data(), w.ln2,
                        a.rstd2.data(), N, H);
  add_into(dx, dtmp_.data(), NH);
  // attention block; dx holds d x_mid, becomes d x_in.
  cpu::linear_backward(datt_.data(), g.wo, dx, a.att.data(), w.wo, N, Q, H);
  if (lora_) lora_->backward(l, kLoraO, a.att.data(), dx, datt_.data());
  cpu::attention_backward(dq_.data(), dk_.data(), dv_.data(), datt_.data(), a.q.data(), a.k.data(),
                          a.v.data(), a.att.data(), a.lse.data(), B_, T_, nh, nkv, hd, pos_ptr_);
  cpu::rope_backward(dq_.data(), rope_cos_.data(), rope_sin_.data(), pos_ptr_, B_, T_, nh, hd);
  cpu::rope_backward(dk_.data(), rope_cos_.data(), rope_sin_.data(), pos_ptr_, B_, T_, nkv, hd);
  cpu::rmsnorm_backward(dq_.data(), g.q_norm, dq_.data(), a.q_raw.data(), w.q_norm,
                        a.q_rstd.data(), N * nh, hd);
  cpu::rmsnorm_backward(dk_.data(), g.k_norm, dk_.data(), a.k_raw.data(), w.k_norm,
                        a.k_rstd.data(), N * nkv, hd);
  cpu::linear_backward(dln_.data(), g.wq, dq_.data(), a.ln1.data(), w.wq, N, H, Q);
  if (lora_) lora_->backward(l, kLoraQ, a.ln1.data(), dq_.data(), dln_.data());
  cpu::linear_backward(dtmp_.data(), g.wk, dk_.data(), a.ln1.data(), w.wk, N, H, KV);
  if (lora_) lora_->backward(l, kLoraK, a.ln1.data(), dk_.data(), dtmp_.data());
  add_into(dln_.data(), dtmp_.data(), NH);
  cpu::linear_backward(dtmp_.data(), g.wv, dv_.data(), a.ln1.data(), w.wv, N, H, KV);
  if (lora_) lora_->backward(l, kLoraV, a.ln1.data(), dv_.data(), dtmp_.data());
  add_into(dln_.data(), dtmp_.data(), NH);
  cpu::rmsnorm_backward(dtmp_.data(), g.ln1, dln_.data(), x_in, w.ln1, a.rstd1.data(), N, H);
  add_into(dx, dtmp_.data(), NH);
}

double Qwen3Model::forward(ModelParams& mp, const std::int32_t* inputs,
                           const std::int32_t* targets, const std::int32_t* positions) {
  const int N = N_, H = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_layers;
  for (int i = 0; i < N; ++i) {
    QT_CHECK(inputs[i] >= 0 && inputs[i] < V, "input id {} at {} outside [0, {})", inputs[i], i, V);
    QT_CHECK(targets[i] == cpu::kIgnoreIndex || (targets[i] >= 0 && targets[i] < V),
             "target id {} at {} outside [0, {})", targets[i], i, V);
    inputs_[i] = inputs[i];
    targets_[i] = targets[i];
    if (positions) {
      QT_CHECK(positions[i] == 0 || (i % T_ != 0 && positions[i] == positions[i - 1] + 1),
               "position {} at {} is neither 0 nor one past the previous", positions[i], i);
      pos_[i] = positions[i];
    }
  }
  pos_ptr_ = positions ? pos_.data() : nullptr;
  const int E = unit_.embed(), Hd = unit_.head();
  const bool tied = cfg_.tie_word_embeddings;
  mp.acquire(E);
  cpu::embedding_forward(x_[0].data(), inputs_.data(), mp.params(E), N, H);
  if (!tied) mp.release(E);  // tied: the lm head needs it again
  for (int l = 0; l < L; ++l) {
    mp.acquire(unit_.layer(l));
    layer_forward(l, layer_tensors(l, mp.params(unit_.layer(l))), x_[l].data(), x_[l + 1].data(),
                  acts_[recompute_ ? 0 : l]);
    mp.release(unit_.layer(l));
  }
  // The head (and a tied embedding) stays acquired until backward() releases it.
  mp.acquire(Hd);
  const float* head = mp.params(Hd);
  const std::size_t hb = plan_.units[Hd].range.begin;
  const float* lm_head = tied ? mp.params(E) : head + (off_.lm_head - hb);
  cpu::rmsnorm_forward(xf_.data(), rstdf_.data(), x_[L].data(), head + (off_.norm - hb), N, H,
                       cfg_.rms_norm_eps);
  cpu::linear_forward(logits_.data(), xf_.data(), lm_head, N, H, V);
  return cpu::cross_entropy_forward(losses_.data(), lse_.data(), logits_.data(), targets_.data(),
                                    N, V);
}

double Qwen3Model::forward(const float* P, const std::int32_t* inputs, const std::int32_t* targets,
                           const std::int32_t* positions) {
  FlatParams flat(plan_, P, nullptr);
  return forward(flat, inputs, targets, positions);
}

void Qwen3Model::backward(ModelParams& mp, float loss_scale) {
  const int N = N_, H = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_layers;
  const int E = unit_.embed(), Hd = unit_.head();
  const bool tied = cfg_.tie_word_embeddings;
  // logits_ becomes d logits in place.
  cpu::cross_entropy_backward(logits_.data(), logits_.data(), lse_.data(), targets_.data(),
                              loss_scale, N, V);
  mp.acquire(Hd);
  if (tied) mp.acquire(E);
  const std::size_t hb = plan_.units[Hd].range.begin;
  const float* head = mp.params(Hd);
  float* g_head = mp.grads(Hd);
  auto g_at = [&](float* unit, std::size_t off) { return unit ? unit + (off - hb) : nullptr; };
  const float* lm_head = tied ? mp.params(E) : head + (off_.lm_head - hb);
  float* g_lm_head = tied ? mp.grads(E) : g_at(g_head, off_.lm_head);
  cpu::linear_backward(dtmp_.data(), g_lm_head, logits_.data(), xf_.data(), lm_head, N, H, V);
  cpu::rmsnorm_backward(dx_.data(), g_at(g_head, off_.norm), dtmp_.data(), x_[L].data(),
                        head + (off_.norm - hb), rstdf_.data(), N, H);
  mp.grads_done(Hd);
  mp.release(Hd);
  for (int l = L - 1; l >= 0; --l) {
    const int u = unit_.layer(l);
    LayerActs& a = acts_[recompute_ ? 0 : l];
    mp.acquire(u);
    const LayerTensors<const float> w = layer_tensors(l, mp.params(u));
    // Recomputing writes x_[l + 1] again with the same values it had.
    if (recompute_) layer_forward(l, w, x_[l].data(), x_[l + 1].data(), a);
    layer_backward(l, w, layer_tensors(l, mp.grads(u)), x_[l].data(), dx_.data(), a);
    mp.grads_done(u);
    mp.release(u);
  }
  // The embedding's backward needs only its gradients, not its weights: nothing to gather.
  if (float* g_embed = mp.grads(E))
    cpu::embedding_backward(g_embed, dx_.data(), inputs_.data(), N, H);
  mp.grads_done(E);
  if (tied) mp.release(E);  // held since the forward for the lm head
}

void Qwen3Model::backward(const float* P, float* G, float loss_scale) {
  FlatParams flat(plan_, P, G);
  backward(flat, loss_scale);
}

}  // namespace qt
