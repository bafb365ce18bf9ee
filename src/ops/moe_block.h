// The Qwen3-MoE sparse block (qwen3-spec.md 3), the CPU reference (issue 18): the router's gate
// (logits = x Wg^T, no bias), the router (ops/moe_router.h) and the routed experts
// (ops/moe_experts.h). N tokens of width H; E experts of width Im, k a token.
#pragma once

#include "ops/moe_router.h"

namespace qt::cpu {

struct MoeShape {
  int N, H, Im, E, k;
  bool norm_topk;  // Qwen3's norm_topk_prob
};

// y [N, H] written; probs [N, E], idx [N, k], w [N, k] written (kept for the backward and the
// load-balancing statistics). gate [E, H], gate_up [E, 2 Im, H], down [E, H, Im]. bias [E]:
// the router's balancing bias (router_forward; null: none).
template <typename T>
void moe_block_forward(T* y, T* probs, int* idx, T* w, const T* x, const T* gate,
                       const T* gate_up, const T* down, const MoeShape& s,
                       const T* bias = nullptr);

// dx [N, H] written; dgate, dgate_up, ddown accumulated (+=). With balance (the step's
// statistics, every MoE layer added) the gradient of aux_coef x the load-balancing loss joins
// the router logits'. All three weight gradients null: a frozen block (LoRA on a Qwen3-MoE
// model, PEFT's frozen router and experts); dx is the same, through the experts and, by the
// routing weights and the load-balancing loss, through the frozen router's logits.
template <typename T>
void moe_block_backward(T* dx, T* dgate, T* dgate_up, T* ddown, const T* dy, const T* x,
                        const T* probs, const int* idx, const T* w, const T* gate,
                        const T* gate_up, const T* down, const MoeShape& s,
                        const RouterBalance* balance = nullptr, T aux_coef = 0);

}  // namespace qt::cpu
