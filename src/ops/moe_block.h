// The Qwen3-MoE sparse block (qwen3-spec.md 3), the CPU reference (issue 18): the router's gate
// (logits = x Wg^T, no bias), the router (ops/moe_router.h) and the routed experts
// (ops/moe_experts.h). N tokens of width H; E experts of width Im, k a token.
//
// With a capacity factor (ops/moe_capacity.h) each expert keeps its first C = expert_capacity(N,
// k, E, factor) pairs in pair order; a dropped slot adds nothing to y and its routing weight
// gets no gradient, while the router's choice and weights (renormalised over all k) and the
// load-balancing statistics are those before the drops. The backward recomputes the same drops
// from idx.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/moe_capacity.h"
#include "ops/moe_experts.h"
#include "ops/moe_router.h"

namespace qt::cpu {

struct MoeShape {
  int N, H, Im, E, k;
  bool norm_topk;              // Qwen3's norm_topk_prob
  double capacity_factor = 0;  // model.moe_capacity_factor; 0: dropless
};

// The pairs s's capacity keeps of idx [N, k] (capacity_keep), and in *dropped (when given) how
// many it drops; empty when none can be (dropless, or a capacity of N or more).
inline std::vector<std::uint8_t> moe_capacity_keep(const int* idx, const MoeShape& s,
                                                   long* dropped = nullptr) {
  const int C = expert_capacity(s.N, s.k, s.E, s.capacity_factor);
  std::vector<std::uint8_t> keep;
  long n = 0;
  if (C < s.N) {
    keep.resize(static_cast<std::size_t>(s.N) * s.k);
    n = capacity_keep(keep.data(), idx, s.N, s.k, s.E, C);
  }
  if (dropped) *dropped = n;
  return keep;
}

// y [N, H] written; probs [N, E], idx [N, k], w [N, k] written (kept for the backward and the
// load-balancing statistics). gate [E, H], gate_up [E, 2 Im, H], down [E, H, Im]. bias [E]:
// the router's balancing bias (router_forward; null: none). Returns the pairs dropped by the
// capacity (0 when dropless). lora: adapters on every expert (ops/moe_experts.h; null: none).
template <typename T>
long moe_block_forward(T* y, T* probs, int* idx, T* w, const T* x, const T* gate,
                       const T* gate_up, const T* down, const MoeShape& s,
                       const T* bias = nullptr, const ExpertLora<T>* lora = nullptr);

// dx [N, H] written; dgate, dgate_up, ddown accumulated (+=). With balance (the step's
// statistics, every MoE layer added) the gradient of aux_coef x the load-balancing loss joins
// the router logits'. All three weight gradients null: a frozen block (LoRA on a Qwen3-MoE
// model, PEFT's frozen router and experts); dx is the same, through the experts and, by the
// routing weights and the load-balancing loss, through the frozen router's logits; the expert
// adapters of lora (the forward's) get their gradients.
template <typename T>
void moe_block_backward(T* dx, T* dgate, T* dgate_up, T* ddown, const T* dy, const T* x,
                        const T* probs, const int* idx, const T* w, const T* gate,
                        const T* gate_up, const T* down, const MoeShape& s,
                        const RouterBalance* balance = nullptr, T aux_coef = 0,
                        const ExpertLora<T>* lora = nullptr);

}  // namespace qt::cpu
