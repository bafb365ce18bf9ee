// The CUDA back end: fp32 master weights, gradients and AdamW moments on the GPU, a bf16 compute
// copy of the weights, Qwen3Cuda for forward and backward, NCCL over dp, AdamW fused on the GPU.
//
// Memory: one DeviceArena per rank takes the GPU's free memory less a margin for NCCL and cuBLASLt
// at start-up; every buffer comes from it, so the step loop never calls cudaMalloc.
//
// Data parallelism: during the backward of a step's last micro-batch, gradients are reduced over
// dp in buckets of optim.reduce_bucket_mb on the NCCL stream as soon as the model reports them
// final (Qwen3Cuda::GradsReady), overlapping the rest of the backward: an all-reduce with ZeRO-0,
// and with ZeRO-1 a reduce of each bucket's pieces to the ranks that own them (one NCCL group).
// optim.grad_reduce = bf16 sends a bf16 copy (made on the NCCL stream) instead of the fp32
// gradients and converts the result back.
#include <cuda_profiler_api.h>

#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <memory>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "cuda/qwen3_cuda.h"
#include "cuda/trained_state.h"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/gemm.cuh"
#include "plan/memory_plan.h"
#include "qtrain/error.h"
#include "train/backend.h"

namespace qt {

namespace {

class CudaBackend final : public TrainBackend {
 public:
  CudaBackend(const Deck& deck, Mesh& mesh)
      : device_(cuda::select_device(mesh.local_rank())),
        deck_(deck),
        mesh_(mesh),
        layout_(deck.model),
        arena_(cuda::training_arena_bytes(), fmt::format("GPU {} arena", device_)),
        gemm_ws_(arena_.allocate(cuda::kGemmWorkspaceBytes)),
        state_(layout_, mesh.dp(), deck.optim.zero_stage == 1, arena_),
        batch_(deck.train.micro_batch, deck.train.seq_len, arena_) {
    const std::size_t n = layout_.numel();
    const int dp = mesh.dp().size();
    cuda::gemm_init(gemm_ws_, cuda::kGemmWorkspaceBytes);
    micro_steps_per_step_ = deck.train.global_batch / (dp * deck.train.micro_batch);
    const std::size_t before_model = arena_.used();
    model_ = std::make_unique<cuda::Qwen3Cuda>(deck.model, deck.train.micro_batch,
                                               deck.train.seq_len, arena_, deck.train.recompute);
    activations_ = static_cast<double>(arena_.used() - before_model) + batch_.bytes();
    if (dp > 1) nccl_dp_ = &cuda::nccl(mesh, MeshDim::kDp);  // the mesh's, made here on first use
    bucket_elems_ = std::max<std::size_t>(
        1, static_cast<std::size_t>(deck.optim.reduce_bucket_mb * (1 << 20) / sizeof(float)));
    if (dp > 1 && deck.optim.grad_reduce == "bf16")
      reduce_stage_ = arena_.allocate<cuda::bf16>(state_.padded());
    for (int r = 0; r < dp; ++r) owners_.push_back(split_range(n, dp, r));
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    read_profile_window();
  }

  const ParamLayout& layout() const override { return layout_; }
  std::string describe() const override {
    const cuda::DeviceInfo d = cuda::device_info(device_);
    return fmt::format("cuda: GPU {} ({}, {} SMs), bf16 compute, fp32 master weights; arena {} "
                       "({} used after set-up)",
                       device_, d.name, d.sm_count, cuda::format_bytes(arena_.capacity()),
                       cuda::format_bytes(arena_.used()));
  }
  std::vector<FlatPiece> model_pieces() override {
    return {{Range{0, layout_.numel()}, state_.host_params()}};
  }
  std::vector<StatePiece> checkpoint_pieces() override {
    return flat_state_pieces(layout_.numel(), mesh_.world(), state_.host_params(),
                             state_.host_moments());
  }
  StateTargets checkpoint_targets() override {
    return flat_state_targets(layout_.numel(), state_.host_params(), state_.host_moments());
  }
  void push_state() override { state_.push(stream_.get()); }
  void pull_state() override { state_.pull(stream_.get()); }

  void zero_grads() override {
    if (steps_done_ == profile_begin_) QT_CHECK_CUDA(cudaProfilerStart());
    // No memset: the step's first micro-batch writes every gradient (GradWrite::kOverwrite).
    micro_steps_ = 0;
    reduced_from_ = layout_.numel();
  }

  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    const std::int32_t* positions, float loss_scale) override {
    const std::int32_t* pos = batch_.upload(inputs, targets, positions, stream_.get());
    // Gradients must not change once their reduction has started: only the last micro-batch
    // of a step reduces, and no micro-batch may follow it.
    QT_CHECK(micro_steps_ < micro_steps_per_step_, "micro-batch {} of a step of {}",
             micro_steps_ + 1, micro_steps_per_step_);
    const auto write = micro_steps_ == 0 ? cuda::Qwen3Cuda::GradWrite::kOverwrite
                                         : cuda::Qwen3Cuda::GradWrite::kAccumulate;
    cuda::Qwen3Cuda::GradsReady ready;
    if (++micro_steps_ == micro_steps_per_step_ && nccl_dp_)
      ready = [this](std::size_t begin) { gradients_ready(begin); };
    return model_->forward_backward(state_.weights(), state_.grads(), batch_.inputs(),
                                    batch_.targets(), loss_scale, stream_.get(), ready, pos,
                                    write);
  }

  OptimStepStats optimizer_step(std::int64_t step) override {
    if (nccl_dp_) {
      if (reduced_from_ > 0) reduce_gradients(0, reduced_from_);  // what the backward left
      reduced_from_ = 0;
      nccl_dp_->synchronize();  // every reduction done before the optimizer reads gradients
    }
    const OptimStepStats s = state_.step(deck_.optim, deck_.train.steps, step, mesh_.dp(),
                                         nccl_dp_, stream_.get());
    if (++steps_done_ == profile_end_) {
      stream_.synchronize();
      QT_CHECK_CUDA(cudaProfilerStop());
    }
    return s;
  }

  std::string memory_report() override { return cuda::memory_report(arena_); }
  MemorySplit memory_split() override {
    MemorySplit m = state_.bytes();
    if (reduce_stage_ != nullptr) m.grads += 2.0 * static_cast<double>(state_.padded());
    m.activations = activations_;
    m.workspace = std::max(0.0, static_cast<double>(arena_.peak()) - m.total());
    return m;
  }

 private:
  // The model reports gradients at offsets >= begin final: reduce them once a bucket is full.
  void gradients_ready(std::size_t begin) {
    if (begin > 0 && reduced_from_ - begin < bucket_elems_) return;
    reduce_gradients(begin, reduced_from_);
    reduced_from_ = begin;
  }

  // Enqueues the dp reduction of the gradients [lo, hi) on the NCCL stream, after the work
  // enqueued so far on the compute stream.
  void reduce_gradients(std::size_t lo, std::size_t hi) {
    if (lo >= hi) return;
    QT_CHECK_CUDA(cudaEventRecord(grads_event_.get(), stream_.get()));
    nccl_dp_->wait_event(grads_event_.get());
    const bool bf16 = reduce_stage_ != nullptr;
    float* grads = state_.grads();
    void* buf = bf16 ? static_cast<void*>(reduce_stage_) : static_cast<void*>(grads);
    const DType t = bf16 ? DType::kBF16 : DType::kF32;
    const std::size_t es = dtype_size(t);
    if (bf16)
      cuda::convert_f32_to_bf16(reduce_stage_ + lo, grads + lo, hi - lo, nccl_dp_->stream());
    // What this rank needs back: the whole bucket (ZeRO-0), or its own piece of it (ZeRO-1).
    Range mine{lo, hi};
    if (deck_.optim.zero_stage != 1) {
      nccl_dp_->all_reduce_async(static_cast<char*>(buf) + lo * es, hi - lo, t, ReduceOp::kSum);
    } else {
      nccl_dp_->group_start();
      for (int r = 0; r < static_cast<int>(owners_.size()); ++r) {
        const std::size_t a = std::max(lo, owners_[r].begin), b = std::min(hi, owners_[r].end);
        if (a < b)
          nccl_dp_->reduce_async(static_cast<char*>(buf) + a * es, b - a, t, ReduceOp::kSum, r);
      }
      nccl_dp_->group_end();
      const Range& own = owners_[mesh_.dp().rank()];
      mine = {std::max(lo, own.begin), std::min(hi, own.end)};
    }
    if (bf16 && mine.begin < mine.end)
      cuda::convert_bf16_to_f32(grads + mine.begin, reduce_stage_ + mine.begin, mine.size(),
                                nccl_dp_->stream());
  }

  // QTRAIN_CUDA_PROFILE_STEPS=a:b brackets steps [a, b) of this process (0-based) with
  // cudaProfilerStart/Stop, for `ncu --profile-from-start off` (bench/profile_step.sh).
  void read_profile_window() {
    const char* env = std::getenv("QTRAIN_CUDA_PROFILE_STEPS");
    if (env == nullptr) return;
    if (std::sscanf(env, "%ld:%ld", &profile_begin_, &profile_end_) != 2 ||
        profile_begin_ < 0 || profile_end_ <= profile_begin_)
      fail_user("QTRAIN_CUDA_PROFILE_STEPS = '{}': expected a:b with 0 <= a < b", env);
  }

  // First member: the rank's device is current before any member below creates a CUDA object
  // (streams, events, arenas belong to the device that was current when they were made).
  int device_;
  const Deck& deck_;
  Mesh& mesh_;
  long steps_done_ = 0, profile_begin_ = -1, profile_end_ = -1;
  int micro_steps_ = 0, micro_steps_per_step_ = 1;
  std::size_t reduced_from_ = 0;  // gradients [reduced_from_, numel) have their reduction enqueued
  std::vector<Range> owners_;     // ZeRO-1: the flat range each dp rank updates
  std::size_t bucket_elems_ = 0;
  double activations_ = 0;  // bytes of Qwen3Cuda's buffers and the micro-batch's
  cuda::bf16* reduce_stage_ = nullptr;  // bf16 copy of the gradients (optim.grad_reduce = bf16)
  ParamLayout layout_;
  cuda::DeviceArena arena_;
  cuda::Stream stream_;
  cuda::Event grads_event_;  // recorded on stream_ before each bucket's dp reduction
  void* gemm_ws_;
  cuda::TrainedState state_;  // the model's master weights, gradients, bf16 copy and moments
  cuda::BatchBuffers batch_;
  std::unique_ptr<cuda::Qwen3Cuda> model_;
  cuda::NcclComm* nccl_dp_ = nullptr;  // the mesh's dp communicator; null at dp 1
};

}  // namespace

namespace {

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
    if (deck.lora.enabled()) return make_cuda_lora_backend(deck, mesh);
    if (deck.optim.zero_stage >= 2) return make_cuda_sharded_backend(deck, mesh);
    return std::make_unique<CudaBackend>(deck, mesh);
  } catch (const cuda::OutOfMemory& e) {
    fail_user("the run does not fit the GPU ({}): make it smaller with train.micro_batch, "
              "train.seq_len, train.recompute = true, a higher optim.zero_stage over more GPUs, "
              "optim.offload = cpu, [lora], or a smaller model{}",
              e.what(), fitting_setting(deck));
  }
}

}  // namespace qt
