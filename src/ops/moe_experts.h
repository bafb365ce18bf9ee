// The routed experts of a Qwen3-MoE block (qwen3-spec.md 3.2), the CPU reference (issue 18):
// each token's output is the routing-weighted sum of its k experts' SwiGLU MLPs,
//   y[t] = sum_j w[t, j] down_e(silu(gate_e x[t]) * up_e x[t]),  e = idx[t, j].
// Shapes: x, y [N, H]; idx, w [N, k] (the router's, ops/moe_router.h); gate_up [E, 2 Im, H]
// (rows [0, Im) gate, [Im, 2 Im) up, transformers 5's gate_up_proj); down [E, H, Im]. Each
// expert runs its tokens as one GEMM per projection, in ascending expert order; a token's k
// contributions are added in that order (fp32 or fp64, the reference's precision).
// keep [N k] (ops/moe_capacity.h; null: every pair kept): a dropped pair (0) runs no expert,
// adds nothing to y, and gets d w = 0 and no expert gradient.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qt::cpu {

// LoRA adapters on every expert (include/qtrain/lora.h kLoraExpertTargets; PEFT's ParamWrapper
// on the fused tensors): expert e's gate|up rows get gu += scale * (x A_e^T) B_e^T with
// gu_a [E, r, H], gu_b [E, 2 Im, r]; its output ye += scale * (h A_e^T) B_e^T with
// dn_a [E, r, Im], dn_b [E, H, r]. A null pair: that projection not adapted. No dropout (PEFT
// refuses it on a ParamWrapper). Gradients (backward only) accumulate (+=) into the g_ pointers
// of the adapted pairs.
template <typename T>
struct ExpertLora {
  int r = 0;
  T scale = 0;
  const T *gu_a = nullptr, *gu_b = nullptr, *dn_a = nullptr, *dn_b = nullptr;
  T *g_gu_a = nullptr, *g_gu_b = nullptr, *g_dn_a = nullptr, *g_dn_b = nullptr;
  bool on() const { return gu_a != nullptr || dn_a != nullptr; }
};

// y written.
template <typename T>
void moe_experts_forward(T* y, const T* x, const int* idx, const T* w, const T* gate_up,
                         const T* down, int N, int H, int Im, int E, int k,
                         const std::uint8_t* keep = nullptr, const ExpertLora<T>* lora = nullptr);

// dx [N, H] and dw [N, k] written; dgate_up, ddown accumulated (+=), or both null: frozen
// experts (LoRA on a Qwen3-MoE model), the input gradients only. Recomputes each expert's
// forward from x. lora: the forward's adapters, their gradients accumulated.
template <typename T>
void moe_experts_backward(T* dx, T* dw, T* dgate_up, T* ddown, const T* dy, const T* x,
                          const int* idx, const T* w, const T* gate_up, const T* down, int N,
                          int H, int Im, int E, int k, const std::uint8_t* keep = nullptr,
                          const ExpertLora<T>* lora = nullptr);

}  // namespace qt::cpu
