// CpuOps' Qwen3-MoE block (layer_program.h's moe contract): the fp32 reference ops of
// ops/moe_block.h over the N rows of a micro-batch, and the micro-batch's load-balancing
// statistics (qwen3-spec.md 3.3: pooled over every MoE layer's tokens, then multiplied). Under
// tensor parallelism the router is replicated (every tp rank routes all N rows, gathered with
// sequence parallelism, the same way) and each expert's width split (moe_backward says what is
// partial); the program's tp hooks around the block sum its output and input gradient.
#include <algorithm>

#include "model/cpu_ops.h"
#include "model/lora.h"
#include "ops/moe_block.h"
#include "parallel/expert_parallel.h"
#include "qtrain/error.h"

namespace qt {

namespace {
// N: the rows one router call routes, the micro-batch's (gathered under sequence parallelism),
// so the capacity is the same on every mesh.
cpu::MoeShape moe_shape(const ModelConfig& c, int N) {
  return {N, c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
          c.norm_topk_prob, c.moe_capacity_factor};
}
}  // namespace

void CpuOps::set_expert_parallel(Comm* ep, int slots) {
  ep_ = ep && ep->size() > 1 ? ep : nullptr;
  dispatch_.clear();
  slot_out_.clear();
  moe_slot_ = 0;
  QT_CHECK(cfg_.expert_shards == (ep_ ? ep_->size() : 1),
           "experts stored over {} ranks (the ep rank's local config) computed over {}",
           cfg_.expert_shards, ep_ ? ep_->size() : 1);
  QT_CHECK(slots >= 1, "{} slots", slots);
  if (!ep_) return;
  const std::size_t L = static_cast<std::size_t>(cfg_.num_layers);
  dispatch_.resize(L * static_cast<std::size_t>(slots));
  slot_out_.resize(dispatch_.size());
  for (std::size_t i = 0; i < dispatch_.size(); ++i)
    if (cfg_.is_moe_layer(static_cast<int>(i % L)))
      dispatch_[i] = std::make_shared<ExpertDispatch>(*ep_, cfg_.num_experts, cfg_.hidden_size,
                                                      cfg_.moe_intermediate_size);
}

void CpuOps::select_moe_slot(int slot) {
  if (!ep_) return;  // nothing kept per slot
  const std::size_t slots = dispatch_.size() / static_cast<std::size_t>(cfg_.num_layers);
  QT_CHECK(slot >= 0 && static_cast<std::size_t>(slot) < slots, "MoE slot {} of {}", slot, slots);
  moe_slot_ = slot;
}

cpu::ExpertLora<float> CpuOps::expert_lora(int l, bool grads) const {
  if (!lora_ || !lora_->adapts_experts()) return {};
  // The adapters of the experts stored here (an ep rank's own: plan_adapters). Under tp they
  // are this rank's share (tp_role): gate_up's B its gate and up rows, down's A its columns; so
  // the block's output and input gradient stay partial over tp, as the base's.
  return lora_->experts(l, grads);
}

void CpuOps::moe_begin() { balance_ = cpu::RouterBalance(cfg_.num_experts); }

void CpuOps::moe(int l, float* y, float* probs, int* idx, float* rw, const float* x,
                 const float* router, const float* gate_up, const float* down, bool stats) {
  QT_CHECK(ep_ || cfg_.expert_shards == 1, "{} of {} experts stored here without the ep group",
           cfg_.local_experts(), cfg_.num_experts);
  const cpu::MoeShape s = moe_shape(cfg_, N_);
  const std::size_t sparse = static_cast<std::size_t>(cfg_.moe_layers_before(l));
  const float* bias = router_bias_ ? router_bias_ + sparse * s.E : nullptr;  // layer l's [E]
  long dropped = 0;  // by the capacity, of this rank's tokens (every tp rank alike)
  // Adapters on every expert (null: none): under ep, this rank's experts' rows of them.
  const cpu::ExpertLora<float> ad = expert_lora(l, false);
  const cpu::ExpertLora<float>* lora = ad.on() ? &ad : nullptr;
  if (ep_) {  // gate_up, down: this rank's experts, rows [first, first + El) of the global ones
    const std::size_t i = static_cast<std::size_t>(moe_slot_) * cfg_.num_layers + l;
    ExpertDispatch& d = *dispatch_.at(i);
    slot_out_[i].resize(static_cast<std::size_t>(s.N) * s.k * s.H);
    dropped = moe_block_forward_ep(y, probs, idx, rw, slot_out_[i].data(), x, router, gate_up,
                                   down, s, d, bias, lora);
  } else {
    dropped = cpu::moe_block_forward(y, probs, idx, rw, x, router, gate_up, down, s, bias, lora);
  }
  if (stats) {
    QT_CHECK(static_cast<int>(balance_.count.size()) == s.E, "moe before moe_begin");
    cpu::router_balance_add(balance_, probs, idx, s.N, s.k);
    if (load_.empty()) {
      load_.assign(static_cast<std::size_t>(cfg_.num_moe_layers()) * s.E, 0.0);
      dropped_.assign(static_cast<std::size_t>(cfg_.num_moe_layers()), 0.0);
    }
    double* load = load_.data() + sparse * s.E;
    for (std::size_t j = 0; j < static_cast<std::size_t>(s.N) * s.k; ++j) load[idx[j]] += 1;
    dropped_[sparse] += static_cast<double>(dropped);
  }
}

void CpuOps::moe_backward(int l, float* dx, float* g_router, float* g_gate_up, float* g_down,
                          const float* dy, const float* x, const float* probs, const int* idx,
                          const float* rw, const float* router, const float* gate_up,
                          const float* down, bool acc) {
  const cpu::MoeShape s = moe_shape(cfg_, N_);
  // Null gradients: a frozen block (LoRA), dx only (ops/moe_block.h).
  const bool frozen = g_router == nullptr;
  QT_CHECK(frozen == (g_gate_up == nullptr) && frozen == (g_down == nullptr),
           "an MoE block with some of its gradients (the router's and the experts': all or "
           "none)");
  // The experts stored here: all E, or this ep rank's El.
  const std::size_t E = s.E, El = cfg_.local_experts(), H = s.H, Im = s.Im;
  if (!acc && !frozen) {  // the block adds into its gradients
    std::fill(g_router, g_router + E * H, 0.0f);
    std::fill(g_gate_up, g_gate_up + El * 2 * Im * H, 0.0f);
    std::fill(g_down, g_down + El * H * Im, 0.0f);
  }
  // Under tensor parallelism each rank's experts are its columns of every expert's width
  // (tp_local_config), so y, and from dy everything linear in the experts' outputs, is partial
  // over tp: the routing weights' gradient (dy . out), the router's logit gradient, hence the
  // router's weight gradient (partial over tp in the plan) and dx (summed by the program's
  // tp_block_input_backward). The load-balancing loss's gradient depends on the router alone
  // (every tp rank routes the same rows alike): tp rank 0 adds it, so the sums count it once.
  const bool aux = aux_scale_ != 0 && balance_.tokens > 0 && (!tp_ || tp_->rank() == 0);
  const cpu::ExpertLora<float> ad = expert_lora(l, true);
  const cpu::ExpertLora<float>* lora = ad.on() ? &ad : nullptr;
  if (ep_) {
    const std::size_t i = static_cast<std::size_t>(moe_slot_) * cfg_.num_layers + l;
    moe_block_backward_ep(dx, g_router, g_gate_up, g_down, dy, x, probs, idx, rw,
                          slot_out_[i].data(), router, gate_up, down, s, *dispatch_.at(i),
                          aux ? &balance_ : nullptr, aux_scale_, lora);
    return;
  }
  cpu::moe_block_backward(dx, g_router, g_gate_up, g_down, dy, x, probs, idx, rw, router,
                          gate_up, down, s, aux ? &balance_ : nullptr, aux_scale_, lora);
}

double CpuOps::moe_aux_loss() const {
  return balance_.tokens > 0 ? cpu::router_aux_loss(balance_) : 0.0;
}

}  // namespace qt
