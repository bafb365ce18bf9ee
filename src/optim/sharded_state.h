// The optimizer driver: one trained layout's parameters, gradients and AdamW state over the units
// of a ShardPlan (include/qtrain/shard_plan.h), at ZeRO stage 0 to 3, in host memory, reduced
// over the dp communicator. The model reaches it through ModelParams (model/model_params.h).
//
//           parameters (fp32)         gradients                        AdamW m, v
//   ZeRO-0  every unit, whole         whole; all-reduced at the step    whole
//   ZeRO-1  every unit, whole         whole; reduce-scattered at the    own shard
//                                     step
//   ZeRO-2  every unit, whole         own shard: each micro-batch's     own shard
//                                     unit gradient is reduce-scattered
//                                     as soon as its backward is done
//   ZeRO-3  own shard; acquire()      as ZeRO-2                         own shard
//           gathers the unit,
//           release() frees it
//
// The step: gradient norm over every element once (each owner sums its own shard), clipping,
// then each owner updates its shard with adamw_update (optim/adamw_math.h), the same element
// math at every stage; ZeRO-1 and 2 all-gather each updated unit, ZeRO-0 updates everything on
// every rank. Buffers of whole units are padded to dp shards (unit.padded()); padding stays zero.
// An expert unit (ParamUnit::group kEdp, expert parallelism) does all of this over the
// expert-data-parallel communicator instead of dp: its ranks hold the same experts, and the
// other ep ranks of the dp group hold other experts, so summing the norm over dp still counts
// every element once.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_params.h"
#include "optim/optimizer.h"
#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/shard_plan.h"

namespace qt {

struct AdamWStep;  // optim/adamw_math.h

// A pipeline stage's share of the units (mesh.pp > 1): the stage holds only `held` (the others
// get no buffers and are never asked for); `pp` sums the gradient norm over the stages. `copy`:
// a held unit that is a copy of another stage's (a tied embedding on the last stage, whose first
// stage holds the original): the caller sums the two copies' gradients before step()
// (tied_grads()); it counts in the norm and is written to checkpoints by the original only.
struct PipelineShare {
  std::vector<int> held;
  Comm* pp = nullptr;
  int copy = -1;
};

// Bytes a ShardedState holds, by kind.
struct StateBytes {
  double params = 0, grads = 0, optimizer = 0;
};

class ShardedState final : public ModelParams {
 public:
  // plan.dp must be dp.size(); edp: the expert-data-parallel communicator, needed when the plan
  // has expert units (its size their dp). The parameters start at zero: fill param_pieces()
  // before use.
  // Under tensor parallelism (plan.tp > 1) `layout` is the tp rank's local one and `tp` its tp
  // communicator: gradients that are partial over tp (ShardSpec::partial_over) are summed over
  // it before the update, and the gradient norm counts tensors replicated over tp once.
  ShardedState(const ShardPlan& plan, const ParamLayout& layout, const OptimConfig& cfg, Comm& dp,
               int total_steps, Comm* tp = nullptr, const PipelineShare* pipe = nullptr,
               Comm* edp = nullptr);

  // ModelParams.
  const float* params(int unit) override;
  float* grads(int unit) override;
  void acquire(int unit) override;
  void release(int unit) override;
  void grads_done(int unit) override;

  // Gradients to zero before the first micro-batch of a step.
  void zero_grads();
  // Reduces, clips and applies this step's gradients (already scaled so that their sum over dp
  // is the mean gradient), or with a non-finite loss or gradient norm reduces them and applies
  // nothing (OptimStepStats::skipped).
  OptimStepStats step(const StepRequest& request);
  OptimStepStats step(std::int64_t step) { return this->step(StepRequest::at(step)); }

  // The parameters this rank holds (whole units, or its shards at ZeRO-3): fill them to
  // initialise or load a model.
  std::vector<FlatPiece> param_pieces();
  // The pieces this rank writes to a checkpoint (its own shard of every unit) and the pieces a
  // checkpoint read fills (everything it holds).
  std::vector<StatePiece> checkpoint_pieces();
  StateTargets checkpoint_targets();

  // The gradients of unit u that a tied copy sums with its original before step() (the same on
  // both stages: the unit's whole gradients at ZeRO 0/1, its reduced shard at ZeRO 2/3).
  std::vector<float>& tied_grads(int u) {
    return zero_ <= 1 ? units_[u].grads : units_[u].grad_shard;
  }

  const ShardPlan& plan() const { return plan_; }
  StateBytes bytes() const;  // held now
  StateBytes peak_bytes() const { return peak_; }

 private:
  struct Unit {
    std::vector<float> params;      // ZeRO 0-2: whole unit [padded]; ZeRO-3: own shard [chunk]
    std::vector<float> gathered;    // ZeRO-3: the whole unit [padded] while acquired
    std::vector<float> grads;       // ZeRO 0/1: [padded]; ZeRO 2/3: [padded] during its backward
    std::vector<float> grad_shard;  // ZeRO >= 1: reduced gradients of the own shard [chunk]
    std::vector<float> m, v;        // ZeRO-0: [unit size]; else [own shard size]
  };
  // Flat range this rank updates in unit u, and where its parameters, gradients and moments sit.
  Range updated(int u) const;
  float* updated_params(int u);
  const float* updated_grads(int u);
  void update(int u, const AdamWStep& s);
  // Sums over tp the gradients in `grads` (unit u's whole buffer) of its tensors that are
  // partial over tp. No-op without tensor parallelism.
  void reduce_partial_over_tp(int u, float* grads);
  // Sum of squares of the gradients g of the flat range `own` of unit u, each element counted
  // once over the mesh (tensors replicated over tp only by tp rank 0).
  double sum_squares(int u, Range own, const float* g) const;
  void note_peak();
  bool held(std::size_t u) const { return held_[u] != 0; }
  // The communicator unit u is sharded and reduced over (dp or edp), and this rank's place in it.
  Comm& group(std::size_t u) const { return plan_.units[u].group == MeshDim::kEdp ? *edp_ : dp_; }
  int rank(std::size_t u) const { return group(u).rank(); }

  ShardPlan plan_;
  const ParamLayout& layout_;
  OptimConfig cfg_;
  Comm& dp_;
  Comm* tp_;  // null without tensor parallelism
  Comm* pp_ = nullptr;     // null without pipeline parallelism
  Comm* edp_;              // null without expert units
  std::vector<char> held_;  // [units]: this stage holds it
  int copy_ = -1;           // PipelineShare::copy
  int total_steps_;
  int zero_;
  std::vector<Unit> units_;
  std::vector<float> reduced_;  // ZeRO 2/3: one unit's reduce-scatter result [largest chunk]
  StateBytes peak_;
};

}  // namespace qt
