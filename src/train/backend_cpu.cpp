// The CPU reference back end: Qwen3Model (fp32, BLAS) over the optimizer driver ShardedState
// (ZeRO 0-3 over MPI; optim/sharded_state.h). With [lora] the fp32 base is a frozen flat buffer
// (no gradients, no moments) and the driver trains the adapters over plan_adapters' units (a
// Qwen3-MoE model's router and experts frozen too: their block's backward gives the input
// gradient only; its expert adapters at ep > 1 sharded like the experts). With
// mesh.tp > 1 the model and the driver hold the tp rank's local part (parallel/tensor_parallel.h)
// and every piece of state leaves and enters in global coordinates (TpMap);
// mesh.sequence_parallel splits the model's residual stream over tp too (model/layer_program.h).
// With mesh.ep > 1 they hold the ep rank's experts only (parallel/expert_parallel.h:
// ep_local_config, EpMap), each sparse layer's a unit sharded and reduced over the
// expert-data-parallel group; with both, each of those experts' tp columns (TpEpMap).
// With mesh.cp > 1 (dense model, alone or with dp, tp and [lora]; with pp:
// backend_cpu_pipeline.cpp) each micro-batch's sequences are split over the cp ranks
// (parallel/context_parallel.h): the model holds this rank's tokens of each sequence and runs
// ring attention over Mesh::cp() (under tp over its local heads; LoRA's dropout masks keyed by
// the tokens' global indices); the state is planned and reduced over dp x cp (plan_shape,
// Mesh::dp_cp()); the losses it returns are summed over cp, so the trainer sees the whole
// sequences' sums as at cp = 1.
#include <fmt/format.h>

#include <memory>
#include <vector>

#include "model/lora.h"
#include "model/qwen3.h"
#include "optim/sharded_state.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/error.h"
#include "train/backend.h"

namespace qt {

namespace {

class CpuBackend final : public TrainBackend {
 public:
  CpuBackend(const Deck& deck, Mesh& mesh)
      : tp_(mesh.shape().tp),
        seq_parallel_(mesh.shape().seq_parallel()),
        global_layout_(deck.model),
        split_(deck.train.seq_len, mesh.shape().cp),
        cp_(mesh.shape().cp > 1 ? &mesh.cp() : nullptr),
        local_len_(split_.local_len(mesh.coord().cp)),
        vocab_size_(deck.model.vocab_size),
        model_(ep_local_config(tp_local_config(deck.model, tp_), mesh.shape().ep),
               deck.train.micro_batch, local_len_, deck.train.recompute, seq_parallel_),
        lora_(deck.lora.enabled() ? std::make_unique<LoraAdapters>(model_.config(), deck.lora,
                                                                   deck.train.micro_batch,
                                                                   local_len_)
                                  : nullptr),
        global_lora_layout_(lora_ ? lora_layout(deck.model, deck.lora)
                                  : ParamLayout(std::vector<std::pair<std::string,
                                                                      std::vector<std::int64_t>>>{})),
        state_(lora_ ? plan_adapters(lora_->layout(), plan_shape(mesh.shape()),
                                     deck.optim.zero_stage, tp_kv_replicas(deck.model, tp_))
                     : plan_qwen3(model_.config(), model_.layout(), plan_shape(mesh.shape()),
                                  deck.optim.zero_stage, tp_kv_replicas(deck.model, tp_)),
               lora_ ? lora_->layout() : model_.layout(), deck.optim,
               cp_ ? mesh.dp_cp() : mesh.dp(), deck.train.steps, &mesh.tp(), nullptr,
               &mesh.edp()),
        base_(lora_ ? model_.layout().numel() : 0, 0.0f),
        offload_(deck.optim.offload == "cpu"),
        activations_(Qwen3Model::buffer_bytes(model_.config(), deck.train.micro_batch,
                                              local_len_, deck.train.recompute, seq_parallel_)),
        seed_(deck.train.seed) {
    // The deck rejects the rest (config/deck.cpp); these are the engine's own guards.
    QT_CHECK(!cp_ || !deck.model.is_moe(), "mesh.cp > 1 with a Qwen3-MoE model");
    if (cp_) {
      model_.set_context_parallel(cp_, &split_);
      if (lora_) lora_->set_context_parallel(split_.seq_len(), split_.indices(mesh.cp().rank()));
      const std::size_t local = static_cast<std::size_t>(deck.train.micro_batch) * local_len_;
      for (auto* b : {&cp_inputs_, &cp_targets_, &cp_positions_}) b->resize(local);
    }
    if (lora_) model_.set_lora(lora_.get());
    if (deck.model.is_moe() && mesh.shape().ep > 1) model_.set_expert_parallel(&mesh.ep());
    // Each micro-batch's load-balancing loss weighs coef / (the step's micro-batches, all dp
    // ranks): the objective averages it over the step as the cross-entropy over its tokens.
    if (deck.model.is_moe()) {
      aux_weight_ = deck.model.router_aux_loss_coef * deck.train.micro_batch / deck.train.global_batch;
      model_.set_moe_aux_scale(static_cast<float>(aux_weight_));
    }
    if (tp_ > 1) model_.set_tensor_parallel(&mesh.tp());
    if (!lora_) {
      model_map_ = make_model_map(deck.model, global_layout_, model_.layout(), state_.plan(),
                                  mesh.shape(), mesh.tp().rank(), mesh.ep().rank());
    } else {
      // The adapters split as their base by tp and, on the experts, by ep (plan_adapters;
      // lora_map); the dense ones replicated over ep like every dense weight.
      if (tp_ > 1) lora_->set_tensor_parallel(tp_, mesh.tp().rank());
      lora_map_ = lora_map(deck.model, deck.lora, {{0, deck.model.num_layers}},
                           global_lora_layout_, lora_->layout(), state_.plan(), mesh.shape(),
                           mesh.tp().rank(), mesh.ep().rank());
      if (tp_ > 1 || model_.config().expert_shards > 1) {
        // The frozen base through its own plan's split (tp, and with mesh.ep > 1 the ep
        // rank's experts).
        base_plan_ = std::make_unique<ShardPlan>(
            plan_qwen3(model_.config(), model_.layout(), plan_shape(mesh.shape()), 0,
                       tp_kv_replicas(deck.model, tp_)));
        model_map_ = make_model_map(deck.model, global_layout_, model_.layout(), *base_plan_,
                                    mesh.shape(), mesh.tp().rank(), mesh.ep().rank());
      }
    }
  }

  // The global layout (checkpoints, initialisation and imports see global tensors).
  const ParamLayout& layout() const override { return global_layout_; }
  std::string describe() const override {
    std::string d = "cpu: fp32 reference (OpenBLAS); " + state_.plan().describe();
    if (tp_ > 1) d += "; " + describe_tp(model_.config(), tp_, seq_parallel_ > 1);
    if (cp_)
      d += fmt::format("; cp {}: each sequence of {} tokens split in {} chunks, {} tokens on this "
                       "rank, ring attention; the state over dp x cp = {} ranks",
                       cp_->size(), split_.seq_len(), 2 * cp_->size(), local_len_,
                       state_.plan().dp);
    if (offload_) d += "; optim.offload = cpu: the state is in host memory already";
    if (lora_)
      d += fmt::format("; LoRA: fp32 base frozen (no gradients or moments), {} adapter "
                       "parameters trained",
                       lora_->layout().numel());
    return d;
  }
  const ParamLayout& trained_layout() const override {
    return lora_ ? global_lora_layout_ : global_layout_;
  }
  std::vector<FlatPiece> model_pieces() override {
    if (lora_)
      return global_pieces(model_map_.get(),
                           std::vector<FlatPiece>{{Range{0, base_.size()}, base_.data()}},
                           /*writing=*/false);
    return trained_pieces();
  }
  // The trained state's pieces: the model's through model_map_, or the adapters' through
  // lora_map_.
  std::vector<FlatPiece> trained_pieces() override {
    return global_pieces(trained_map(), state_.param_pieces(), /*writing=*/false);
  }
  std::vector<StatePiece> checkpoint_pieces() override {
    return global_pieces(trained_map(), state_.checkpoint_pieces(), /*writing=*/true);
  }
  StateTargets checkpoint_targets() override {
    return global_targets(trained_map(), state_.checkpoint_targets());
  }
  void set_first_sample(std::int64_t first) override { first_sample_ = first; }
  void push_state() override {}  // the host buffers are the live state
  void pull_state() override {}
  void zero_grads() override {
    state_.zero_grads();
    aux_sum_ = 0;
    model_.clear_moe_load();
  }
  std::vector<double> moe_load() const override { return model_.moe_load(); }
  std::vector<double> moe_dropped() const override { return model_.moe_dropped(); }
  void set_router_bias(const std::vector<float>& bias) override {
    router_bias_ = bias;
    model_.set_router_bias(router_bias_.empty() ? nullptr : router_bias_.data());
  }
  void set_loss_scaling(double S) override {
    if (model_.config().is_moe()) model_.set_moe_aux_scale(static_cast<float>(aux_weight_ * S));
  }
  double moe_aux_loss_sum() const override { return model_.config().is_moe() ? aux_sum_ : -1; }
  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    const std::int32_t* positions, float loss_scale) override {
    if (cp_) {  // this cp rank's tokens; the loss summed over cp: the whole sequences' sum
      inputs = local(inputs, targets, positions);
      targets = cp_targets_.data();
      positions = cp_positions_.data();
    }
    double loss = 0;
    if (lora_) {  // the units whole at ZeRO 0 and 1: bound for the whole micro-batch
      lora_->bind(adapter_buffers(/*grads=*/true));
      lora_->set_dropout_key(seed_, first_sample_);
      loss = model_.forward(base_.data(), inputs, targets, positions);
      aux_sum_ += model_.moe_aux_loss();
      model_.backward(base_.data(), nullptr, loss_scale);
    } else {
      loss = model_.forward(state_, inputs, targets, positions);
      aux_sum_ += model_.moe_aux_loss();
      model_.backward(state_, loss_scale);
    }
    return cp_ ? cp_->sum(loss) : loss;
  }
  // A forward alone, dropout off: no gradient is touched.
  double eval_loss(const MicroBatches& mb) override {
    double loss = 0;
    const std::size_t per = static_cast<std::size_t>(mb.B) * mb.T;
    if (lora_) {
      lora_->bind(adapter_buffers(/*grads=*/false));
      lora_->set_dropout_enabled(false);
    }
    FlatParams base(model_.units(), base_.data(), nullptr);
    ModelParams& mp = lora_ ? static_cast<ModelParams&>(base) : state_;
    for (int m = 0; m < mb.count; ++m) {
      const std::size_t off = per * m;
      const std::int32_t* pos = mb.positions ? mb.positions + off : nullptr;
      loss += cp_ ? model_.forward_only(mp, local(mb.inputs + off, mb.targets + off, pos),
                                        cp_targets_.data(), cp_positions_.data())
                  : model_.forward_only(mp, mb.inputs + off, mb.targets + off, pos);
    }
    if (lora_) lora_->set_dropout_enabled(true);
    return cp_ ? cp_->sum(loss) : loss;
  }
  OptimStepStats optimizer_step(const StepRequest& request) override {
    return state_.step(request);
  }
  MemorySplit memory_split() override {
    const StateBytes b = state_.peak_bytes();
    MemorySplit m;
    m.params = b.params + 4.0 * static_cast<double>(base_.size());
    m.grads = b.grads;
    m.optimizer = b.optimizer;
    m.activations = activations_;
    return m;
  }

 private:
  // [lora]: the adapters' units in the state (whole at ZeRO 0 and 1), with their gradients or
  // without.
  AdapterBuffers<float> adapter_buffers(bool grads) {
    return AdapterBuffers<float>::of_units(
        state_.plan().units, [&](int u) { return state_.params(u); },
        [&](int u) { return grads ? state_.grads(u) : nullptr; });
  }
  // Context parallelism: this cp rank's tokens of a micro-batch [B, T] (checked whole first,
  // as the model checks a whole micro-batch) into cp_inputs_, cp_targets_ and cp_positions_
  // (the global RoPE positions) [B, local_len_]; returns cp_inputs_.
  const std::int32_t* local(const std::int32_t* inputs, const std::int32_t* targets,
                            const std::int32_t* positions) {
    const int B = model_.batch(), r = cp_->rank();
    check_micro_batch(inputs, targets, positions, B, split_.seq_len(), vocab_size_);
    split_.take(cp_inputs_.data(), inputs, B, r);
    split_.take(cp_targets_.data(), targets, B, r);
    split_.take_positions(cp_positions_.data(), positions, B, r);
    return cp_inputs_.data();
  }
  const LayoutMap* trained_map() const {
    return lora_ ? static_cast<const LayoutMap*>(lora_map_.get()) : model_map_.get();
  }

  int tp_;                              // mesh.tp
  double aux_sum_ = 0;                  // moe_aux_loss_sum()
  double aux_weight_ = 0;               // a micro-batch's load-balancing loss in the objective
  std::vector<float> router_bias_;      // set_router_bias: [sparse layers, E], or empty
  int seq_parallel_;                    // mesh.tp with sequence parallelism, else 1
  ParamLayout global_layout_;           // the model's (the local one is model_.layout())
  ContextSplit split_;                  // mesh.cp's split of train.seq_len (one chunk pair at 1)
  Comm* cp_;                            // Mesh::cp() with mesh.cp > 1, else null
  int local_len_;                       // tokens of a sequence on this rank (seq_len at cp 1)
  int vocab_size_;                      // the global model's (tp: the local one x tp)
  std::vector<std::int32_t> cp_inputs_, cp_targets_, cp_positions_;  // cp > 1: [B, local_len_]
  Qwen3Model model_;                    // with tp > 1 the tp rank's local part
  std::unique_ptr<LoraAdapters> lora_;  // null without [lora]
  ParamLayout global_lora_layout_;      // with [lora]: the adapters' of the global model
  std::unique_ptr<LayoutMap> model_map_;  // the model's local -> global pieces: TpMap with
                                          // tp > 1, EpMap with ep > 1, TpEpMap with both, else
                                          // null (make_model_map)
  std::unique_ptr<ShardPlan> base_plan_;  // [lora] with tp or ep > 1: the frozen base's split
  std::unique_ptr<LayoutMap> lora_map_;   // [lora]: the adapters' local -> global (lora_map)
  ShardedState state_;                  // the trained parameters: the model, or the adapters
  std::vector<float> base_;             // with [lora]: the frozen model [numel], else empty
  bool offload_;
  double activations_;  // bytes of the model's buffers
  std::uint64_t seed_;
  std::int64_t first_sample_ = 0;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_backend(const Deck& deck, Mesh& mesh) {
  if (mesh.shape().pp > 1) return make_cpu_pipeline_backend(deck, mesh);
  return std::make_unique<CpuBackend>(deck, mesh);
}

#ifndef QTRAIN_HAVE_CUDA
std::unique_ptr<TrainBackend> make_cuda_backend(const Deck&, Mesh&) {
  fail_user("train.device = cuda, but this qtrain was built without the CUDA back end; build it "
            "with `cmake --preset cuda` (needs CUDA 13 and NCCL)");
}
#endif

}  // namespace qt
