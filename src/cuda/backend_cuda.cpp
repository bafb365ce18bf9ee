// The CUDA back end for full training: Qwen3Cuda over the units of the sharding plan, the optimizer
// state in ShardedCudaState at every ZeRO stage (cuda/sharded_state_cuda.h: it gathers and
// reduces units on the NCCL stream while the model computes), AdamW fused on the GPU or, with
// optim.offload = cpu, on host threads. LoRA has its own back end (backend_cuda_lora.cpp). With
// mesh.tp > 1 the model and the state are the tp rank's local part (parallel/tensor_parallel.h;
// the collectives in cuda_ops.h) and every piece of state leaves and enters in global
// coordinates (TpMap), as on the CPU. With mesh.ep > 1 (Qwen3-MoE) they are the ep rank's: E / ep
// experts of each sparse layer, a unit of their own over the expert-data-parallel group, the
// tokens' rows sent to their experts' ranks and back (cuda_ops_moe_ep.cpp), and EpMap places
// those experts in the global tensors. With both (tp x ep), each of those experts' tp columns
// (TpEpMap), the rows exchanged within the ep group of this tp rank.
//
// Memory: one DeviceArena per rank takes the GPU's free memory less a margin for NCCL and cuBLASLt
// at start-up; every buffer comes from it, so the step loop never calls cudaMalloc.
#include <cuda_profiler_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "cuda/qwen3_cuda.h"
#include "cuda/sharded_state_cuda.h"
#include "cuda/training_buffers.h"
#include "ops/cuda/gemm.cuh"
#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"
#include "plan/memory_plan.h"
#include "qtrain/error.h"
#include "qtrain/shard_plan.h"
#include "train/backend.h"

namespace qt {

namespace {

class CudaBackend final : public cuda::CudaTrainBackend {
 public:
  CudaBackend(const Deck& deck, Mesh& mesh)
      : device_(cuda::select_device(mesh.local_rank())),
        deck_(deck),
        tp_(mesh.shape().tp),
        layout_(deck.model),
        ep_(deck.model.is_moe() ? mesh.shape().ep : 1),
        local_cfg_(ep_local_config(tp_local_config(deck.model, tp_), ep_)),
        local_layout_(local_cfg_),
        plan_(plan_qwen3(local_cfg_, local_layout_, mesh.shape(), deck.optim.zero_stage,
                         tp_kv_replicas(deck.model, tp_))),
        arena_(cuda::training_arena_bytes(), fmt::format("GPU {} arena", device_)),
        gemm_ws_(arena_.allocate(cuda::kGemmWorkspaceBytes)),
        nccl_dp_(mesh.dp().size() > 1 ? &cuda::nccl(mesh, MeshDim::kDp) : nullptr),
        nccl_tp_(tp_ > 1 ? &cuda::nccl(mesh, MeshDim::kTp) : nullptr),
        nccl_ep_(ep_ > 1 ? &cuda::nccl(mesh, MeshDim::kEp) : nullptr),
        nccl_edp_(ep_ > 1 ? &cuda::nccl(mesh, MeshDim::kEdp) : nullptr),
        state_(plan_, local_layout_, deck.optim, mesh.dp(), nccl_dp_, arena_,
               cuda::offload_threads(mesh),
               {deck.model.tie_word_embeddings ? 0 : deck.train.micro_batch * deck.train.seq_len,
                deck.model.hidden_size,
                std::int64_t{mesh.tp().rank()} * local_cfg_.vocab_size},
               {tp_ > 1 ? &mesh.tp() : nullptr, nccl_tp_}, {}, nccl_edp_),
        batch_(deck.train.micro_batch, deck.train.seq_len, arena_),
        micro_batches_(std::max<std::int64_t>(
            1, deck.train.global_batch / (std::int64_t{deck.train.micro_batch} * mesh.dp().size()))) {
    cuda::gemm_init(gemm_ws_, cuda::kGemmWorkspaceBytes);
    const std::size_t before_model = arena_.used();
    model_ = std::make_unique<cuda::Qwen3Cuda>(local_cfg_, deck.train.micro_batch,
                                               deck.train.seq_len, arena_, deck.train.recompute,
                                               nccl_tp_, mesh.shape().seq_parallel(),
                                               mesh.shape().tp_overlap, nccl_ep_);
    // Each micro-batch's load-balancing loss weighs coef / (the step's micro-batches, all dp
    // ranks), as on the CPU (backend_cpu.cpp).
    if (deck.model.is_moe())
      model_->set_moe_aux_scale(static_cast<float>(deck.model.router_aux_loss_coef *
                                                   deck.train.micro_batch / deck.train.global_batch));
    map_ = make_model_map(deck.model, layout_, local_layout_, plan_, mesh.shape(),
                          mesh.tp().rank(), mesh.ep().rank());
    activations_ = static_cast<double>(arena_.used() - before_model) + batch_.bytes();
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    read_profile_window();
  }

  const ParamLayout& layout() const override { return layout_; }
  std::string describe() const override {
    const cuda::DeviceInfo d = cuda::device_info(device_);
    return fmt::format("cuda: GPU {} ({}, {} SMs), bf16 compute; {}{}{}; arena {} ({} used after "
                       "set-up)",
                       device_, d.name, d.sm_count, state_.describe(),
                       tp_ > 1 ? "; " + describe_tp(local_cfg_, tp_, deck_.mesh.sequence_parallel)
                               : "",
                       ep_ > 1
                           ? fmt::format("; expert parallelism over ep {}: {} of {} experts a "
                                         "sparse layer here, their state over expert-dp {}",
                                         ep_, local_cfg_.local_experts(), local_cfg_.num_experts,
                                         deck_.mesh.dp / ep_)
                           : "",
                       cuda::format_bytes(arena_.capacity()), cuda::format_bytes(arena_.used()));
  }
  // Global coordinates (checkpoints, initialisation and imports see global tensors).
  std::vector<FlatPiece> model_pieces() override {
    return global_pieces(map_.get(), state_.param_pieces(), /*writing=*/false);
  }
  std::vector<StatePiece> checkpoint_pieces() override {
    return global_pieces(map_.get(), state_.checkpoint_pieces(), /*writing=*/true);
  }
  StateTargets checkpoint_targets() override {
    return global_targets(map_.get(), state_.checkpoint_targets());
  }
  void push_state() override { state_.push(stream_.get()); }
  void pull_state() override { state_.pull(stream_.get()); }

  void zero_grads() override {
    if (steps_done_ == profile_begin_) QT_CHECK_CUDA(cudaProfilerStart());
    // No memset: the step's first micro-batch writes every gradient (GradWrite::kOverwrite).
    state_.begin_step();
    micro_batch_ = 0;
    aux_sum_ = 0;
    model_->clear_moe_load();
  }
  double moe_aux_loss_sum() const override { return deck_.model.is_moe() ? aux_sum_ : -1; }
  std::vector<double> moe_load() const override { return model_->moe_load(); }
  std::vector<double> moe_dropped() const override { return model_->moe_dropped(); }
  void set_router_bias(const std::vector<float>& bias) override { model_->set_router_bias(bias); }
  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    const std::int32_t* positions, float loss_scale) override {
    const std::int32_t* pos = batch_.upload(inputs, targets, positions, stream_.get());
    // Whole gradients are reduced after the step's last micro-batch: no micro-batch may follow.
    QT_CHECK(micro_batch_ < micro_batches_, "micro-batch {} of a step of {}", micro_batch_ + 1,
             micro_batches_);
    const auto write = state_.begin_micro_batch(micro_batch_ == 0, micro_batch_ + 1 == micro_batches_);
    ++micro_batch_;
    const double loss = model_->forward_backward(state_, batch_.inputs(), batch_.targets(),
                                                 loss_scale, stream_.get(), pos, write);
    if (deck_.model.is_moe()) aux_sum_ += model_->moe_aux_loss();
    return loss;
  }
  OptimStepStats optimizer_step(const StepRequest& request) override {
    const OptimStepStats s = state_.step(request, deck_.train.steps, stream_.get());
    if (++steps_done_ == profile_end_) {
      stream_.synchronize();
      QT_CHECK_CUDA(cudaProfilerStop());
    }
    return s;
  }
  std::string memory_report() override { return cuda::memory_report(arena_); }
  MemorySplit memory_split() override {
    MemorySplit m = state_.bytes();
    m.activations = activations_;
    m.workspace = std::max(0.0, static_cast<double>(arena_.peak()) - m.total());
    return m;
  }

 private:
  // QTRAIN_CUDA_PROFILE_STEPS=a:b brackets steps [a, b) of this process (0-based) with
  // cudaProfilerStart/Stop, for `ncu --profile-from-start off` (bench/profile_step.sh).
  void read_profile_window() {
    const char* env = std::getenv("QTRAIN_CUDA_PROFILE_STEPS");
    if (env == nullptr) return;
    if (std::sscanf(env, "%ld:%ld", &profile_begin_, &profile_end_) != 2 ||
        profile_begin_ < 0 || profile_end_ <= profile_begin_)
      fail_user("QTRAIN_CUDA_PROFILE_STEPS = '{}': expected a:b with 0 <= a < b", env);
  }

  // First member: the rank's device is current before any CUDA object below is made.
  int device_;
  const Deck& deck_;
  int tp_;                      // mesh.tp
  ParamLayout layout_;          // the model's (global)
  int ep_;                      // mesh.ep of a Qwen3-MoE model, else 1
  ModelConfig local_cfg_;       // the tp or ep rank's model (the model's at tp = ep = 1)
  ParamLayout local_layout_;    // its layout: the plan's, the state's and the model's
  ShardPlan plan_;
  cuda::DeviceArena arena_;
  cuda::Stream stream_;
  void* gemm_ws_;
  cuda::NcclComm* nccl_dp_;  // the mesh's dp communicator; null at dp 1
  cuda::NcclComm* nccl_tp_;  // the mesh's tp communicator; null at tp 1
  cuda::NcclComm* nccl_ep_;  // the mesh's ep and expert-dp communicators; null at ep 1
  cuda::NcclComm* nccl_edp_;
  cuda::ShardedCudaState state_;
  cuda::BatchBuffers batch_;
  std::unique_ptr<cuda::Qwen3Cuda> model_;
  std::unique_ptr<LayoutMap> map_;  // local -> global pieces: TpMap (tp > 1), EpMap (ep > 1),
                                    // TpEpMap (both), null (neither)
  // The micro-batches of a step (the trainer's count: global_batch / (micro_batch x dp)) and the
  // index of the next one since zero_grads().
  std::int64_t micro_batches_, micro_batch_ = 0;
  double activations_ = 0;  // bytes of Qwen3Cuda's buffers and the micro-batch's
  double aux_sum_ = 0;      // moe_aux_loss_sum(): the step's micro-batches so far
  long steps_done_ = 0, profile_begin_ = -1, profile_end_ = -1;
};

// What the memory plan (src/plan/memory_plan.h) says would fit this GPU, for the message of a run
// that does not: the cheapest setting that fits, or "" when none does or the deck is not plannable.
std::string fitting_setting(const Deck& deck) {
  if (deck.lora.enabled()) return {};
  try {
    plan::MemoryPlanInput in;
    in.model = deck.model;
    in.micro_batch = deck.train.micro_batch;
    in.seq_len = deck.train.seq_len;
    in.recompute = deck.train.recompute;
    in.mesh = deck.mesh;
    in.grad_reduce_bf16 = deck.optim.grad_reduce == "bf16";
    const std::size_t usable = cuda::training_arena_bytes();  // the arena this GPU gives a run
    const auto best = plan::cheapest_fitting(in, usable);
    if (!best) return {};
    return fmt::format("; on this GPU optim.zero_stage = {} with optim.offload = {} fits ({} of "
                       "{}; `qtrain plan` shows every setting)",
                       best->zero_stage, plan::offload_name(best->offload),
                       cuda::format_bytes(best->plan.gpu()), cuda::format_bytes(usable));
  } catch (const UserError&) {
    return {};
  }
}

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_backend(const Deck& deck, Mesh& mesh) {
  // A model too large for the GPU is the user's to change, not an internal failure. Every rank
  // of a uniform job throws alike; a rank that throws alone ends the job from main().
  try {
    // NCCL's connections first: the arena then takes what they leave (nccl_comm.h).
    cuda::select_device(mesh.local_rank());
    const double nccl_bytes = mesh.world().max(
        static_cast<double>(cuda::connect_before_arena(mesh, deck.model.is_moe())));
    if (nccl_bytes > 0 && mesh.world().rank() == 0)
      std::printf("cuda: NCCL's communicators took %s of GPU memory before the arena (the most of "
                  "any rank)\n",
                  cuda::format_bytes(static_cast<std::size_t>(nccl_bytes)).c_str());
    // A pipeline (with [lora] too: backend_cuda_pipeline.cpp trains each stage's adapters).
    if (mesh.shape().pp > 1) return make_cuda_pipeline_backend(deck, mesh);
    if (deck.lora.enabled()) return make_cuda_lora_backend(deck, mesh);
    return std::make_unique<CudaBackend>(deck, mesh);
  } catch (const cuda::OutOfMemory& e) {
    fail_user("the run does not fit the GPU ({}): make it smaller with train.micro_batch, "
              "train.seq_len, train.recompute = true, a higher optim.zero_stage over more GPUs, "
              "optim.offload = cpu, [lora], or a smaller model{}",
              e.what(), fitting_setting(deck));
  }
}

}  // namespace qt
