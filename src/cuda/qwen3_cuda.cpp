// Qwen3 forward and backward on the GPU: the layer program over CudaOps, the weights and
// gradients unit by unit from a UnitSource (a flat buffer, or the sharded state).
#include "cuda/qwen3_cuda.h"

#include "cuda/check.h"
#include "qtrain/error.h"

namespace qt::cuda {

namespace {

// The whole flat layout as units: pointers into W and G; a unit's gradients done is the
// watermark `ready` at the unit's first offset (units lie in flat order).
class FlatUnits final : public UnitSource {
 public:
  FlatUnits(const ShardPlan& plan, const bf16* W, float* G, const Qwen3Cuda::GradsReady& ready)
      : plan_(plan), W_(W), G_(G), ready_(ready) {}
  const bf16* weights(int u, cudaStream_t) override { return W_ + plan_.units[u].range.begin; }
  float* grads(int u, cudaStream_t) override {
    return G_ ? G_ + plan_.units[u].range.begin : nullptr;
  }
  void grads_done(int u, cudaStream_t) override {
    if (ready_) ready_(plan_.units[u].range.begin);
  }

 private:
  const ShardPlan& plan_;
  const bf16* W_;
  float* G_;
  const Qwen3Cuda::GradsReady& ready_;
};

// The flat watermark of forward_backward relies on the order embedding, layers, norm, lm head.
const ModelConfig& checked(const ModelConfig& cfg) {
  const ModelOffsets off = ParamLayout(cfg).model_offsets();
  // The last layer's last tensor in its unit (an ep rank's experts sit after the head).
  const LayerOffsets* back = cfg.num_layers == 0 ? nullptr : &off.layers.back();
  const std::size_t last = back == nullptr ? 0
                           : !back->moe                ? back->w_down
                           : cfg.expert_shards > 1     ? back->router
                                                       : back->experts_down;
  QT_CHECK(off.embed == 0 && off.norm > last &&
               (cfg.tie_word_embeddings || off.lm_head > off.norm),
           "unexpected parameter layout order");
  return cfg;
}

}  // namespace

Qwen3Cuda::Qwen3Cuda(const ModelConfig& cfg, int B, int T, DeviceArena& arena, bool recompute,
                     NcclComm* tp, int seq_parallel, bool tp_overlap, NcclComm* ep)
    : ops_(checked(cfg), B, T, arena, tp, seq_parallel, tp_overlap, recompute, ep),
      program_(cfg, B, T, recompute,
               allocate_acts<bf16>(cfg, B, T, recompute, arena, seq_parallel)) {}

double Qwen3Cuda::forward_backward(const bf16* W, float* G, const std::int32_t* inputs,
                                   const std::int32_t* targets, float loss_scale,
                                   cudaStream_t s, const GradsReady& ready,
                                   const std::int32_t* positions, GradWrite grad_write) {
  FlatUnits units(program_.units(), W, G, ready);
  return forward_backward(units, inputs, targets, loss_scale, s, positions, grad_write);
}

double Qwen3Cuda::forward_backward(UnitSource& source, const std::int32_t* inputs,
                                   const std::int32_t* targets, float loss_scale,
                                   cudaStream_t s, const std::int32_t* positions,
                                   GradWrite grad_write) {
  const bool accumulate = grad_write == GradWrite::kAccumulate;
  StreamUnits units{source, s};
  ops_.begin(s, positions);
  program_.forward(ops_, units, inputs);
  program_.head_forward_backward(ops_, units, targets, loss_scale, accumulate);
  program_.backward(ops_, units, inputs, accumulate);
  return ops_.take_loss();
}

}  // namespace qt::cuda
