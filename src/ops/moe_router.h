// The Qwen3-MoE router (qwen3-spec.md 3.1) and its load-balancing loss (3.3), the CPU reference
// (issue 18). N tokens, E experts, k experts a token; rows of [N, E] are tokens.
#pragma once

#include <vector>

namespace qt::cpu {

// probs [N, E] = softmax(logits [N, E]) over the experts; idx [N, k] the k most probable in
// descending order (ties: the lower expert first); weight [N, k] their probabilities, divided
// by their sum when norm_topk (Qwen3's norm_topk_prob). All written.
// bias [E] (auxiliary-loss-free balancing, docs/moe.md; null: none) is added to the
// probabilities for the choice only: idx is the top-k of probs[t] + bias, in descending order of
// that sum (same ties), while weight stays the unbiased probabilities of the chosen experts
// (renormalised when norm_topk). A zero bias chooses exactly as no bias.
template <typename T>
void router_forward(T* probs, int* idx, T* weight, const T* logits, int N, int E, int k,
                    bool norm_topk, const T* bias = nullptr);

// Auxiliary-loss-free balancing's update after an optimizer step (DeepSeek-V3's rule):
// bias[l, e] += rate x sign(mean_e load[l, e] - load[l, e]) for each of `layers` sparse layers,
// load [layers, E] the step's token-slots routed to each expert over the whole global batch
// (sign(0) = 0: an expert at the mean keeps its bias). bias [layers, E] fp32, updated in place.
void router_bias_update(float* bias, const double* load, int layers, int E, double rate);

// dlogits [N, E] written: the gradient through the routing weights (dweight [N, k]); the choice
// of experts (idx) has none.
template <typename T>
void router_backward(T* dlogits, const T* dweight, const T* probs, const int* idx, int N, int E,
                     int k, bool norm_topk);

// The load-balancing statistics of a step, pooled over its MoE layers and tokens before the
// product (as transformers): count[e] tokens-slots routed to e, psum[e] the summed
// probabilities, tokens the (layer, token) pairs. Every token counts (no padding mask: packed
// sequences have none).
struct RouterBalance {
  explicit RouterBalance(int experts) : count(experts, 0.0), psum(experts, 0.0) {}
  std::vector<double> count, psum;
  double tokens = 0;
};

// Adds one layer's router output (probs [N, E], idx [N, k]) to b.
template <typename T>
void router_balance_add(RouterBalance& b, const T* probs, const int* idx, int N, int k);

// aux = E x sum_e f[e] P[e], f = count / tokens, P = psum / tokens (k for a balanced router).
double router_aux_loss(const RouterBalance& b);

// dlogits [N, E] += coef x d aux / d logits of one layer's tokens, f held constant (the counts
// have no gradient); b must hold the whole step's statistics.
template <typename T>
void router_aux_backward(T* dlogits, const RouterBalance& b, const T* probs, int N, T coef);

}  // namespace qt::cpu
