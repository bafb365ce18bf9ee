// Qwen3 dense forward and backward on one GPU: bf16 weights and activations, fp32 weight
// gradients, the ops of src/ops/cuda, every buffer from one DeviceArena. The math and the bf16
// rounding points are transformers' (qwen3-spec.md 7.2); the CPU model is the oracle.
//
// The lm head and the cross-entropy run chunked over tokens and backward immediately for each
// chunk, so the full [tokens, vocab] logits never exist: forward and backward are one call.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "cuda/device.h"
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
};

class Qwen3Cuda {
 public:
  // Buffers for micro-batches of B x T tokens, taken from `arena` (which must outlive this).
  // With `recompute`, only each layer's input (residual stream, its norm and rstd) is kept from
  // the forward; the backward recomputes the layer's forward into one shared set of activation
  // buffers first (about a third more compute, activation memory of one layer instead of L).
  // The results are bitwise those of the run without recompute.
  Qwen3Cuda(const ModelConfig& cfg, int B, int T, DeviceArena& arena, bool recompute = false);

  const ParamLayout& layout() const { return layout_; }

  // LoRA adapters applied beside the projections they target in every forward and backward
  // (src/cuda/lora_cuda.h; their weights and gradients are bound there), or null: none. Set once,
  // before the first forward_backward.
  void set_lora(LoraCuda* lora) { lora_ = lora; }

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
  const ShardPlan& units() const { return plan_; }

 private:
  // q/k/v_proj and gate/up_proj are adjacent in the flat layout, so each pair runs as one GEMM
  // into one buffer: qkv_raw rows are [q | k | v], gu rows [gate | up].
  struct LayerActs {                 // N = B*T rows
    bf16* qkv_raw;                   // [N, Q + 2 KV] before q/k norm
    float *q_rstd, *k_rstd;          // [N*nh], [N*nkv]
    bf16 *q, *k, *v;                 // [N, Q], [N, KV], [N, KV] after norm and rope
    bf16* att;                       // [N, Q]
    float* lse;                      // [B, nh, T]
    bf16 *x_mid, *ln2;               // [N, H]
    float* rstd2;                    // [N]
    bf16* gu;                        // [N, 2 I]
    bf16* h;                         // [N, I]
  };

  // Layer l's tensors inside its unit's buffer (weights or gradients; null stays null).
  template <class T>
  struct LayerTensors {
    T *ln1, *wq, *wo, *q_norm, *k_norm, *ln2, *w_gate, *w_down;
  };
  template <class T>
  LayerTensors<T> layer_tensors(int l, T* unit) const;

  // next_norm: the input norm weight of layer l + 1, or the final norm's after the last layer.
  void layer_forward(int l, const LayerTensors<const bf16>& w, const bf16* next_norm,
                     cudaStream_t s);
  void layer_backward(int l, const LayerTensors<const bf16>& w, const LayerTensors<float>& g,
                      cudaStream_t s);
  // How far down layer l's backward goes: through its projections in backward order, then to
  // its input (kBelow), unless the base is frozen and nothing below needs a gradient.
  enum Depth { kDown, kGateUp, kO, kQKV, kBelow };
  Depth backward_depth(int l, bool frozen) const;
  // lm_head: [V, H] bf16; g_lm_head: its gradient or null.
  void lm_head_loss(const bf16* lm_head, float* g_lm_head, const std::int32_t* targets,
                    float loss_scale, cudaStream_t s);

  ModelConfig cfg_;
  ParamLayout layout_;
  ModelOffsets off_ = layout_.model_offsets();
  ShardPlan plan_;
  Qwen3Units unit_;
  int B_, T_, N_;
  float *cos_, *sin_;                // [T, hd/2] fp32 tables
  std::vector<bf16*> x_;             // [L+1] residual stream [N, H]; x_[l] is layer l's input
  std::vector<bf16*> ln_;            // [L+1] rmsnorm(x_[l]) [N, H]; ln_[L] is the final norm
  std::vector<float*> rstd_;         // [L+1] [N]
  std::vector<LayerActs> acts_;      // [L], or [1] shared by every layer with recompute
  bool recompute_ = false;
  LayerActs& acts(int l) { return acts_[recompute_ ? 0 : l]; }
  LoraCuda* lora_ = nullptr;
  bool accumulate_ = true;  // this micro-batch's GradWrite: add into G (else write G)
  const std::int32_t* inputs_ = nullptr;
  const std::int32_t* pos_ = nullptr;  // device [B, T] positions of this micro-batch, or null
  // scratch
  bf16 *tmp_, *dx_, *dtmp_, *dln_;   // [N, H]
  bf16 *dh_, *datt_, *dq_, *dk_, *dv_;  // [N, I], [N, Q], [N, Q], [N, KV], [N, KV]
  bf16* dqkv_;                       // [N, Q + 2 KV]
  int chunk_;                        // lm-head rows per chunk
  bf16* logits_;                     // [chunk, V]
  float *losses_, *chunk_lse_;       // [chunk]
  double* loss_sum_;                 // device scalar
  void* ws_;                         // norm / embedding backward workspace
  std::size_t ws_bytes_;
};

}  // namespace qt::cuda
