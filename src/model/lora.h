// LoRA adapters on the CPU, as PEFT's LoraLayer computes them (include/qtrain/lora.h):
//   y = x W^T + scale * drop(x) A^T B^T,   A [r, in], B [out, r], scale = alpha / r,
// drop = inverted dropout (keep with probability 1 - p, kept values times 1 / (1 - p)).
// The adapters live in their own flat fp32 buffer with their own layout (PEFT's names, e.g.
// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"); Qwen3Model calls forward()
// and backward() beside each adapted projection, and the frozen base gets no gradient.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/adapter_buffers.h"
#include "ops/moe_experts.h"
#include "parallel/layout_map.h"
#include "qtrain/lora.h"
#include "qtrain/mesh.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

// Index into kLoraTargets.
enum LoraTarget : int { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown };

// PEFT's name of A ('A') or B ('B') of one projection of one layer.
std::string lora_param_name(int layer, int target, char which);
// Whether layer l has projection `target`: every layer its attention's; the MLP targets
// (gate_proj, up_proj, down_proj) only a dense layer (a Qwen3-MoE model's model.mlp_only_layers).
bool lora_target_in_layer(const ModelConfig& cfg, int layer, int target);
// [in, out] of projection `target` in `cfg` (W is [out, in]).
std::pair<int, int> lora_target_dims(const ModelConfig& cfg, int target);
// The name of the stacked A ('A', [E, r, in]) or B ('B', [E, out, r]) of expert target `et`
// (kLoraExpertTargets) of sparse layer `layer`: expert e's A_e and B_e at row e. An ep rank's
// local model (ep_local_config) holds its own experts' rows only, [E / ep, ...], sharded over ep
// like the experts (plan_adapters; EpMap places them in the global tensors).
// qtrain's own name; the export writes PEFT's (hf/lora_export.h).
std::string lora_expert_param_name(int layer, int et, char which);
// [in, out] of each expert's W_e of expert target `et`: gate_up_proj [H, 2 Im], down_proj [Im, H].
std::pair<int, int> lora_expert_dims(const ModelConfig& cfg, int et);
// The adapter layout: per layer, per target in kLoraTargets order that the layer has
// (lora_target_in_layer), A [r, in] then B [out, r];
// then, in a sparse layer, per expert target, the stacked A [El, r, in] then B [El, out, r]
// (El = cfg.local_experts(): E, or an ep rank's E / ep).
ParamLayout lora_layout(const ModelConfig& cfg, const LoraConfig& lora);
// The same for layers [first_layer, last_layer) only (a pipeline chunk's; names keep the
// model's layer numbers).
ParamLayout lora_layout(const ModelConfig& cfg, const LoraConfig& lora, int first_layer,
                        int last_layer);
// The same for each of the layer ranges [first, last) in turn (a pipeline stage's chunks,
// ascending).
ParamLayout lora_layout(const ModelConfig& cfg, const LoraConfig& lora,
                        const std::vector<std::pair<int, int>>& layer_ranges);
// Where a rank's adapters (local: lora_layout of its tp and ep rank's model over layer_ranges,
// planned as local_plan) live in the model's (global: lora_layout(cfg, lora)), for checkpoints,
// initialisation and export: a TpMap, or with adapters on the experts at mesh.ep > 1 a TpEpMap
// (the rank's E / ep experts' rows of each stacked tensor); null when local is global (tp 1,
// every layer, no such experts). cfg: the global model. The layouts and local_plan must outlive
// the map.
std::unique_ptr<LayoutMap> lora_map(const ModelConfig& cfg, const LoraConfig& lora,
                                    const std::vector<std::pair<int, int>>& layer_ranges,
                                    const ParamLayout& global, const ParamLayout& local,
                                    const ShardPlan& local_plan, const MeshShape& mesh,
                                    int tp_rank, int ep_rank);
// PEFT's initialisation (an expert's A as a plain one): A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_ with a = sqrt(5)),
// B = 0, so the adapted model starts as the base. Value i of A depends on (seed, name, i) only.
void lora_init(const ParamLayout& layout, std::uint64_t seed, float* adapters);
// The dropout stream of projection `target` of layer `layer` in a run with `seed`: element i of
// token t of the sequence with index g in the data order (rows of `in` elements) is kept iff
// rng::uniform(stream, (g * T + t) * in + i) >= dropout, in double (src/runtime/rng.h). The CUDA
// back end draws the same masks (src/ops/cuda/lora_dropout.cuh).
std::uint64_t lora_dropout_stream(std::uint64_t seed, int layer, int target);
// Base weights W [out, in] += scale * B A for every adapter of `layout` (export --merge).
// base: the model's flat buffer (base_layout).
void lora_merge(const ModelConfig& cfg, const LoraConfig& lora, const float* adapters,
                const ParamLayout& base_layout, float* base);

class LoraAdapters {
 public:
  // Adapters for micro-batches of B sequences of T tokens (N = B*T rows).
  LoraAdapters(const ModelConfig& cfg, const LoraConfig& lora, int B, int T)
      : LoraAdapters(cfg, lora, B, T, 0, cfg.num_layers, 1) {}
  // Those of layers [first_layer, last_layer) only (a pipeline chunk's: layout() is
  // lora_layout's of that range; the other layers' projections are not adapted), for `slots`
  // micro-batches in flight between their forward and backward (select_slot).
  LoraAdapters(const ModelConfig& cfg, const LoraConfig& lora, int B, int T, int first_layer,
               int last_layer, int slots);

  const LoraConfig& config() const { return lora_; }
  const ParamLayout& layout() const { return layout_; }
  double scale() const { return scale_; }

  // The adapter weights and gradient buffer (layout().numel(); gradients accumulate, +=) of the
  // next forward and backward. grads may be null when no backward follows.
  void bind(const float* params, float* grads) {
    bind(AdapterBuffers<float>::whole(layout_.numel(), params, grads));
  }
  // The same, unit by unit (plan_adapters' units of layout()).
  void bind(AdapterBuffers<float> buffers) { buf_ = std::move(buffers); }
  // Keys the dropout masks of the next forward and backward: the run's seed and the index in
  // the data order of the micro-batch's first sequence. The mask of element i of token t of
  // sequence g is a pure function of (seed, layer, target, g, t, i): independent of the mesh and
  // of micro-batching, and the same when a layer is recomputed.
  void set_dropout_key(std::uint64_t seed, std::int64_t first_sample) {
    seed_ = seed, first_sample_ = first_sample;
  }

  // Context parallelism: the adapters' T rows a sequence are the tokens `index` [T] (global
  // indices, ascending) of sequences of seq_len tokens (parallel/context_parallel.h), so that
  // a token's dropout mask is keyed by its place in the whole sequence, as at cp = 1.
  void set_context_parallel(int seq_len, const std::vector<std::int32_t>& index);

  // Evaluation switches dropout off (the adapters' input as is, as PyTorch's eval mode does) and
  // back on for training.
  void set_dropout_enabled(bool on) { dropout_on_ = on; }

  int first_layer() const { return first_layer_; }
  int last_layer() const { return last_layer_; }
  int slots() const { return slots_in_flight_; }
  // The micro-batch of the next forward or backward is the one in activation slot `slot`: each
  // slot keeps its own drop(x) A^T between them (a pipeline stage's micro-batches in flight).
  void select_slot(int slot);

  // Tensor parallelism: these are the adapters of tp rank `rank`'s local model (the
  // constructor's cfg is tp_local_config's). A row-parallel projection's (o_proj, down_proj)
  // input holds this rank's columns [rank x in, (rank + 1) x in) of the global one, so its
  // dropout masks are those columns of the global masks (the same draws as without tp).
  void set_tensor_parallel(int tp, int rank);

  // True when projection `target` has adapters (in every layer: all layers adapt the same).
  bool adapts(int target) const { return slots_[target].on; }
  // y[N, out] += scale * drop(x) A^T B^T for x [N, in]; keeps drop(x) A^T [N, r] for backward.
  // y's rows have stride ldy (0: out; a fused projection's output holds the target's columns).
  // No-op for a projection that is not a target.
  void forward(int layer, int target, const float* x, float* y, int ldy = 0);
  // After forward(layer, target, x, .): with dy [N, out] (row stride lddy, 0: out) the gradient
  // of y,
  //   dB [out, r] += scale * dy^T (drop(x) A^T),   dA [r, in] += scale * (dy B)^T drop(x),
  //   dx [N, in]  += scale * drop'((dy B) A)       (skipped when dx is null).
  void backward(int layer, int target, const float* x, const float* dy, float* dx, int lddy = 0);

  // True when the experts have adapters (every sparse layer of the range alike).
  bool adapts_experts() const { return experts_on_; }
  // Sparse layer `layer`'s expert adapters over the bound weights, with the bound gradients
  // when `grads` (ops/moe_experts.h); r = 0 (none) when the experts are not adapted.
  cpu::ExpertLora<float> experts(int layer, bool grads) const;

 private:
  struct Slot {  // one adapted projection of one layer
    bool on = false;
    int in = 0, out = 0;
    int in_global = 0, col0 = 0;  // the dropout masks' row width and this input's first column
    std::size_t a = 0, b = 0;  // offsets of A and B in the adapter buffer
    std::vector<float> xa;     // [slots, N, r] drop(x) A^T of each slot's last forward
  };
  // x with the dropout mask of (layer, target) applied, into xd_ ([N, in], the mask times
  // 1 / (1 - p) into mask_); returns x itself when dropout is off.
  const float* dropped(int layer, int target, const Slot& s, const float* x);

  ModelConfig cfg_;
  LoraConfig lora_;
  ParamLayout layout_;
  int B_, T_, N_;
  int first_layer_, last_layer_;  // the layers adapted
  int slots_in_flight_;           // micro-batches between forward and backward (select_slot)
  std::size_t xa_at_ = 0;         // the selected slot's offset in each Slot::xa
  double scale_;
  std::vector<Slot> slots_;  // [layer * kNumLoraTargets + target]
  // [layer * kNumLoraExpertTargets + et]: offsets of the stacked A and B (npos: not adapted)
  std::vector<std::pair<std::size_t, std::size_t>> expert_at_;
  bool experts_on_ = false;
  AdapterBuffers<float> buf_;  // bind()'s
  std::uint64_t seed_ = 0;
  std::int64_t first_sample_ = 0;
  int seq_len_ = T_;                       // tokens of a whole sequence (set_context_parallel)
  std::vector<std::int32_t> token_index_;  // [T] each row's token in it, or empty: the row
  bool dropout_on_ = true;  // set_dropout_enabled
  std::vector<float> xd_, mask_, g_, dxd_;  // scratch: [N, max in] x 2, [N, r], [N, max in]
};

}  // namespace qt
