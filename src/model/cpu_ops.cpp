// CpuOps: the layer program's fused ops composed from the fp32 reference ops. Shapes as in
// layer_program.h: N = B*T rows, H hidden, hd head_dim, V vocabulary.
#include "model/cpu_ops.h"

#include <algorithm>
#include <cstring>

#include "model/lora.h"
#include "model/ring_attention.h"
#include "model/vocab_parallel.h"
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
void zero(float* p, std::size_t n) {
  if (p) std::fill(p, p + n, 0.0f);
}
}  // namespace

CpuOps::CpuOps(const ModelConfig& cfg, ForwardOnly f, HostArena& arena)
    : cfg_(cfg), B_(1), T_(f.max_rows), N_(f.max_rows), max_rows_(f.max_rows) {
  cfg_.moe_capacity_factor = 0;  // inference routes every token (a capacity is for training)
  const std::size_t hd = cfg.head_dim, QK = std::max(cfg.q_dim(), cfg.kv_dim());
  cos_ = arena.allocate<float>(f.rope_len * hd / 2);
  sin_ = arena.allocate<float>(f.rope_len * hd / 2);
  if (cos_) cpu::rope_table(cos_, sin_, f.rope_len, cfg);
  xs_ = arena.allocate<float>(static_cast<std::size_t>(f.max_rows) * QK);
  ys_ = nullptr;  // the backward's
}

void CpuOps::set_rows(int B, int T) {
  QT_CHECK(B >= 1 && T >= 1 && static_cast<long long>(B) * T <= max_rows_,
           "{} x {} rows for CPU ops made for {}", B, T, max_rows_);
  B_ = B;
  T_ = T;
  N_ = B * T;
}

CpuOps::CpuOps(const ModelConfig& cfg, int B, int T, HostArena& arena, int seq_parallel)
    : cfg_(cfg), B_(B), T_(T), N_(B * T), max_rows_(B * T), seq_parallel_(seq_parallel) {
  const std::size_t N = N_, H = cfg.hidden_size, V = cfg.vocab_size, hd = cfg.head_dim;
  const std::size_t QK = std::max(cfg.q_dim(), cfg.kv_dim());
  cos_ = arena.allocate<float>(T * hd / 2);
  sin_ = arena.allocate<float>(T * hd / 2);
  if (cos_) cpu::rope_table(cos_, sin_, T, cfg);
  xs_ = arena.allocate<float>(N * QK);
  ys_ = arena.allocate<float>(N * QK);
  norm_dx_ = arena.allocate<float>(N * H);
  logits_ = arena.allocate<float>(N * V);
  losses_ = arena.allocate<float>(N);
  lse_ = arena.allocate<float>(N);
  if (seq_parallel > 1) {
    xf_full_ = arena.allocate<float>(N * H);
    rows_full_ = arena.allocate<float>(N * H);
  }
}

void CpuOps::set_tp(Comm* tp) {
  QT_CHECK(seq_parallel_ == 1 || (tp != nullptr && tp->size() == seq_parallel_),
           "ops made for sequence parallelism over {} ranks, tp over {}", seq_parallel_,
           tp ? tp->size() : 1);
  tp_ = tp;
  sp_ = seq_parallel_ > 1;
  vocab_begin_ = tp ? tp->rank() * cfg_.vocab_size : 0;
}

void CpuOps::set_context_parallel(Comm* cp, const ContextSplit* split) {
  if (cp == nullptr || cp->size() == 1) {
    ring_.reset();
    return;
  }
  QT_CHECK(split != nullptr && split->local_len(cp->rank()) == T_,
           "ops of {} rows a sequence for a context split giving this rank {}", T_,
           split ? split->local_len(cp->rank()) : 0);
  ring_ = std::make_shared<RingAttention>(*cp, *split, B_, cfg_.num_heads, cfg_.num_kv_heads,
                                          cfg_.head_dim);
  const std::size_t table = static_cast<std::size_t>(split->seq_len()) * cfg_.head_dim / 2;
  cp_cos_.assign(table, 0.0f);
  cp_sin_.assign(table, 0.0f);
  cpu::rope_table(cp_cos_.data(), cp_sin_.data(), split->seq_len(), cfg_);
  cos_ = cp_cos_.data();
  sin_ = cp_sin_.data();
}

float* CpuOps::gather_rows(float* full, const float* local, int rows, int cols) {
  // The program passes an output buffer exactly when its activations are sequence-parallel.
  QT_CHECK((full != nullptr) == sp_, "sequence-parallel activations with ops that are not, or "
           "the reverse");
  if (!sp_) return nullptr;
  const std::size_t mine = static_cast<std::size_t>(rows / tp_->size()) * cols;
  tp_->all_gather(local, full, mine, DType::kF32);
  return full;
}

float* CpuOps::sum_rows(float* local, float* y, int rows, int cols) {
  QT_CHECK((local != nullptr) == sp_, "sequence-parallel activations with ops that are not, or "
           "the reverse");
  if (!tp_) return y;
  if (!sp_) {
    tp_->all_reduce(y, static_cast<std::size_t>(rows) * cols, DType::kF32, ReduceOp::kSum);
    return y;
  }
  const std::size_t mine = static_cast<std::size_t>(rows / tp_->size()) * cols;
  tp_->reduce_scatter(y, local, mine, DType::kF32, ReduceOp::kSum);
  return local;
}

float* CpuOps::tp_block_input(float* full, float* x, int rows, int cols) {
  float* gathered = gather_rows(full, x, rows, cols);
  return gathered ? gathered : x;
}

float* CpuOps::tp_block_input_backward(float* local, float* dx, int rows, int cols) {
  return sum_rows(local, dx, rows, cols);
}

float* CpuOps::tp_block_output(float* local, float* y, int rows, int cols) {
  return sum_rows(local, y, rows, cols);
}

float* CpuOps::tp_block_output_backward(float* full, float* dy, int rows, int cols) {
  float* gathered = gather_rows(full, dy, rows, cols);
  return gathered ? gathered : dy;
}

void CpuOps::linear(float* y, const float* x, const float* w, int N, int in, int out) {
  cpu::linear_forward(y, x, w, N, in, out);
}

void CpuOps::linear_backward(float* dx, float* dw, const float* dy, const float* x,
                             const float* w, int N, int in, int out, bool acc) {
  if (defer_ != nullptr && dw != nullptr) {
    cpu::linear_backward(dx, static_cast<float*>(nullptr), dy, x, w, N, in, out);
    defer_->push_back({dw, std::vector<float>(dy, dy + static_cast<std::size_t>(N) * out), x, N,
                       in, out, acc});
    return;
  }
  if (!acc) zero(dw, static_cast<std::size_t>(out) * in);
  cpu::linear_backward(dx, dw, dy, x, w, N, in, out);
}

void CpuOps::run_deferred(std::vector<DeferredGrad>& queue) {
  for (DeferredGrad& d : queue) {
    if (!d.acc) zero(d.dw, static_cast<std::size_t>(d.out) * d.in);
    cpu::linear_backward(static_cast<float*>(nullptr), d.dw, d.dy.data(), d.x,
                         static_cast<const float*>(nullptr), d.N, d.in, d.out);
  }
  queue.clear();
}

void CpuOps::copy_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows,
                          int cols) {
  for (int r = 0; r < rows; ++r)
    std::memcpy(dst + static_cast<std::size_t>(r) * dst_ld,
                src + static_cast<std::size_t>(r) * src_ld, sizeof(float) * cols);
}

void CpuOps::qk_norm_rope(float* out, float* rstd, const float* x, int ld, const float* w,
                          int heads) {
  const int hd = cfg_.head_dim, C = heads * hd;
  copy_columns(xs_, C, x, ld, N_, C);
  cpu::rmsnorm_forward(out, rstd, xs_, w, N_ * heads, hd, cfg_.rms_norm_eps);
  cpu::rope_forward(out, cos_, sin_, pos_, B_, T_, heads, hd);
}

void CpuOps::qk_norm_rope_backward(float* dx, int dx_ld, float* dw, const float* dout,
                                   const float* x, int ld, const float* w, const float* rstd,
                                   int heads, bool acc) {
  const int hd = cfg_.head_dim, C = heads * hd;
  if (!acc) zero(dw, hd);
  std::memcpy(ys_, dout, sizeof(float) * N_ * C);
  cpu::rope_backward(ys_, cos_, sin_, pos_, B_, T_, heads, hd);
  copy_columns(xs_, C, x, ld, N_, C);
  cpu::rmsnorm_backward(ys_, dw, ys_, xs_, w, rstd, N_ * heads, hd);
  copy_columns(dx, dx_ld, ys_, C, N_, C);
}

void CpuOps::attention(int, float* out, float* lse, const float* q, const float* k,
                       const float* v) {
  if (ring_) return ring_->forward(out, lse, q, k, v, pos_);
  cpu::attention_forward(out, lse, q, k, v, B_, T_, cfg_.num_heads, cfg_.num_kv_heads,
                         cfg_.head_dim, pos_);
}

void CpuOps::attention_backward(int, float* dq, float* dk, float* dv, const float* dout,
                                const float* q, const float* k, const float* v, const float* out,
                                const float* lse) {
  if (ring_) return ring_->backward(dq, dk, dv, dout, q, k, v, out, lse, pos_);
  cpu::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B_, T_, cfg_.num_heads,
                          cfg_.num_kv_heads, cfg_.head_dim, pos_);
}

void CpuOps::rmsnorm(float* y, float* rstd, const float* x, const float* w, int N) {
  cpu::rmsnorm_forward(y, rstd, x, w, N, cfg_.hidden_size, cfg_.rms_norm_eps);
}

void CpuOps::rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x,
                              const float* w, const float* rstd, int N, bool acc) {
  if (!acc) zero(dw, cfg_.hidden_size);
  cpu::rmsnorm_backward(dx, dw, dy, x, w, rstd, N, cfg_.hidden_size);
}

void CpuOps::residual_add(float* res_out, const float* res_in, const float* x, int N) {
  const std::size_t n = static_cast<std::size_t>(N) * cfg_.hidden_size;
  for (std::size_t i = 0; i < n; ++i) res_out[i] = res_in[i] + x[i];
}

// The add and the norm of a stage boundary (residual_add, then the next stage's rmsnorm) in one:
// the same bits either way.
void CpuOps::residual_rmsnorm(float* res_out, float* y, float* rstd, const float* res_in,
                              const float* x, const float* w, int N) {
  residual_add(res_out, res_in, x, N);
  rmsnorm(y, rstd, res_out, w, N);
}

void CpuOps::residual_rmsnorm_backward(float* dres, float* dw, const float* dy, const float* x,
                                       const float* w, const float* rstd, int N, bool acc) {
  rmsnorm_backward(norm_dx_, dw, dy, x, w, rstd, N, acc);
  const std::size_t n = static_cast<std::size_t>(N) * cfg_.hidden_size;
  for (std::size_t i = 0; i < n; ++i) dres[i] += norm_dx_[i];
}

void CpuOps::swiglu(float* h, const float* gu, int N, int I) {
  for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r)
    cpu::swiglu_forward(h + r * I, gu + r * 2 * I, gu + r * 2 * I + I, 1, I);
}

void CpuOps::swiglu_backward(float* dgu, const float* dh, const float* gu, int N, int I) {
  // Element by element, each reads its gate and up before writing them: dgu may alias gu.
  for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r)
    cpu::swiglu_backward(dgu + r * 2 * I, dgu + r * 2 * I + I, dh + r * I, gu + r * 2 * I,
                         gu + r * 2 * I + I, 1, I);
}

void CpuOps::embedding(float* x, const std::int32_t* ids, const float* wte, int N) {
  if (!tp_) {
    cpu::embedding_forward(x, ids, wte, N, cfg_.hidden_size);
    return;
  }
  // Each row from the one rank holding its id, zeros elsewhere: summed over tp, the row itself.
  float* rows = sp_ ? rows_full_ : x;  // [N, H]
  cpu::embedding_lookup_vp(rows, ids, wte, N, cfg_.hidden_size, vocab_begin_, cfg_.vocab_size);
  sum_rows(sp_ ? x : nullptr, rows, N, cfg_.hidden_size);
}

void CpuOps::embedding_backward(float* dwte, const float* dx, const std::int32_t* ids, int N,
                                bool overwrite) {
  if (overwrite) zero(dwte, static_cast<std::size_t>(cfg_.vocab_size) * cfg_.hidden_size);
  if (!tp_) {
    cpu::embedding_backward(dwte, dx, ids, N, cfg_.hidden_size);
    return;
  }
  // Sequence parallelism: every row's gradient, for the ids of this rank's vocabulary.
  const float* rows = sp_ ? gather_rows(rows_full_, dx, N, cfg_.hidden_size) : dx;
  cpu::embedding_backward_vp(dwte, rows, ids, N, cfg_.hidden_size, vocab_begin_, cfg_.vocab_size);
}

std::vector<CpuOps::SiteTarget> CpuOps::site_targets(LoraSite site) const {
  const int Q = cfg_.q_dim(), KV = cfg_.kv_dim(), I = cfg_.intermediate_size;
  switch (site) {
    case LoraSite::kQKV: return {{kLoraQ, 0}, {kLoraK, Q}, {kLoraV, Q + KV}};
    case LoraSite::kO: return {{kLoraO, 0}};
    case LoraSite::kGateUp: return {{kLoraGate, 0}, {kLoraUp, I}};
    case LoraSite::kDown: return {{kLoraDown, 0}};
  }
  return {};
}

int CpuOps::site_width(LoraSite site) const {
  switch (site) {
    case LoraSite::kQKV: return cfg_.q_dim() + 2 * cfg_.kv_dim();
    case LoraSite::kGateUp: return 2 * cfg_.intermediate_size;
    default: return cfg_.hidden_size;
  }
}

bool CpuOps::lora_adapts(LoraSite site) const {
  if (!lora_) return false;
  for (const SiteTarget& t : site_targets(site))
    if (lora_->adapts(t.target)) return true;
  return false;
}

void CpuOps::lora(int l, LoraSite site, const float* x, float* y) {
  if (!lora_) return;
  for (const SiteTarget& t : site_targets(site))
    lora_->forward(l, t.target, x, y + t.col, site_width(site));
}

void CpuOps::lora_backward(int l, LoraSite site, const float* x, const float* dy, float* dx) {
  if (!lora_) return;
  for (const SiteTarget& t : site_targets(site))
    lora_->backward(l, t.target, x, dy + t.col, dx, site_width(site));
}

void CpuOps::lm_head_loss_forward(const float* xf, const float* lm_head,
                                  const std::int32_t* targets) {
  // Sequence parallelism: the logits of every row from the gathered final norm (kept for the
  // backward).
  if (sp_) xf = gather_rows(xf_full_, xf, N_, cfg_.hidden_size);
  cpu::linear_forward(logits_, xf, lm_head, N_, cfg_.hidden_size, cfg_.vocab_size);
  loss_ = tp_ ? cpu::cross_entropy_forward_vp(losses_, lse_, logits_, targets, N_,
                                              cfg_.vocab_size, vocab_begin_, *tp_)
              : cpu::cross_entropy_forward(losses_, lse_, logits_, targets, N_, cfg_.vocab_size);
}

void CpuOps::lm_head_loss_backward(const float* xf, const float* lm_head, float* g_lm_head,
                                   const std::int32_t* targets, float scale, float* dxf) {
  // logits_ becomes d logits in place.
  if (tp_)
    cpu::cross_entropy_backward_vp(logits_, logits_, lse_, targets, scale, N_, cfg_.vocab_size,
                                   vocab_begin_);
  else
    cpu::cross_entropy_backward(logits_, logits_, lse_, targets, scale, N_, cfg_.vocab_size);
  // Sequence parallelism: the gradient of every row [N, H] (from the forward's gathered input),
  // reduce-scattered into this rank's rows dxf [N / tp, H].
  float* dx_all = sp_ ? rows_full_ : dxf;
  cpu::linear_backward(dx_all, g_lm_head, logits_, sp_ ? xf_full_ : xf, lm_head, N_,
                       cfg_.hidden_size, cfg_.vocab_size);
  // Each rank's columns of the vocabulary give part of the input gradient.
  sum_rows(sp_ ? dxf : nullptr, dx_all, N_, cfg_.hidden_size);
}

void CpuOps::lm_head_loss(const float* xf, const float* lm_head, float* g_lm_head,
                          const std::int32_t* targets, float scale, float* dxf, bool acc) {
  if (!acc) zero(g_lm_head, static_cast<std::size_t>(cfg_.vocab_size) * cfg_.hidden_size);
  lm_head_loss_forward(xf, lm_head, targets);
  lm_head_loss_backward(xf, lm_head, g_lm_head, targets, scale, dxf);
}

}  // namespace qt
