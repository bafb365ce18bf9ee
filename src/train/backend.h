// What the training loop needs from a back end (CPU reference or CUDA): the model's parameters and
// optimizer state, one micro-batch of forward and backward, the optimizer step with its dp
// reduction, and host copies of the state for initialisation and checkpoints.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "qtrain/checkpoint.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"
#include "qtrain/params.h"
#include "runtime/memory.h"

namespace qt {

// The micro-batches of one step as the trainer hands them over: `count` of them, each [B, T] at
// consecutive offsets of the host arrays.
struct MicroBatches {
  const std::int32_t* inputs = nullptr;
  const std::int32_t* targets = nullptr;
  const std::int32_t* positions = nullptr;  // null: plain causal
  int count = 0, B = 0, T = 0;
  std::int64_t first_sample = 0;  // the data-order index of the first sequence
};

class TrainBackend {
 public:
  virtual ~TrainBackend() = default;

  virtual const ParamLayout& layout() const = 0;
  // One line for the start-up banner, e.g. "cpu: fp32, OpenBLAS".
  virtual std::string describe() const = 0;

  // Host copies of the state, in flat pieces of the layouts (include/qtrain/params.h): whole
  // buffers, or a sharded state's parts. Fill the model's and the trained pieces, then
  // push_state(); pull_state() before reading them.
  //   model_pieces(): the model's parameters this rank holds, to initialise or load;
  //   trained_pieces(): with [lora] the adapters' (else the model's);
  //   checkpoint_pieces(): the trained state this rank writes to a checkpoint (over all ranks
  //     each element once); checkpoint_targets(): what a checkpoint read fills on this rank.
  virtual std::vector<FlatPiece> model_pieces() = 0;
  virtual std::vector<FlatPiece> trained_pieces() { return model_pieces(); }
  virtual std::vector<StatePiece> checkpoint_pieces() = 0;
  virtual StateTargets checkpoint_targets() = 0;
  virtual void push_state() = 0;  // host -> back end (after initialisation or a checkpoint read)
  virtual void pull_state() = 0;  // back end -> host (before a checkpoint write)
  // What trains, and what checkpoints hold: the whole model (layout()), or with [lora] only the
  // adapters, in their own layout (the base is then frozen: no gradients, no moments).
  virtual const ParamLayout& trained_layout() const { return layout(); }
  // The index in the data order of the first sequence of the next micro_step (keys LoRA's
  // dropout masks, so that they do not depend on the mesh).
  virtual void set_first_sample(std::int64_t /*first*/) {}

  // train.precision = fp16: every gradient of the following micro-batches carries the loss scale
  // S. micro_step's loss_scale brings it to the cross-entropy's; this brings it to the rest (a
  // Qwen3-MoE model's load-balancing loss). Back ends without fp16 refuse S != 1.
  virtual void set_loss_scaling(double S) {
    QT_CHECK(S == 1, "this back end has no loss scaling (train.precision = fp16)");
  }
  // Gradients to zero before the first micro-batch of a step.
  virtual void zero_grads() = 0;
  // Forward and backward of one micro-batch: inputs, targets [micro_batch, seq_len] on the host;
  // positions [micro_batch, seq_len] on the host, the RoPE position of each input (a document
  // starts where it is 0; attention stays inside documents), or null: positions 0..seq_len-1.
  // Gradients += loss_scale * d(sum of losses)/d(params). Returns the sum of the losses (nats).
  virtual double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                            const std::int32_t* positions, float loss_scale) = 0;
  // Every micro-batch of a step, forward and backward, gradients accumulated; returns the sum of
  // their losses (on every stage of a pipeline the same). By default micro_step after micro_step;
  // a pipeline runs its schedule over them.
  virtual double micro_batches(const MicroBatches& mb, float loss_scale) {
    double loss = 0;
    const std::size_t per = static_cast<std::size_t>(mb.B) * mb.T;
    for (int m = 0; m < mb.count; ++m) {
      const std::size_t off = per * m;
      set_first_sample(mb.first_sample + static_cast<std::int64_t>(m) * mb.B);
      loss += micro_step(mb.inputs + off, mb.targets + off,
                         mb.positions ? mb.positions + off : nullptr, loss_scale);
    }
    return loss;
  }
  // Evaluation (train/evaluation.h): the summed loss of every micro-batch of `mb` as
  // micro_batches returns it, from a forward with no update, LoRA dropout off where the back
  // end says so below. Parameters, optimizer state and router bias stay as they are; the
  // gradients and the MoE statistics (load, aux loss) are left undefined until the next
  // zero_grads, so the trainer evaluates after a step's bookkeeping. By default a forward and
  // backward with loss scale 0 between two zero_grads (any back end, any mesh; LoRA dropout
  // applies, so the deck refuses evaluation with lora.dropout > 0 where this default runs); the
  // CPU back ends override it (a true forward on one stage, dropout off in a pipeline), the
  // CUDA ones wait for the device after it (the reductions it started on other streams).
  virtual double eval_loss(const MicroBatches& mb) {
    zero_grads();
    const double loss = micro_batches(mb, 0.0f);
    zero_grads();
    return loss;
  }
  // Reduces the gradients over dp, clips, and updates the parameters; with a non-finite loss
  // (request.loss_finite false) or gradient norm it updates nothing (OptimStepStats::skipped).
  virtual OptimStepStats optimizer_step(const StepRequest& request) = 0;

  // The last step's measured pipeline bubble: the share of the step the stages' compute
  // waited, 1 - busy / (stages x span) as the schedule's simulation counts it (a fraction, the
  // same on every rank), or < 0 when not measured (only the CUDA pipeline measures it).
  virtual double pipeline_idle() const { return -1; }
  // Qwen3-MoE: the load-balancing losses of the micro-batches since zero_grads, summed (each k
  // when balanced); < 0 for a dense model.
  virtual double moe_aux_loss_sum() const { return -1; }
  // Qwen3-MoE: token-slots routed to each expert since zero_grads, [sparse layers][E] flat;
  // empty for a dense model.
  virtual std::vector<double> moe_load() const { return {}; }
  // Qwen3-MoE with model.moe_capacity_factor > 0: token-slots of this rank's tokens dropped by
  // the capacity in each sparse layer since zero_grads, [sparse layers]; empty for a dense model
  // (or a back end without a capacity).
  virtual std::vector<double> moe_dropped() const { return {}; }
  // Qwen3-MoE with auxiliary-loss-free balancing (model.router_bias_update_rate > 0): the routers'
  // bias [sparse layers, E] (fp32, the same on every rank) for the following forwards; the back
  // end keeps its own copy. Empty: none.
  virtual void set_router_bias(const std::vector<float>& bias) {
    QT_CHECK(bias.empty(), "this back end has no router bias");
  }
  // Extra fields for the step log (e.g. GPU memory), empty when none.
  virtual std::string memory_report() { return {}; }
  // This rank's peak memory by kind since the start (GPU memory on cuda, host on cpu).
  virtual MemorySplit memory_split() = 0;
};

std::unique_ptr<TrainBackend> make_cpu_backend(const Deck& deck, Mesh& mesh);
// mesh.pp > 1 on the CPU (src/train/backend_cpu_pipeline.cpp); make_cpu_backend picks it.
std::unique_ptr<TrainBackend> make_cpu_pipeline_backend(const Deck& deck, Mesh& mesh);
// Defined by the CUDA back end (src/cuda/); without it, throws UserError saying so. With [lora]
// it returns make_cuda_lora_backend's (src/cuda/backend_cuda_lora.cpp; CUDA builds only), or
// with mesh.pp > 1 the pipeline's (which trains each stage's adapters).
std::unique_ptr<TrainBackend> make_cuda_backend(const Deck& deck, Mesh& mesh);
std::unique_ptr<TrainBackend> make_cuda_lora_backend(const Deck& deck, Mesh& mesh);
// mesh.pp > 1 on CUDA (src/cuda/backend_cuda_pipeline.cpp); make_cuda_backend picks it.
std::unique_ptr<TrainBackend> make_cuda_pipeline_backend(const Deck& deck, Mesh& mesh);

inline std::unique_ptr<TrainBackend> make_backend(const Deck& deck, Mesh& mesh) {
  if (deck.train.device != "cuda") return make_cpu_backend(deck, mesh);
  return make_cuda_backend(deck, mesh);
}

}  // namespace qt
