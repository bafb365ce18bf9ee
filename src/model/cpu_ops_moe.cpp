// CpuOps' Qwen3-MoE block (layer_program.h's moe contract): the fp32 reference ops of
// ops/moe_block.h over the N rows of a micro-batch, and the micro-batch's load-balancing
// statistics (qwen3-spec.md 3.3: pooled over every MoE layer's tokens, then multiplied).
#include <algorithm>

#include "model/cpu_ops.h"
#include "ops/moe_block.h"
#include "parallel/expert_parallel.h"
#include "qtrain/error.h"

namespace qt {

namespace {
cpu::MoeShape moe_shape(const ModelConfig& c, int N) {
  return {N, c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
          c.norm_topk_prob};
}
}  // namespace

void CpuOps::set_expert_parallel(Comm* ep) {
  ep_ = ep && ep->size() > 1 ? ep : nullptr;
  dispatch_.clear();
  slot_out_.clear();
  QT_CHECK(cfg_.expert_shards == (ep_ ? ep_->size() : 1),
           "experts stored over {} ranks (the ep rank's local config) computed over {}",
           cfg_.expert_shards, ep_ ? ep_->size() : 1);
  if (!ep_) return;
  dispatch_.resize(cfg_.num_layers);
  slot_out_.resize(cfg_.num_layers);
  for (int l = 0; l < cfg_.num_layers; ++l)
    if (cfg_.is_moe_layer(l))
      dispatch_[l] = std::make_shared<ExpertDispatch>(*ep_, cfg_.num_experts, cfg_.hidden_size,
                                                      cfg_.moe_intermediate_size);
}

void CpuOps::moe_begin() { balance_ = cpu::RouterBalance(cfg_.num_experts); }

void CpuOps::moe(int l, float* y, float* probs, int* idx, float* rw, const float* x,
                 const float* router, const float* gate_up, const float* down, bool stats) {
  QT_CHECK(tp_ == nullptr, "the MoE block under tensor parallelism is not built");
  QT_CHECK(ep_ || cfg_.expert_shards == 1, "{} of {} experts stored here without the ep group",
           cfg_.local_experts(), cfg_.num_experts);
  const cpu::MoeShape s = moe_shape(cfg_, N_);
  if (ep_) {  // gate_up, down: this rank's experts, rows [first, first + El) of the global ones
    ExpertDispatch& d = *dispatch_.at(l);
    slot_out_[l].resize(static_cast<std::size_t>(s.N) * s.k * s.H);
    moe_block_forward_ep(y, probs, idx, rw, slot_out_[l].data(), x, router, gate_up, down, s, d);
  } else {
    cpu::moe_block_forward(y, probs, idx, rw, x, router, gate_up, down, s);
  }
  if (stats) {
    QT_CHECK(static_cast<int>(balance_.count.size()) == s.E, "moe before moe_begin");
    cpu::router_balance_add(balance_, probs, idx, s.N, s.k);
    if (load_.empty()) load_.assign(static_cast<std::size_t>(cfg_.num_moe_layers()) * s.E, 0.0);
    double* load = load_.data() + static_cast<std::size_t>(cfg_.moe_layers_before(l)) * s.E;
    for (std::size_t j = 0; j < static_cast<std::size_t>(s.N) * s.k; ++j) load[idx[j]] += 1;
  }
}

void CpuOps::moe_backward(int l, float* dx, float* g_router, float* g_gate_up, float* g_down,
                          const float* dy, const float* x, const float* probs, const int* idx,
                          const float* rw, const float* router, const float* gate_up,
                          const float* down, bool acc) {
  const cpu::MoeShape s = moe_shape(cfg_, N_);
  QT_CHECK(g_router && g_gate_up && g_down, "a frozen MoE block (LoRA on MoE is not built)");
  // The experts stored here: all E, or this ep rank's El.
  const std::size_t E = s.E, El = cfg_.local_experts(), H = s.H, Im = s.Im;
  if (!acc) {  // the block adds into its gradients
    std::fill(g_router, g_router + E * H, 0.0f);
    std::fill(g_gate_up, g_gate_up + El * 2 * Im * H, 0.0f);
    std::fill(g_down, g_down + El * H * Im, 0.0f);
  }
  const bool aux = aux_scale_ != 0 && balance_.tokens > 0;
  if (ep_) {
    moe_block_backward_ep(dx, g_router, g_gate_up, g_down, dy, x, probs, idx, rw,
                          slot_out_[l].data(), router, gate_up, down, s, *dispatch_.at(l),
                          aux ? &balance_ : nullptr, aux_scale_);
    return;
  }
  cpu::moe_block_backward(dx, g_router, g_gate_up, g_down, dy, x, probs, idx, rw, router,
                          gate_up, down, s, aux ? &balance_ : nullptr, aux_scale_);
}

double CpuOps::moe_aux_loss() const {
  return balance_.tokens > 0 ? cpu::router_aux_loss(balance_) : 0.0;
}

}  // namespace qt
