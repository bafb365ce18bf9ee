// What the model asks of whoever holds its parameters. The model runs unit by unit (the units of
// the sharding plan, include/qtrain/shard_plan.h: the embedding, each layer, the head) and says
// when it needs a unit and when it is done with it; a sharded store gathers and frees there, and
// reduces a unit's gradients as soon as its backward is complete.
//
// Call order within one micro-batch, for every unit u the model touches:
//   acquire(u) ... params(u) ... release(u)    (possibly several times: forward and backward
//                                               each acquire the weights they read)
//   grads(u) ... grads_done(u)                 once in the backward, whether or not u's weights
//                                              are acquired (the embedding's backward needs none)
#pragma once

#include <cstdint>


#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

class ModelParams {
 public:
  virtual ~ModelParams() = default;
  // The unit's tensors [unit range size], each at its flat offset minus the unit's begin. Valid
  // between acquire(u) and release(u).
  virtual const float* params(int unit) = 0;
  // Gradient buffer of the unit (same layout; the model adds into it), or null: frozen (LoRA).
  virtual float* grads(int unit) = 0;
  virtual void acquire(int /*unit*/) {}
  virtual void release(int /*unit*/) {}
  virtual void grads_done(int /*unit*/) {}
};

// A whole flat buffer of the layout (and its gradients, or null): every unit always present.
class FlatParams final : public ModelParams {
 public:
  FlatParams(const ShardPlan& plan, const float* params, float* grads)
      : plan_(plan), params_(params), grads_(grads) {}
  const float* params(int u) override { return params_ + plan_.units[u].range.begin; }
  float* grads(int u) override { return grads_ ? grads_ + plan_.units[u].range.begin : nullptr; }

 private:
  const ShardPlan& plan_;
  const float* params_;
  float* grads_;
};

// The layer program's view of a ModelParams (model/layer_program.h's Units): asking for a
// unit's weights acquires it. For Qwen3Model and Qwen3Stage.
struct CpuUnits {
  ModelParams& mp;
  const float* weights(int u) {
    mp.acquire(u);
    return mp.params(u);
  }
  float* grads(int u) { return mp.grads(u); }
  void release(int u) { mp.release(u); }
  void grads_done(int u) { mp.grads_done(u); }
  bool take_embedding_rows(const float*, const std::int32_t*, int) { return false; }
};

}  // namespace qt
