// Qwen3 dense forward and backward on one GPU: the layer program (model/layer_program.h) over
// CudaOps (bf16 weights and activations, fp32 weight gradients, the kernels of src/ops/cuda),
// every buffer from one DeviceArena. The math and the bf16 rounding points are transformers'
// (qwen3-spec.md 7.2); the CPU model is the oracle.
//
// The lm head and the cross-entropy run chunked over tokens and backward immediately for each
// chunk, so the full [tokens, vocab] logits never exist: forward and backward are one call.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "cuda/cuda_ops.h"
#include "cuda/device.h"
#include "model/layer_program.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt::cuda {

using bf16 = __nv_bfloat16;

class LoraCuda;

// Where Qwen3Cuda finds each unit's weights and gradients: the units of the sharding plan
// (include/qtrain/shard_plan.h; Qwen3Units: 0 the embedding, 1 + l layer l, L + 1 the head).
// The model calls these on the host while it enqueues work on stream `s`; a pointer returned is
// valid for work enqueued on `s` after the call, until release(unit) (weights) or grads_done(unit)
// (gradients). A flat buffer (FlatUnits) just returns pointers into it; a sharded state gathers a
// unit's weights ahead of use and reduces its gradients when they are done.
class UnitSource {
 public:
  virtual ~UnitSource() = default;
  // The unit's bf16 weights [unit size], each tensor at its flat offset minus the unit's begin.
  virtual const bf16* weights(int unit, cudaStream_t s) = 0;
  // The unit's fp32 gradient buffer (same layout), or null: frozen (LoRA's base).
  virtual float* grads(int unit, cudaStream_t s) = 0;
  // The model has enqueued its last use of the unit's weights (until it asks again).
  virtual void release(int /*unit*/, cudaStream_t /*s*/) {}
  // The model has enqueued every write of this micro-batch to the unit's gradients.
  virtual void grads_done(int /*unit*/, cudaStream_t /*s*/) {}
  // An untied embedding's gradient as rows: dx [N, hidden] bf16 and ids [N] (device, valid until
  // work enqueued on s after the call has run). True: taken, in place of grads() and
  // grads_done() of the embedding; false: the model writes the whole table's gradient.
  virtual bool take_embedding_rows(const bf16* /*dx*/, const std::int32_t* /*ids*/, int /*N*/,
                                   cudaStream_t /*s*/) {
    return false;
  }
};

// The layer program's view of a UnitSource (model/layer_program.h's Units): every call on the
// micro-batch's stream.
struct StreamUnits {
  UnitSource& src;
  cudaStream_t s;
  const bf16* weights(int u) { return src.weights(u, s); }
  float* grads(int u) { return src.grads(u, s); }
  void release(int u) { src.release(u, s); }
  void grads_done(int u) { src.grads_done(u, s); }
  bool take_embedding_rows(const bf16* dx, const std::int32_t* ids, int N) {
    return src.take_embedding_rows(dx, ids, N, s);
  }
};

class Qwen3Cuda {
 public:
  // Buffers for micro-batches of B x T tokens, taken from `arena` (which must outlive this).
  // With `recompute`, only each layer's input (residual stream, its norm and rstd) is kept from
  // the forward; the backward recomputes the layer's forward into one shared set of activation
  // buffers first (about a third more compute, activation memory of one layer instead of L).
  // The results are bitwise those of the run without recompute. tp: the tensor-parallel group
  // (cfg is then this rank's local model, tp_local_config; cuda_ops.h), or null; seq_parallel:
  // tp's size with sequence parallelism, else 1; tp_overlap: mesh.tp_overlap (cuda_ops.h). ep:
  // the expert-parallel group (cfg is then the ep rank's local model, ep_local_config), or null.
  Qwen3Cuda(const ModelConfig& cfg, int B, int T, DeviceArena& arena, bool recompute = false,
            NcclComm* tp = nullptr, int seq_parallel = 1, bool tp_overlap = false,
            NcclComm* ep = nullptr);

  const ParamLayout& layout() const { return program_.layout(); }

  // LoRA adapters applied beside the projections they target in every forward and backward
  // (src/cuda/lora_cuda.h; their weights and gradients are bound there), or null: none. Set once,
  // before the first forward_backward.
  void set_lora(LoraCuda* lora) { ops_.set_lora(lora); }

  // Called on the host while the backward is enqueued, with a watermark that only decreases and
  // ends at 0: once the work enqueued so far on the stream has run, every gradient at flat offset
  // >= begin is final for this micro-batch (the final norm and lm head first, then layer L-1 down
  // to layer 0, the embedding last). The data-parallel reduction starts from it.
  using GradsReady = std::function<void(std::size_t begin)>;

  // How G receives this micro-batch's gradients: added (kAccumulate), or written without reading
  // G first (kOverwrite: the first micro-batch of a step, so G needs no zeroing before it).
  enum class GradWrite { kAccumulate, kOverwrite };

  // inputs, targets: device [B, T] int32 (targets -100 ignored). W: bf16 weights in the flat
  // layout; G: fp32 gradients, accumulated (+= loss_scale * d(sum of losses)/dW; with kOverwrite
  // written: = ...; every element of the layout is written, the padding after it untouched), or null: the
  // base is frozen (LoRA; needs set_lora): no weight gradient is computed, nor any gradient that
  // only they would use (the embedding's, layer 0's below its lowest adapter). positions:
  // device [B, T] int32 RoPE positions, 0 where a document starts, attention only within a
  // document (packing; rows valid as in src/ops/attention.h), or null: 0..T-1, plain causal.
  // Enqueues on `stream`, then waits for it; returns the sum of the losses.
  double forward_backward(const bf16* W, float* G, const std::int32_t* inputs,
                          const std::int32_t* targets, float loss_scale, cudaStream_t stream,
                          const GradsReady& ready = {}, const std::int32_t* positions = nullptr,
                          GradWrite grad_write = GradWrite::kAccumulate);
  // The same with the weights and gradients from `units`, unit by unit: the forward asks for
  // layer l + 1 (or the head) while it enqueues layer l (whose last op, the fused residual and
  // norm, reads the next unit's input norm); the backward asks for the head, layers L-1 .. 0 and
  // the embedding, and reports each unit's gradients done in that order.
  double forward_backward(UnitSource& units, const std::int32_t* inputs,
                          const std::int32_t* targets, float loss_scale, cudaStream_t stream,
                          const std::int32_t* positions = nullptr,
                          GradWrite grad_write = GradWrite::kAccumulate);

  // The flat-layout units of this model (a plan for dp 1: unit ranges do not depend on dp).
  const ShardPlan& units() const { return program_.units(); }

  // Qwen3-MoE (CudaOps' moe ops): the weight of each micro-batch's load-balancing loss in the
  // objective, the last forward's loss (k when balanced; waits for the stream), and the
  // token-slots routed to each expert since clear_moe_load() ([sparse layers][E]).
  void set_moe_aux_scale(float scale) { ops_.set_moe_aux_scale(scale); }
  // The routers' balancing bias [sparse layers, E] (CudaOps::set_router_bias; empty: none).
  void set_router_bias(const std::vector<float>& bias) { ops_.set_router_bias(bias); }
  double moe_aux_loss() { return ops_.moe_aux_loss(); }
  const std::vector<double>& moe_load() const { return ops_.moe_load(); }
  // Token-slots the capacity dropped in each sparse layer since clear_moe_load().
  const std::vector<double>& moe_dropped() const { return ops_.moe_dropped(); }
  void clear_moe_load() { ops_.clear_moe_load(); }

 private:
  CudaOps ops_;
  Qwen3Program<CudaOps> program_;  // the layer program (model/layer_program.h)
};

}  // namespace qt::cuda
