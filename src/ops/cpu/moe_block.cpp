// The Qwen3-MoE sparse block (ops/moe_block.h), composed of the router gate's GEMM, the router
// and the routed experts.
#include "ops/moe_block.h"

#include <cstddef>
#include <vector>

#include "ops/linear.h"
#include "ops/moe_experts.h"
#include "qtrain/error.h"

namespace qt::cpu {

template <typename T>
long moe_block_forward(T* y, T* probs, int* idx, T* w, const T* x, const T* gate,
                       const T* gate_up, const T* down, const MoeShape& s, const T* bias,
                       const ExpertLora<T>* lora) {
  std::vector<T> logits(static_cast<std::size_t>(s.N) * s.E);  // [N, E]
  linear_forward(logits.data(), x, gate, s.N, s.H, s.E);
  router_forward(probs, idx, w, logits.data(), s.N, s.E, s.k, s.norm_topk, bias);
  long dropped = 0;
  const std::vector<std::uint8_t> keep = moe_capacity_keep(idx, s, &dropped);
  moe_experts_forward(y, x, idx, w, gate_up, down, s.N, s.H, s.Im, s.E, s.k,
                      keep.empty() ? nullptr : keep.data(), lora);
  return dropped;
}

// dx = the experts' input gradient + d logits Wg; d logits from the routing weights' gradient
// (and the load-balancing loss's).
template <typename T>
void moe_block_backward(T* dx, T* dgate, T* dgate_up, T* ddown, const T* dy, const T* x,
                        const T* probs, const int* idx, const T* w, const T* gate,
                        const T* gate_up, const T* down, const MoeShape& s,
                        const RouterBalance* balance, T aux_coef, const ExpertLora<T>* lora) {
  QT_CHECK((dgate == nullptr) == (dgate_up == nullptr),
           "the router's and the experts' gradients: all or none (a frozen block)");
  const std::size_t NH = static_cast<std::size_t>(s.N) * s.H;
  std::vector<T> dw(static_cast<std::size_t>(s.N) * s.k), dlogits(static_cast<std::size_t>(s.N) * s.E);
  std::vector<T> dx_gate(NH);
  const std::vector<std::uint8_t> keep = moe_capacity_keep(idx, s);  // the forward's drops
  moe_experts_backward(dx, dw.data(), dgate_up, ddown, dy, x, idx, w, gate_up, down, s.N, s.H,
                       s.Im, s.E, s.k, keep.empty() ? nullptr : keep.data(), lora);
  router_backward(dlogits.data(), dw.data(), probs, idx, s.N, s.E, s.k, s.norm_topk);
  if (balance) router_aux_backward(dlogits.data(), *balance, probs, s.N, aux_coef);
  linear_backward(dx_gate.data(), dgate, dlogits.data(), x, gate, s.N, s.H, s.E);
  for (std::size_t i = 0; i < NH; ++i) dx[i] += dx_gate[i];
}

#define QT_MOE_BLOCK(T)                                                                         \
  template long moe_block_forward<T>(T*, T*, int*, T*, const T*, const T*, const T*, const T*, \
                                     const MoeShape&, const T*,                                 \
                                     const ExpertLora<T>*);                                     \
  template void moe_block_backward<T>(T*, T*, T*, T*, const T*, const T*, const T*, const int*, \
                                      const T*, const T*, const T*, const T*, const MoeShape&,  \
                                      const RouterBalance*, T, const ExpertLora<T>*);
QT_MOE_BLOCK(float)
QT_MOE_BLOCK(double)
#undef QT_MOE_BLOCK

}  // namespace qt::cpu
