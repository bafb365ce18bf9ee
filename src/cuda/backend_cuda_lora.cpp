// The CUDA back end for LoRA ([lora] r > 0): the base model frozen in bf16, only the adapters
// train. What lives on the GPU:
//   base     bf16 weights only (2 bytes a parameter): no gradients, no optimizer state, no fp32
//            master copy; filled from the host's fp32 parameters through a bounded staging buffer
//   adapters fp32 master, gradients and AdamW moments (master and moments sharded over dp with
//            ZeRO-1) and their bf16 compute copy, in the adapter layout (PEFT's names): the
//            optimizer driver of full training (cuda/sharded_state_cuda.h) over the units of
//            plan_adapters, as the CPU's (one unit holding every adapter, or with adapters on
//            the experts at ep > 1 the experts' over expert-dp)
//   Qwen3Cuda's activations (train.recompute as for full training) and LoraCuda's xa buffers
// The forward and backward are Qwen3Cuda's with G = null (no weight gradient of the base, no
// embedding backward). With dp > 1 the adapter gradients (small) are reduced over NCCL in the
// optimizer step: one all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1), fp32 or bf16 on the wire
// (optim.grad_reduce). Then clipping and the fused AdamW over the adapters, with the CPU LoRA
// back end's weight-decay rule (each tensor's ParamInfo::weight_decay).
//
// With mesh.tp > 1 (as the CPU back end, train/backend_cpu.cpp) the base is the tp rank's local
// model (tp_local_config: its bf16 weights [local numel]) and the adapters are the local model's,
// split as their base projection (cuda/lora_cuda.h, tp_role): the adapter plan is made for the
// local adapter layout over the whole mesh, so the state sums the factors whose gradients are
// partial over tp (A beside q/k/v and gate/up, B beside o and down) on the tp communicator after
// the dp reduction, and counts the replicated factors in the gradient norm on tp rank 0 only
// (summed over tp). Two TpMaps turn local pieces into global ones: the base's (for
// initialisation and model.init) and the adapters' (checkpoints hold global PEFT tensors, so any
// tp resumes any other). The model's tp hooks (cuda_ops.h) sum the row-parallel outputs and the
// column-parallel input gradients with the adapters' terms included; with LoRA the row-parallel
// GEMMs are not split into pieces (tp_block_output_ahead is ignored).
//
// Qwen3-MoE with mesh.ep > 1 (as the CPU back end): the base is the ep rank's local model too
// (ep_local_config: E / ep experts of each sparse layer, frozen), the token rows cross the ep
// group both ways in the forward and d out / d x in the backward (cuda_ops_moe_ep.cpp; no
// expert weight gradients); the dense adapters are replicated over ep and reduced over dp like
// every dense weight, those on every expert (lora.targets experts.*) sharded like the experts:
// the rank's E / ep experts' rows, reduced over expert-dp (plan_adapters; lora_map places them).
// The base's map (make_model_map) places the rank's experts.
#include <fmt/format.h>
#include <memory>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/lora_cuda.h"
#include "cuda/nccl_comm.h"
#include "cuda/qwen3_cuda.h"
#include "cuda/sharded_state_cuda.h"
#include "cuda/training_buffers.h"
#include "model/lora.h"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/gemm.cuh"
#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/error.h"
#include "qtrain/shard_plan.h"
#include "train/backend.h"

namespace qt {

namespace {

class CudaLoraBackend final : public cuda::CudaTrainBackend {
 public:
  CudaLoraBackend(const Deck& deck, Mesh& mesh)
      : device_(cuda::select_device(mesh.local_rank())),
        deck_(deck),
        tp_(mesh.shape().tp),
        ep_(deck.model.is_moe() ? mesh.shape().ep : 1),
        layout_(deck.model),
        local_cfg_(ep_local_config(tp_local_config(deck.model, tp_), ep_)),
        local_layout_(local_cfg_),
        global_lora_layout_(lora_layout(deck.model, deck.lora)),
        arena_(cuda::training_arena_bytes(), fmt::format("GPU {} arena", device_)),
        gemm_ws_(arena_.allocate(cuda::kGemmWorkspaceBytes)),
        base_(arena_.allocate<cuda::bf16>(local_layout_.numel())),
        lora_(std::make_unique<cuda::LoraCuda>(local_cfg_, deck.lora, deck.train.micro_batch,
                                               deck.train.seq_len, arena_)),
        plan_(plan_adapters(lora_->layout(), mesh.shape(), deck.optim.zero_stage,
                            tp_kv_replicas(deck.model, tp_))),
        nccl_dp_(mesh.dp().size() > 1 ? &cuda::nccl(mesh, MeshDim::kDp) : nullptr),
        nccl_tp_(tp_ > 1 ? &cuda::nccl(mesh, MeshDim::kTp) : nullptr),
        nccl_ep_(ep_ > 1 ? &cuda::nccl(mesh, MeshDim::kEp) : nullptr),
        nccl_edp_(ep_ > 1 ? &cuda::nccl(mesh, MeshDim::kEdp) : nullptr),
        state_(plan_, lora_->layout(), deck.optim, mesh.dp(), nccl_dp_, arena_, 1, {},
               {tp_ > 1 ? &mesh.tp() : nullptr, nccl_tp_}, {}, nccl_edp_),
        batch_(deck.train.micro_batch, deck.train.seq_len, arena_) {
    const int B = deck.train.micro_batch, T = deck.train.seq_len;
    cuda::gemm_init(gemm_ws_, cuda::kGemmWorkspaceBytes);
    const std::size_t before_model = arena_.used();
    model_ = std::make_unique<cuda::Qwen3Cuda>(local_cfg_, B, T, arena_, deck.train.recompute,
                                               nccl_tp_, mesh.shape().seq_parallel(),
                                               mesh.shape().tp_overlap, nccl_ep_);
    activations_ = static_cast<double>(arena_.used() - before_model) + batch_.bytes();
    model_->set_lora(lora_.get());
    // Qwen3-MoE: the routers and experts are frozen base weights like any other, their block's
    // backward the input gradient only (cuda_ops_moe.cpp; with mesh.ep > 1 the rank's E / ep
    // experts, the rows still exchanged both ways: cuda_ops_moe_ep.cpp); the load-balancing loss
    // weighs as in full training (backend_cuda.cpp), its gradient reaching x through the frozen
    // routers' logits.
    if (deck.model.is_moe())
      model_->set_moe_aux_scale(static_cast<float>(
          deck.model.router_aux_loss_coef * deck.train.micro_batch / deck.train.global_batch));
    lora_->bind(AdapterBuffers<cuda::bf16>::of_units(  // the units, whole at ZeRO-0 and 1
        plan_.units, [&](int u) { return state_.unit_weights(u); },
        [&](int u) { return state_.unit_grads(u); }));
    if (tp_ > 1 || ep_ > 1) {  // the frozen base through its own plan's split (tp, ep's experts)
      base_plan_ = std::make_unique<ShardPlan>(plan_qwen3(
          local_cfg_, local_layout_, mesh.shape(), 0, tp_kv_replicas(deck.model, tp_)));
      base_map_ = make_model_map(deck.model, layout_, local_layout_, *base_plan_, mesh.shape(),
                                 mesh.tp().rank(), mesh.ep().rank());
    }
    // The adapters split as their base by tp and, on the experts, by ep (lora_map).
    if (tp_ > 1) lora_->set_tensor_parallel(tp_, mesh.tp().rank());
    lora_map_ = lora_map(deck.model, deck.lora, {{0, deck.model.num_layers}}, global_lora_layout_,
                         lora_->layout(), plan_, mesh.shape(), mesh.tp().rank(),
                         mesh.ep().rank());
    host_params_.assign(local_layout_.numel(), 0.0f);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
  }

  // The global layouts: checkpoints, initialisation and imports see global tensors.
  const ParamLayout& layout() const override { return layout_; }
  const ParamLayout& trained_layout() const override { return global_lora_layout_; }
  std::string describe() const override {
    const cuda::DeviceInfo d = cuda::device_info(device_);
    return fmt::format(
        "cuda: GPU {} ({}, {} SMs), bf16 compute; LoRA: bf16 base frozen ({}, no gradients, "
        "moments or fp32 copy), {} adapter parameters trained ({}){}; arena {} ({} used after "
        "set-up)",
        device_, d.name, d.sm_count, cuda::format_bytes(local_layout_.numel() * 2),
        lora_->layout().numel(), state_.describe(),
        (tp_ > 1 ? "; " + describe_tp(local_cfg_, tp_, deck_.mesh.sequence_parallel) : "") +
            (ep_ > 1 ? fmt::format("; expert parallelism over ep {}: {} of {} frozen experts a "
                                   "sparse layer here",
                                   ep_, local_cfg_.local_experts(), local_cfg_.num_experts)
                     : ""),
        cuda::format_bytes(arena_.capacity()), cuda::format_bytes(arena_.used()));
  }
  // Global coordinates through the base's map (tp, ep) and the adapters' TpMap (null without
  // either).
  std::vector<FlatPiece> model_pieces() override {
    return global_pieces(base_map_.get(),
                         std::vector<FlatPiece>{{Range{0, host_params_.size()},
                                                 host_params_.data()}},
                         /*writing=*/false);
  }
  std::vector<FlatPiece> trained_pieces() override {
    return global_pieces(lora_map_.get(), state_.param_pieces(), /*writing=*/false);
  }
  std::vector<StatePiece> checkpoint_pieces() override {
    return global_pieces(lora_map_.get(), state_.checkpoint_pieces(), /*writing=*/true);
  }
  StateTargets checkpoint_targets() override {
    return global_targets(lora_map_.get(), state_.checkpoint_targets());
  }
  void set_first_sample(std::int64_t first) override { first_sample_ = first; }

  void push_state() override {
    // The base: fp32 on the host to bf16 on the GPU, one staging block at a time.
    cuda::upload_as_bf16(base_, host_params_.data(), host_params_.size(), arena_, stream_.get());
    state_.push(stream_.get());
  }
  // The adapters and their moments; the base never changes.
  void pull_state() override { state_.pull(stream_.get()); }
  // The adapters' backward adds into their gradients.
  void zero_grads() override {
    state_.begin_step();
    state_.clear_grads(stream_.get());
    aux_sum_ = 0;
    model_->clear_moe_load();
  }
  double moe_aux_loss_sum() const override { return deck_.model.is_moe() ? aux_sum_ : -1; }
  std::vector<double> moe_load() const override { return model_->moe_load(); }
  std::vector<double> moe_dropped() const override { return model_->moe_dropped(); }

  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    const std::int32_t* positions, float loss_scale) override {
    const std::int32_t* pos = batch_.upload(inputs, targets, positions, stream_.get());
    lora_->set_dropout_key(deck_.train.seed, first_sample_);
    const double loss = model_->forward_backward(base_, nullptr, batch_.inputs(),
                                                 batch_.targets(), loss_scale, stream_.get(), {},
                                                 pos);
    if (deck_.model.is_moe()) aux_sum_ += model_->moe_aux_loss();
    return loss;
  }

  // The adapters report no units to the state: it reduces their gradients here (over dp, then
  // the factors partial over tp summed over tp).
  OptimStepStats optimizer_step(const StepRequest& request) override {
    return state_.step(request, deck_.train.steps, stream_.get());
  }

  std::string memory_report() override { return cuda::memory_report(arena_); }
  // The frozen bf16 base counts as parameters; the adapters' own activations (LoraCuda's
  // buffers) as workspace.
  MemorySplit memory_split() override {
    MemorySplit m = state_.bytes();
    m.params += 2.0 * static_cast<double>(local_layout_.numel());
    m.activations = activations_;
    m.workspace = std::max(0.0, static_cast<double>(arena_.peak()) - m.total());
    return m;
  }

 private:
  // First member: the rank's device is current before any member below creates a CUDA object
  // (streams, events, arenas belong to the device that was current when they were made).
  int device_;
  const Deck& deck_;
  int tp_;                          // mesh.tp
  int ep_;                          // mesh.ep of a Qwen3-MoE model, else 1
  ParamLayout layout_;              // the base model's (global)
  ModelConfig local_cfg_;           // the tp and ep rank's model (the model's at tp = ep = 1)
  ParamLayout local_layout_;        // its layout: the base's on this rank
  ParamLayout global_lora_layout_;  // the adapters' of the global model (checkpoints)
  cuda::DeviceArena arena_;
  cuda::Stream stream_;
  void* gemm_ws_;
  cuda::bf16* base_;  // [local numel] frozen base weights, bf16
  std::unique_ptr<cuda::LoraCuda> lora_;  // the local model's adapters (lora_->layout())
  ShardPlan plan_;            // the adapters of the local layout over the mesh (plan_adapters)
  cuda::NcclComm* nccl_dp_;  // the mesh's dp communicator; null at dp 1
  cuda::NcclComm* nccl_tp_;  // the mesh's tp communicator; null at tp 1
  cuda::NcclComm* nccl_ep_;  // the mesh's ep communicator; null at ep 1
  cuda::NcclComm* nccl_edp_;  // the mesh's expert-dp communicator; null at ep 1
  cuda::ShardedCudaState state_;  // the adapters: master weights, gradients, bf16 copy, moments
  cuda::BatchBuffers batch_;
  std::unique_ptr<cuda::Qwen3Cuda> model_;
  std::unique_ptr<ShardPlan> base_plan_;  // tp or ep > 1: the frozen base's split
  std::unique_ptr<LayoutMap> base_map_;   // tp or ep > 1: the base's local -> global pieces
  std::unique_ptr<LayoutMap> lora_map_;   // the adapters' local -> global pieces (lora_map)
  std::int64_t first_sample_ = 0;
  std::vector<float> host_params_;  // [local numel] the fp32 base as loaded (host only)
  double activations_ = 0;          // bytes of Qwen3Cuda's buffers and the micro-batch's
  double aux_sum_ = 0;              // moe_aux_loss_sum(): the step's micro-batches so far
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_lora_backend(const Deck& deck, Mesh& mesh) {
  return std::make_unique<CudaLoraBackend>(deck, mesh);
}

}  // namespace qt
