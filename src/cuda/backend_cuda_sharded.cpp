// The CUDA back end at ZeRO-2 and ZeRO-3, with or without offload: Qwen3Cuda over the units of
// the sharding plan (cuda/sharded_state_cuda.h gathers and reduces them on the NCCL stream while
// the model computes). One DeviceArena per rank, as in backend_cuda.cpp.
#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <memory>
#include <thread>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "cuda/qwen3_cuda.h"
#include "cuda/sharded_state_cuda.h"
#include "cuda/trained_state.h"
#include "ops/cuda/gemm.cuh"
#include "qtrain/error.h"
#include "qtrain/shard_plan.h"
#include "train/backend.h"

namespace qt {

namespace {

// Host threads for offload's AdamW: the CPUs this rank may run on; ranks left unbound (mpirun
// --bind-to none) each see the whole node and share it.
unsigned offload_threads(const Mesh& mesh) {
  const unsigned all = std::max(1u, std::thread::hardware_concurrency());
  unsigned cpus = all;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = static_cast<unsigned>(CPU_COUNT(&set));
  if (cpus >= all && mesh.local_size() > 1) cpus /= static_cast<unsigned>(mesh.local_size());
  return std::clamp(cpus, 1u, 64u);
}

class CudaShardedBackend final : public TrainBackend {
 public:
  CudaShardedBackend(const Deck& deck, Mesh& mesh)
      : device_(cuda::select_device(mesh.local_rank())),
        deck_(deck),
        layout_(deck.model),
        plan_(plan_qwen3(deck.model, layout_, mesh.shape(), deck.optim.zero_stage)),
        arena_(cuda::training_arena_bytes(), fmt::format("GPU {} arena", device_)),
        gemm_ws_(arena_.allocate(cuda::kGemmWorkspaceBytes)),
        nccl_dp_(mesh.dp().size() > 1 ? &cuda::nccl(mesh, MeshDim::kDp) : nullptr),
        state_(plan_, layout_, deck.optim, deck.optim.offload == "cpu", mesh.dp(), nccl_dp_,
               arena_, offload_threads(mesh),
               {deck.model.tie_word_embeddings ? 0 : deck.train.micro_batch * deck.train.seq_len,
                deck.model.hidden_size}),
        batch_(deck.train.micro_batch, deck.train.seq_len, arena_),
        micro_batches_(std::max<std::int64_t>(
            1, deck.train.global_batch / (std::int64_t{deck.train.micro_batch} * mesh.dp().size()))) {
    cuda::gemm_init(gemm_ws_, cuda::kGemmWorkspaceBytes);
    const std::size_t before_model = arena_.used();
    model_ = std::make_unique<cuda::Qwen3Cuda>(deck.model, deck.train.micro_batch,
                                               deck.train.seq_len, arena_, deck.train.recompute);
    activations_ = static_cast<double>(arena_.used() - before_model) + batch_.bytes();
    QT_CHECK_CUDA(cudaDeviceSynchronize());
  }

  const ParamLayout& layout() const override { return layout_; }
  std::string describe() const override {
    const cuda::DeviceInfo d = cuda::device_info(device_);
    return fmt::format("cuda: GPU {} ({}, {} SMs), bf16 compute; {}; arena {} ({} used after "
                       "set-up)",
                       device_, d.name, d.sm_count, state_.describe(),
                       cuda::format_bytes(arena_.capacity()), cuda::format_bytes(arena_.used()));
  }
  std::vector<FlatPiece> model_pieces() override { return state_.param_pieces(); }
  std::vector<StatePiece> checkpoint_pieces() override { return state_.checkpoint_pieces(); }
  StateTargets checkpoint_targets() override { return state_.checkpoint_targets(); }
  void push_state() override { state_.push(stream_.get()); }
  void pull_state() override { state_.pull(stream_.get()); }

  void zero_grads() override {
    state_.zero_grads(stream_.get());
    micro_batch_ = 0;
  }
  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    const std::int32_t* positions, float loss_scale) override {
    const std::int32_t* pos = batch_.upload(inputs, targets, positions, stream_.get());
    const auto write = state_.begin_micro_batch(micro_batch_ == 0, micro_batch_ + 1 == micro_batches_);
    ++micro_batch_;
    return model_->forward_backward(state_, batch_.inputs(), batch_.targets(), loss_scale,
                                    stream_.get(), pos, write);
  }
  OptimStepStats optimizer_step(std::int64_t step) override {
    return state_.step(step, deck_.train.steps, stream_.get());
  }
  std::string memory_report() override { return cuda::memory_report(arena_); }
  MemorySplit memory_split() override {
    MemorySplit m = state_.bytes();
    m.activations = activations_;
    m.workspace = std::max(0.0, static_cast<double>(arena_.peak()) - m.total());
    return m;
  }

 private:
  // First member: the rank's device is current before any CUDA object below is made.
  int device_;
  const Deck& deck_;
  ParamLayout layout_;
  ShardPlan plan_;
  cuda::DeviceArena arena_;
  cuda::Stream stream_;
  void* gemm_ws_;
  cuda::NcclComm* nccl_dp_;  // the mesh's dp communicator; null at dp 1
  cuda::ShardedCudaState state_;
  cuda::BatchBuffers batch_;
  std::unique_ptr<cuda::Qwen3Cuda> model_;
  // The micro-batches of a step (the trainer's count: global_batch / (micro_batch x dp)) and the
  // index of the next one since zero_grads().
  std::int64_t micro_batches_, micro_batch_ = 0;
  double activations_ = 0;  // bytes of Qwen3Cuda's buffers and the micro-batch's
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_sharded_backend(const Deck& deck, Mesh& mesh) {
  return std::make_unique<CudaShardedBackend>(deck, mesh);
}

}  // namespace qt
