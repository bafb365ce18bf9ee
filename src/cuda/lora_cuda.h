// LoRA adapters on the GPU: qt::LoraAdapters (src/model/lora.h) in bf16, for Qwen3Cuda. Same
// layout (PEFT's names, A [r, in] then B [out, r] per layer and target), same math and the same
// dropout masks bit for bit:
//   y  += scale * drop(x) A^T B^T                         (forward; xa = drop(x) A^T kept)
//   dB += scale * dy^T xa,  g = dy B,  dA += scale * g^T drop(x),  dx += scale * drop'(g A)
// Weights are the bf16 compute copy, gradients fp32 (accumulated, +=); xa [N, r] is kept per
// layer and target (and activation slot) in bf16, the dropout mask is regenerated in the
// backward, never stored.
//
// Qwen3Cuda fuses projections that share an input into one GEMM, so the adapters are called per
// site: the site's fused output y (and its gradient dy) holds each target's columns.
//   kQKV:    x = rmsnorm 1 [N, H], y = [q | k | v] [N, Q + 2 KV]
//   kO:      x = attention [N, Q], y = [N, H]
//   kGateUp: x = rmsnorm 2 [N, H], y = [gate | up] [N, 2 I]
//   kDown:   x = swiglu [N, I],    y = [N, H]
//
// Qwen3-MoE (expert targets experts.gate_up_proj, experts.down_proj; ops/moe_experts.h has the
// math): every expert's adapters stacked per sparse layer, A [E, r, in] and B [E, out, r],
// applied beside the experts' grouped GEMMs (cuda/grouped_gemm.h) on their rows in expert order:
// xa = x A_e^T [rows, r] (kept per layer and slot), y += scale xa B_e^T; backward
// gy = scale dy B_e, dB_e += scale dy^T xa, dA_e += gy^T x, dx += gy A_e. No dropout. With an ep
// group a rank holds its own experts' adapters (the local model's E / ep: plan_adapters shards
// them over ep like the experts); under tp gate_up's B holds the rank's gate and up rows and
// down's A its columns, as the base.
//
// Tensor parallelism (cfg is then the tp rank's local model, tp_local_config): the adapters
// follow their base projection's split (tp_role in include/qtrain/shard_plan.h). Beside q/k/v
// and gate/up (column-parallel) B [out/tp, r] holds the rank's rows and A is whole: xa is the
// same on every rank, dA and dx are partial over tp (dA summed by the optimizer state, dx by
// the program's tp_block_input_backward hook with the base's). Beside o and down (row-parallel)
// A [r, in/tp] holds the rank's columns and B is whole: xa = x_t A_t^T and so y's adapter term
// are partial over tp, summed by tp_block_output with the base GEMM's partial output (no
// collective of their own), and dB = scale dy^T xa_t is partial too (summed by the state);
// g = dy B, dA and dx are exact. The row-parallel input's dropout masks are the columns of the
// serial run's masks that the rank holds (set_tensor_parallel), so every mesh drops alike.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/device.h"
#include "model/adapter_buffers.h"
#include "model/layer_program.h"
#include "ops/cuda/lora_dropout.cuh"
#include "qtrain/lora.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"

namespace qt::cuda {

using bf16 = __nv_bfloat16;

using qt::LoraSite;  // model/layer_program.h: kQKV, kO, kGateUp, kDown, in forward order

class LoraCuda {
 public:
  // For micro-batches of B sequences of T tokens (N = B*T rows); buffers from `arena`.
  LoraCuda(const ModelConfig& cfg, const LoraConfig& lora, int B, int T, DeviceArena& arena)
      : LoraCuda(cfg, lora, B, T, arena, {{0, cfg.num_layers}}, 1) {}
  // The adapters of the layer ranges [first, last) only (a pipeline stage's chunks, ascending:
  // layout() is lora_layout's of those ranges; other layers are not adapted), for `slots`
  // micro-batches in flight between their forward and backward (select_slot).
  LoraCuda(const ModelConfig& cfg, const LoraConfig& lora, int B, int T, DeviceArena& arena,
           const std::vector<std::pair<int, int>>& layer_ranges, int slots);

  const ParamLayout& layout() const { return layout_; }

  // The adapters' bf16 weights and fp32 gradients (layout().numel() each, device) of the next
  // forward and backward.
  void bind(const bf16* weights, float* grads) {
    bind(AdapterBuffers<bf16>::whole(layout_.numel(), weights, grads));
  }
  // The same, unit by unit (plan_adapters' units of layout()).
  void bind(AdapterBuffers<bf16> buffers) { buf_ = std::move(buffers); }
  // Keys the dropout masks (LoraAdapters::set_dropout_key): the run's seed and the index in the
  // data order of the micro-batch's first sequence.
  void set_dropout_key(std::uint64_t seed, std::int64_t first_sample) {
    seed_ = seed, first_sample_ = first_sample;
  }

  // The micro-batch of the next forward or backward is the one in activation slot `slot` (of
  // the constructor's `slots`): each slot keeps its own xa between them.
  void select_slot(int slot);

  // These are tp rank `rank`'s adapters of tp ranks (the constructor's cfg is its local model):
  // a row-parallel target's input is columns [rank x in, (rank + 1) x in) of the global input,
  // so its dropout masks are those columns of the global masks. tp 1: nothing changes.
  void set_tensor_parallel(int tp, int rank);

  // True when some target of `site` is adapted.
  bool adapts(LoraSite site) const;
  // y += scale * drop(x) A^T B^T for every adapted target of the site, into its columns of y;
  // keeps xa for the backward. A recomputed forward rewrites xa with the same bits.
  void forward(int layer, LoraSite site, const bf16* x, bf16* y, cudaStream_t s);
  // After forward(layer, site, x, .), with dy the gradient of the site's output: dA and dB
  // accumulate; dx [N, in] += scale * drop'(g A) (bf16), skipped when dx is null.
  void backward(int layer, LoraSite site, const bf16* x, const bf16* dy, bf16* dx,
                cudaStream_t s);

  // True when the experts' projection `et` (kLoraExpertsGateUp, kLoraExpertsDown) is adapted.
  bool adapts_experts(int et) const { return experts_on_[static_cast<std::size_t>(et)]; }
  // Beside the base's grouped GEMM of sparse layer `layer`'s expert projection `et`, over `rows`
  // rows in expert order that offsets [groups + 1] (device) split among the experts stored here
  // (groups of them: all E, or an ep rank's own): gate_up x [rows, H] -> y = gate|up [rows, 2 Im],
  // down x = SwiGLU [rows, Im] -> y = out [rows, H]. y += scale x A_e^T B_e^T; keeps xa for the
  // backward (a recomputed forward rewrites it with the same bits). No-op when not adapted.
  void expert_forward(int layer, int et, const bf16* x, bf16* y, const int* offsets, int groups,
                      int rows, cudaStream_t s);
  // After expert_forward(layer, et, x, ...), with dy the gradient of its y: dA_e and dB_e
  // accumulate; dx [rows, in] += scale dy B_e A_e (bf16), skipped when dx is null.
  void expert_backward(int layer, int et, const bf16* x, const bf16* dy, bf16* dx,
                       const int* offsets, int groups, int rows, cudaStream_t s);

 private:
  struct Slot {  // one adapted projection of one layer
    int target = -1;
    int in = 0, out = 0;
    int col = 0;               // first column of the target in the site's fused output
    int in_global = 0;         // the dropout masks' row width (in, or in x tp: row-parallel)
    int col0 = 0;              // the mask column of this input's column 0
    std::size_t a = 0, b = 0;  // offsets of A and B in the layout
    bf16* xa = nullptr;        // [slots, N, r] drop(x) A^T of each slot's last forward
  };
  struct ExpertSlot {  // one adapted expert projection of one sparse layer, its El experts here
    int in = 0, out = 0;
    std::size_t a = 0, b = 0;  // offsets of the stacked A [El, r, in] and B [El, out, r]
    bf16* xa = nullptr;        // [slots, expert rows, r] x A_e^T, expert order; null: not adapted
  };
  const ExpertSlot& expert_slot(int layer, int et, int groups, int rows) const;
  // The adapted slots of one site of one layer (at most 3).
  const std::vector<Slot>& slots(int layer, LoraSite site) const {
    return slots_[static_cast<std::size_t>(layer) * 4 + static_cast<int>(site)];
  }
  int width(LoraSite site) const;  // columns of the site's fused output (its row stride)
  LoraDropoutKey dropout_key(int layer, const Slot& slot) const;
  // x with slot's dropout mask applied (into xd_), or x itself when dropout is off.
  const bf16* dropped(int layer, const Slot& slot, const bf16* x, cudaStream_t s);

  ModelConfig cfg_;
  LoraConfig lora_;
  ParamLayout layout_;
  int T_, N_;
  int first_layer_;           // the first adapted layer (adapts() looks there)
  int slots_in_flight_;       // select_slot's range
  std::size_t xa_at_ = 0;     // the selected slot's offset in each Slot::xa
  float scale_;
  std::vector<std::vector<Slot>> slots_;  // [layer * 4 + site]
  std::vector<ExpertSlot> experts_;       // [layer * kNumLoraExpertTargets + et]
  std::array<bool, kNumLoraExpertTargets> experts_on_{};
  std::size_t expert_rows_ = 0;     // rows of the experts' buffers (ops/moe_capacity.h)
  std::size_t expert_xa_at_ = 0;    // the selected slot's offset in each ExpertSlot::xa
  AdapterBuffers<bf16> buf_;  // bind()'s
  std::uint64_t seed_ = 0;
  std::int64_t first_sample_ = 0;
  bf16* gy_ = nullptr;  // [max(N, expert rows), r] dy B of one target
  bf16* xd_ = nullptr;  // [N, max in]: drop(x), then scale * g A (dropout > 0 only)
};

}  // namespace qt::cuda
