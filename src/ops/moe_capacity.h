// The expert capacity of a Qwen3-MoE block (model.moe_capacity_factor; docs/moe.md "Capacity
// factor"): each expert takes at most C of the (token, slot) pairs that one router call routes,
// the rest are dropped (their slot adds nothing to the token's output; GShard / Switch). The
// rule is the same for every back end and mesh: the CPU reference (cpu::capacity_keep) and the
// CUDA route, which orders the pairs by expert stably in pair order and keeps each expert's
// first C.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qtrain/error.h"

namespace qt {

// C for `tokens` tokens (N, one router call: a rank's micro-batch, micro_batch x seq_len, the
// same at every dp / ep / tp / pp), k experts a token, `experts` experts (E, the whole model's):
// tokens when factor == 0 (dropless: an expert gets at most one slot of a token), else
// min(tokens, ceil(factor x tokens x k / experts)), computed in double.
inline int expert_capacity(long tokens, int k, int experts, double factor) {
  QT_CHECK(tokens >= 0 && k >= 1 && experts >= 1 && factor >= 0 && std::isfinite(factor),
           "expert_capacity({}, {}, {}, {})", tokens, k, experts, factor);
  if (factor == 0) return static_cast<int>(tokens);
  const double c = std::ceil(factor * static_cast<double>(tokens) * k / experts);
  return static_cast<int>(std::min(static_cast<double>(tokens), c));
}

// The most (token, slot) rows one rank of an ep group of P receives in a sparse layer, N tokens a
// rank: every rank's every token in each of its E / P experts, P N min(k, E / P), or with a
// capacity C (factor > 0) at most C from each rank for each of its experts, E C, when that is
// less. The CUDA dispatch's buffers and `qtrain plan` both size by it.
inline long ep_max_received_rows(long tokens, int k, int experts, int P, double factor) {
  long rows = P * tokens * std::min(k, experts / P);
  if (factor > 0)
    rows = std::min(rows, static_cast<long>(experts) * expert_capacity(tokens, k, experts, factor));
  return rows;
}

// The rows of a rank's experts' buffers (the GPU's activations, LoRA's products on the
// experts): its own N k pairs, or in an ep group of P > 1 the most it can receive.
inline long moe_expert_rows(long tokens, int k, int experts, int P, double factor) {
  return P > 1 ? ep_max_received_rows(tokens, k, experts, P, factor) : tokens * k;
}

namespace cpu {

// keep [N k] written: pair p = t k + j (token t's slot j, expert idx[p]) is kept (1) iff fewer
// than C pairs p' < p went to the same expert, i.e. each expert keeps its first C pairs in pair
// order; dropped pairs 0. idx [N, k] (the router's, ops/moe_router.h). Returns the pairs
// dropped (0 whenever C >= N).
inline long capacity_keep(std::uint8_t* keep, const int* idx, int N, int k, int E, int C) {
  std::vector<int> taken(static_cast<std::size_t>(E), 0);
  long dropped = 0;
  for (long p = 0; p < static_cast<long>(N) * k; ++p) {
    QT_CHECK(idx[p] >= 0 && idx[p] < E, "pair {} routed to expert {} of {}", p, idx[p], E);
    const bool kept = taken[static_cast<std::size_t>(idx[p])]++ < C;
    keep[p] = kept ? 1 : 0;
    dropped += kept ? 0 : 1;
  }
  return dropped;
}

}  // namespace cpu
}  // namespace qt
