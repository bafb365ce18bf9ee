// Qwen3 model (dense or MoE) on the CPU: the layer program (model/layer_program.h) over CpuOps in fp32,
// exactly the math of ../shared/docs/qwen3-spec.md section 2.
#pragma once

#include <cstdint>
#include <vector>

#include "model/cpu_ops.h"
#include "model/layer_program.h"
#include "model/model_params.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

class LoraAdapters;

// Deterministic initialisation as transformers does it: Linear and Embedding weights
// N(0, initializer_range), norm weights 1. Each element's value depends only on (seed, parameter
// name, element index), never on the mesh.
void init_params(const ModelConfig& cfg, const ParamLayout& layout, std::uint64_t seed,
                 float* params);
// The same values, for the flat ranges `pieces` of `layout` only (a sharded state initialises
// just what the rank holds).
void init_params(const ModelConfig& cfg, const ParamLayout& layout, std::uint64_t seed,
                 const std::vector<FlatPiece>& pieces);
// The host threads init_params uses for `layout`: up to 16, no more than the CPUs this process
// may run on (its affinity mask).
unsigned init_params_threads(const ParamLayout& layout);

// The checks of a micro-batch's ids (< V; targets may be -100) and positions (0, or one past
// the previous in the row), each [B, T]; a null array is not checked.
void check_micro_batch(const std::int32_t* inputs, const std::int32_t* targets,
                       const std::int32_t* positions, int B, int T, int V);

class Qwen3Model {
 public:
  // Buffers for micro-batches of B sequences of T tokens. recompute: keep only each layer's input
  // (and its norm) and recompute the rest of the layer in backward. seq_parallel > 1: sequence
  // parallelism over a tp group of that size (set_tensor_parallel): the residual stream and the
  // norms keep B*T / seq_parallel rows.
  Qwen3Model(const ModelConfig& cfg, int B, int T, bool recompute, int seq_parallel = 1);

  // Bytes of the buffers that constructor allocates (activations, logits, their gradients); the
  // memory check runs it before allocating.
  static double buffer_bytes(const ModelConfig& cfg, int B, int T, bool recompute,
                             int seq_parallel = 1);

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return program_.layout(); }
  int batch() const { return B_; }
  int seq_len() const { return T_; }

  // inputs, targets: [B, T]; targets -100 are not counted. positions: [B, T] RoPE position of
  // each input, 0 where a document starts, attention only within a document (packing; a valid
  // row: pos[0] = 0, pos[t] = pos[t-1] + 1 or 0), or null: positions 0..T-1, plain causal.
  // Returns the sum of the cross-entropy over counted targets (nats) and keeps what backward
  // needs.
  // The parameters come unit by unit from `params` (model/model_params.h; the units of
  // units()); the head's units stay acquired from the forward to the backward.
  double forward(ModelParams& params, const std::int32_t* inputs, const std::int32_t* targets,
                 const std::int32_t* positions = nullptr);
  // The same over the whole flat buffer of layout().
  double forward(const float* params, const std::int32_t* inputs, const std::int32_t* targets,
                 const std::int32_t* positions = nullptr);

  // The forward with no backward to follow (evaluation): the same loss, and every unit it
  // acquired released (the head's too), so that the next forward gathers afresh.
  double forward_only(ModelParams& params, const std::int32_t* inputs,
                      const std::int32_t* targets, const std::int32_t* positions = nullptr);

  // grads += loss_scale * d(summed loss)/d(params), for the last forward, unit by unit in reverse
  // (the head, layers L-1 .. 0, the embedding). Null grads: the base is frozen (LoRA), only the
  // adapters' gradients accumulate.
  void backward(ModelParams& params, float loss_scale);
  void backward(const float* params, float* grads, float loss_scale);

  // The units the model asks ModelParams for (a plan for dp 1: unit ranges do not depend on dp).
  const ShardPlan& units() const { return program_.units(); }

  // LoRA adapters applied beside the projections they target in every forward and backward
  // (src/model/lora.h; their weights and gradients are bound there), or null: none.
  void set_lora(LoraAdapters* lora) { ops_.set_lora(lora); }
  // Tensor parallelism: this model is tp rank's local part (parallel/tensor_parallel.h), whose
  // row-parallel outputs and column-parallel input gradients are summed over `tp` (with
  // sequence parallelism, the constructor's seq_parallel = tp->size(), reduce-scattered).
  void set_tensor_parallel(Comm* tp) {
    ops_.set_tp(tp);
    vocab_global_ = cfg_.vocab_size * (tp ? tp->size() : 1);
  }

  // Context parallelism (CpuOps::set_context_parallel): the model's B x T rows are this cp
  // rank's tokens of each sequence (T = split->local_len(cp rank)), and forward's positions
  // (then required) are their global RoPE positions, checked by the caller on the whole
  // sequence (a rank's tokens jump where its two chunks meet).
  void set_context_parallel(Comm* cp, const ContextSplit* split) {
    ops_.set_context_parallel(cp, split);
    context_parallel_ = cp != nullptr && cp->size() > 1;
  }

  // Qwen3-MoE: the weight of each micro-batch's load-balancing loss in the objective (CpuOps::
  // set_moe_aux_scale), and the last forward's loss (k when balanced; 0 for a dense model).
  void set_moe_aux_scale(float scale) { ops_.set_moe_aux_scale(scale); }
  // The routers' balancing bias [sparse layers, E] (CpuOps::set_router_bias; null: none).
  void set_router_bias(const float* bias) { ops_.set_router_bias(bias); }
  // Expert parallelism over `ep` (CpuOps::set_expert_parallel).
  void set_expert_parallel(Comm* ep) { ops_.set_expert_parallel(ep); }
  double moe_aux_loss() const { return ops_.moe_aux_loss(); }
  // Token-slots routed to each expert since clear_moe_load(): [sparse layers][E] (CpuOps).
  const std::vector<double>& moe_load() const { return ops_.moe_load(); }
  // Token-slots the capacity dropped since clear_moe_load(): [sparse layers] (CpuOps).
  const std::vector<double>& moe_dropped() const { return ops_.moe_dropped(); }
  void clear_moe_load() { ops_.clear_moe_load(); }

  // [B*T, V] logits of the last forward (valid until backward).
  const float* logits() const { return ops_.logits(); }

 private:
  ModelConfig cfg_;
  int B_, T_;
  HostArena arena_;                 // every buffer below
  CpuOps ops_;
  Qwen3Program<CpuOps> program_;    // the layer program (model/layer_program.h)
  std::vector<std::int32_t> inputs_, targets_, pos_;  // [B, T] copies of the last forward's
  int vocab_global_ = cfg_.vocab_size;  // token ids are < this (tp: the local vocabulary x tp)
  bool context_parallel_ = false;       // set_context_parallel over more than one rank
};

}  // namespace qt
