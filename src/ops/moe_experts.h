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

#include <cstdint>

namespace qt::cpu {

// y written.
template <typename T>
void moe_experts_forward(T* y, const T* x, const int* idx, const T* w, const T* gate_up,
                         const T* down, int N, int H, int Im, int E, int k,
                         const std::uint8_t* keep = nullptr);

// dx [N, H] and dw [N, k] written; dgate_up, ddown accumulated (+=), or both null: frozen
// experts (LoRA on a Qwen3-MoE model), the input gradients only. Recomputes each expert's
// forward from x.
template <typename T>
void moe_experts_backward(T* dx, T* dw, T* dgate_up, T* ddown, const T* dy, const T* x,
                          const int* idx, const T* w, const T* gate_up, const T* down, int N,
                          int H, int Im, int E, int k, const std::uint8_t* keep = nullptr);

}  // namespace qt::cpu
