// One pipeline stage of the Qwen3 model on the CPU (issue 17): the layer program over CpuOps for
// layers [first, last) of a StageRange (model/layer_program.h), the embedding on the first stage,
// the final norm, lm head and loss on the last, with several micro-batches in flight.
//
// Per micro-batch m on stage s of P (slot k holds m between its forward and its backward):
//   forward(params, k, batch, x_in, scale)  first stage: batch.inputs; else x_in = x[first] [N, H]
//                                           last stage: runs the head forward and backward too
//                                           and returns the summed loss; else output(k) = x[last]
//   backward(params, k, dx_in)              last stage: from the head's d ln[L]; else dx_in =
//                                           d x[last] [N, H]; input_grad() = d x[first] after it
// Gradients are added (+=, as Qwen3Model::backward): the caller zeroes them before a step. The
// units asked of `params` are stage_units(); a tied model's last stage asks for the embedding
// too (its copy of the table; a pipeline sums the two copies' gradients before the step).
#pragma once

#include <cstdint>
#include <vector>

#include "model/cpu_ops.h"
#include "model/layer_program.h"
#include "model/model_params.h"
#include "qtrain/model_config.h"

namespace qt {

class LoraAdapters;

// One micro-batch's data as a stage needs it, each [B, T] or null where the stage has no use.
struct StageBatch {
  const std::int32_t* inputs = nullptr;     // token ids: the first stage
  const std::int32_t* targets = nullptr;    // -100: not counted; the last stage
  const std::int32_t* positions = nullptr;  // RoPE positions (Qwen3Model's rule): every stage, or
                                            // null on all: plain causal
};

class Qwen3Stage {
 public:
  // Buffers for `slots` micro-batches of B x T tokens in flight (1F1B: P - s on stage s).
  // seq_parallel > 1: sequence parallelism over a tp group of that size (set_tensor_parallel):
  // the stage's activations in and out are this rank's rows() = B*T / seq_parallel.
  Qwen3Stage(const ModelConfig& cfg, int B, int T, bool recompute, const StageRange& stage,
             int slots, int seq_parallel = 1);

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return program_.layout(); }
  const ShardPlan& units() const { return program_.units(); }
  const StageRange& stage() const { return program_.stage(); }
  int slots() const { return program_.slots(); }
  double buffer_bytes() const { return arena_.bytes(); }  // its activations and scratch
  // Rows of the activations a stage sends and receives, x and d x [rows(), H]: B*T, or
  // B*T / seq_parallel.
  int rows() const { return program_.local_rows(); }
  // The units this stage asks `params` for, ascending.
  std::vector<int> stage_units() const { return program_.stage_units(); }

  // The forward of a micro-batch into free slot `slot`. x_in: x[first] [B*T, H] (not the first
  // stage; may be input(slot)). loss_scale: the head's gradient scale (last stage). Returns the
  // summed cross-entropy of the counted targets on the last stage, else 0.
  double forward(ModelParams& params, int slot, const StageBatch& batch, const float* x_in,
                 float loss_scale);
  float* input(int slot) { return program_.stage_input(slot); }                    // [rows, H]
  const float* output(int slot) const { return program_.stage_output(slot); }     // [rows, H]

  // The backward of the micro-batch in `slot` (then free). dx_in: d x[last] [rows, H] (not the
  // last stage; may be input_grad()).
  void backward(ModelParams& params, int slot, const float* dx_in);
  // [rows, H] d x[first] of the last backward (what a non-first stage sends).
  const float* input_grad() { return program_.input_grad(); }

  // The backward in two halves (zero-bubble schedules; not with recompute): the input gradient
  // now (input_grad() after it, as backward's), the projections' weight gradients later, from
  // copies of their output gradients and the slot's activations; the slot is free after both.
  // Norm, embedding and lm head gradients come with the first half. A layer unit's grads_done
  // (where a sharded store reduces it, ZeRO-2/3) waits for the last weight half owed to it:
  // the input halves of later micro-batches add to the same gradients meanwhile.
  void backward_input(ModelParams& params, int slot, const float* dx_in);
  void backward_weight(ModelParams& params, int slot);

  // LoRA adapters beside the stage's projections (the base is then frozen: `params` give no
  // gradients), covering at least its layers with a slot of drop(x) A^T per activation slot;
  // each entry point selects the slot's. Their dropout key is the caller's to set per
  // micro-batch (LoraAdapters::set_dropout_key), before its forward and again before its backward.
  void set_lora(LoraAdapters* lora);
  // Tensor parallelism over `tp` (with sequence parallelism: seq_parallel = tp->size()).
  void set_tensor_parallel(Comm* tp) {
    ops_.set_tp(tp);
    vocab_global_ = cfg_.vocab_size * (tp ? tp->size() : 1);
  }
  // Context parallelism (Qwen3Model::set_context_parallel): the stage's B x T rows are this cp
  // rank's tokens of each sequence, and every forward's positions (then required) their global
  // RoPE positions, checked by the caller on the whole sequences.
  void set_context_parallel(Comm* cp, const ContextSplit* split) {
    ops_.set_context_parallel(cp, split);
    context_parallel_ = cp != nullptr && cp->size() > 1;
  }

  // Qwen3-MoE. The load-balancing loss pools its statistics over every sparse layer of a
  // micro-batch before the product (qwen3-spec.md 3.3), so a stage's backward needs those of
  // the layers on later stages too. They travel with the activations: moe_stats(slot) is the
  // running sum of the chunks before this one (zero on the first chunk, which sets it; a later
  // chunk's receive writes it before forward, as input(slot)); forward adds this chunk's sparse
  // layers, so afterwards it is what the next chunk receives, and on the last chunk the whole
  // micro-batch's. Before the backward a non-last chunk receives the whole micro-batch's
  // statistics into it again (sent back beside d x); the backward (or its input half, which
  // holds the whole MoE backward: the block's weight gradients are not deferred) weighs the
  // aux loss's gradient with them. A slot keeps its own from forward to backward, so every
  // schedule (1F1B, interleaved, ZB-H1, recompute, which never counts twice) sees its
  // micro-batch's.
  cpu::RouterBalance& moe_stats(int slot) { return slot_.at(slot).moe; }
  // Load-balancing loss weight and expert parallelism: CpuOps' set_moe_aux_scale and
  // set_expert_parallel (each slot its own exchanges: several micro-batches are between their
  // forward and backward). moe_load, moe_dropped: this stage's sparse layers' counts (zero rows
  // elsewhere).
  void set_moe_aux_scale(float aux_scale) { ops_.set_moe_aux_scale(aux_scale); }
  // The whole model's [sparse layers, E] bias (CpuOps::set_router_bias): the stage's layers
  // read their rows by global sparse-layer index.
  void set_router_bias(const float* bias) { ops_.set_router_bias(bias); }
  void set_expert_parallel(Comm* ep) { ops_.set_expert_parallel(ep, slots()); }
  const std::vector<double>& moe_load() const { return ops_.moe_load(); }
  const std::vector<double>& moe_dropped() const { return ops_.moe_dropped(); }
  void clear_moe_load() { ops_.clear_moe_load(); }

 private:
  struct Slot {
    bool busy = false;  // between forward and backward (its weight half, when split)
    bool weights_owed = false;  // backward_input done, backward_weight not yet
    std::vector<CpuOps::DeferredGrad> deferred;
    std::vector<int> owed_units;  // layer units whose grads_done waits for this weight half
    bool has_pos = false;
    std::vector<std::int32_t> inputs, pos;  // [B, T] copies for the backward
    cpu::RouterBalance moe{0};  // moe_stats()
  };

  ModelConfig cfg_;
  int B_, T_;
  bool recompute_;
  HostArena arena_;  // every buffer below
  CpuOps ops_;
  Qwen3Program<CpuOps> program_;
  std::vector<Slot> slot_;
  std::vector<int> owed_;  // [units] weight halves each unit's grads_done still waits for
  int vocab_global_ = cfg_.vocab_size;
  bool context_parallel_ = false;  // set_context_parallel over more than one rank
  LoraAdapters* lora_ = nullptr;
};

}  // namespace qt
