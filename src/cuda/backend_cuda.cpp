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

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <memory>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "cuda/qwen3_cuda.h"
#include "ops/cuda/adamw.cuh"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/gemm.cuh"
#include "optim/schedule.h"
#include "qtrain/error.h"
#include "train/backend.h"

namespace qt {

namespace {

constexpr std::size_t kReservedBytes = std::size_t{3} << 30;  // left to NCCL, cuBLASLt, CUDA

class CudaBackend final : public TrainBackend {
 public:
  CudaBackend(const Deck& deck, Mesh& mesh)
      : deck_(deck), mesh_(mesh), layout_(deck.model),
        device_(cuda::select_device(mesh.local_rank())),
        arena_(arena_bytes(), fmt::format("GPU {} arena", device_)) {
    const std::size_t n = layout_.numel();
    const int dp = mesh.dp().size();
    chunk_ = (n + dp - 1) / dp;
    padded_ = chunk_ * dp;
    range_ = deck.optim.zero_stage == 1 ? split_range(n, dp, mesh.dp().rank()) : Range{0, n};
    gemm_ws_ = arena_.allocate(cuda::kGemmWorkspaceBytes);
    cuda::gemm_init(gemm_ws_, cuda::kGemmWorkspaceBytes);
    master_ = arena_.allocate<float>(padded_);
    weights_ = arena_.allocate<cuda::bf16>(padded_);
    grads_ = arena_.allocate<float>(padded_);
    m_ = arena_.allocate<float>(range_.size());
    v_ = arena_.allocate<float>(range_.size());
    micro_steps_per_step_ = deck.train.global_batch / (dp * deck.train.micro_batch);
    norm_ws_ = arena_.allocate(cuda::grad_norm_workspace_bytes());
    std::vector<cuda::AdamWSegment> segs;
    for (const ParamInfo& p : layout_.params())
      segs.push_back({p.offset, p.offset + p.numel, p.weight_decay ? 1 : 0});
    segments_ = arena_.allocate<cuda::AdamWSegment>(segs.size());
    num_segments_ = static_cast<int>(segs.size());
    cuda::upload(segments_, segs.data(), segs.size() * sizeof(segs[0]));
    QT_CHECK_CUDA(cudaMemset(master_, 0, padded_ * sizeof(float)));
    QT_CHECK_CUDA(cudaMemset(m_, 0, range_.size() * sizeof(float)));
    QT_CHECK_CUDA(cudaMemset(v_, 0, range_.size() * sizeof(float)));
    const std::size_t tokens = static_cast<std::size_t>(deck.train.micro_batch) * deck.train.seq_len;
    inputs_ = arena_.allocate<std::int32_t>(tokens);
    targets_ = arena_.allocate<std::int32_t>(tokens);
    positions_ = arena_.allocate<std::int32_t>(tokens);  // used only when packing
    model_ = std::make_unique<cuda::Qwen3Cuda>(deck.model, deck.train.micro_batch,
                                               deck.train.seq_len, arena_, deck.train.recompute);
    if (dp > 1) nccl_dp_ = std::make_unique<cuda::NcclComm>(mesh.dp(), "dp");
    bucket_elems_ = std::max<std::size_t>(
        1, static_cast<std::size_t>(deck.optim.reduce_bucket_mb * (1 << 20) / sizeof(float)));
    if (dp > 1 && deck.optim.grad_reduce == "bf16")
      reduce_stage_ = arena_.allocate<cuda::bf16>(padded_);
    for (int r = 0; r < dp; ++r) owners_.push_back(split_range(n, dp, r));
    host_params_.assign(padded_, 0.0f);
    host_m_.assign(range_.size(), 0.0f);
    host_v_.assign(range_.size(), 0.0f);
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
  float* host_params() override { return host_params_.data(); }
  MomentShard host_moments() override { return {range_, host_m_.data(), host_v_.data()}; }

  void push_state() override {
    const std::size_t n = layout_.numel();
    cuda::upload(master_, host_params_.data(), n * 4);
    cuda::upload(m_, host_m_.data(), range_.size() * 4);
    cuda::upload(v_, host_v_.data(), range_.size() * 4);
    cuda::convert_f32_to_bf16(weights_, master_, padded_, stream_.get());
    stream_.synchronize();
  }
  void pull_state() override {
    stream_.synchronize();
    const std::size_t n = layout_.numel();
    QT_CHECK_CUDA(cudaMemcpy(host_params_.data(), master_, n * 4, cudaMemcpyDeviceToHost));
    QT_CHECK_CUDA(cudaMemcpy(host_m_.data(), m_, range_.size() * 4, cudaMemcpyDeviceToHost));
    QT_CHECK_CUDA(cudaMemcpy(host_v_.data(), v_, range_.size() * 4, cudaMemcpyDeviceToHost));
  }

  void zero_grads() override {
    if (steps_done_ == profile_begin_) QT_CHECK_CUDA(cudaProfilerStart());
    QT_CHECK_CUDA(cudaMemsetAsync(grads_, 0, padded_ * sizeof(float), stream_.get()));
    micro_steps_ = 0;
    reduced_from_ = layout_.numel();
  }

  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    const std::int32_t* positions, float loss_scale) override {
    const std::size_t bytes =
        static_cast<std::size_t>(deck_.train.micro_batch) * deck_.train.seq_len * 4;
    QT_CHECK_CUDA(cudaMemcpyAsync(inputs_, inputs, bytes, cudaMemcpyHostToDevice, stream_.get()));
    QT_CHECK_CUDA(cudaMemcpyAsync(targets_, targets, bytes, cudaMemcpyHostToDevice, stream_.get()));
    if (positions)
      QT_CHECK_CUDA(
          cudaMemcpyAsync(positions_, positions, bytes, cudaMemcpyHostToDevice, stream_.get()));
    // Gradients must not change once their reduction has started: only the last micro-batch
    // of a step reduces, and no micro-batch may follow it.
    QT_CHECK(micro_steps_ < micro_steps_per_step_, "micro-batch {} of a step of {}",
             micro_steps_ + 1, micro_steps_per_step_);
    cuda::Qwen3Cuda::GradsReady ready;
    if (nccl_dp_ && ++micro_steps_ == micro_steps_per_step_)
      ready = [this](std::size_t begin) { gradients_ready(begin); };
    return model_->forward_backward(weights_, grads_, inputs_, targets_, loss_scale, stream_.get(),
                                    ready, positions ? positions_ : nullptr);
  }

  OptimStepStats optimizer_step(std::int64_t step) override {
    OptimStepStats s;
    const OptimConfig& o = deck_.optim;
    s.lr = lr_at(o, deck_.train.steps, step);
    const bool zero1 = o.zero_stage == 1;
    const float* g = grads_ + range_.begin;  // with ZeRO-1, this rank's reduced shard
    if (nccl_dp_) {
      if (reduced_from_ > 0) reduce_gradients(0, reduced_from_);  // what the backward left
      reduced_from_ = 0;
      nccl_dp_->synchronize();  // every reduction done before the optimizer reads gradients
    }
    double sumsq = cuda::grad_norm_squared_sync(g, range_.size(), norm_ws_, stream_.get());
    if (zero1) sumsq = mesh_.dp().sum(sumsq);
    s.grad_norm = std::sqrt(sumsq);
    if (o.grad_clip > 0 && s.grad_norm > o.grad_clip) s.clip_scale = o.grad_clip / (s.grad_norm + 1e-6);
    cuda::AdamWStepArgs args;
    args.lr = s.lr;
    args.beta1 = o.beta1;
    args.beta2 = o.beta2;
    args.eps = o.eps;
    args.weight_decay = o.weight_decay;
    args.clip_scale = s.clip_scale;
    args.step = step + 1;
    cuda::adamw_step(master_ + range_.begin, weights_ + range_.begin, m_, v_, g, range_.size(),
                     range_.begin, segments_, num_segments_, args, stream_.get());
    if (zero1 && nccl_dp_) {
      // Every rank's updated shard to every rank (in place), then the bf16 copy of the whole.
      stream_.synchronize();
      nccl_dp_->all_gather(master_ + chunk_ * mesh_.dp().rank(), master_, chunk_, DType::kF32);
      cuda::convert_f32_to_bf16(weights_, master_, padded_, stream_.get());
    }
    if (++steps_done_ == profile_end_) {
      stream_.synchronize();
      QT_CHECK_CUDA(cudaProfilerStop());
    }
    return s;
  }

  std::string memory_report() override {
    const cuda::DeviceMemory m = cuda::device_memory();
    return fmt::format("GPU arena {} used, {} peak; device {} free of {}",
                       cuda::format_bytes(arena_.used()), cuda::format_bytes(arena_.peak()),
                       cuda::format_bytes(m.free_bytes), cuda::format_bytes(m.total_bytes));
  }

 private:
  // The arena takes the GPU's free memory less kReservedBytes (called after select_device).
  static std::size_t arena_bytes() {
    const cuda::DeviceMemory m = cuda::device_memory();
    if (m.free_bytes <= kReservedBytes + (std::size_t{1} << 30))
      fail_user("the GPU has only {} free; qtrain needs more than {}",
                cuda::format_bytes(m.free_bytes), cuda::format_bytes(kReservedBytes + (1ull << 30)));
    return m.free_bytes - kReservedBytes;
  }

  // The model reports gradients at offsets >= begin final: reduce them once a bucket is full.
  void gradients_ready(std::size_t begin) {
    if (begin > 0 && reduced_from_ - begin < bucket_elems_) return;
    reduce_gradients(begin, reduced_from_);
    reduced_from_ = begin;
  }

  // Enqueues the dp reduction of grads_[lo, hi) on the NCCL stream, after the work enqueued so
  // far on the compute stream.
  void reduce_gradients(std::size_t lo, std::size_t hi) {
    if (lo >= hi) return;
    QT_CHECK_CUDA(cudaEventRecord(grads_event_.get(), stream_.get()));
    nccl_dp_->wait_event(grads_event_.get());
    const bool bf16 = reduce_stage_ != nullptr;
    void* buf = bf16 ? static_cast<void*>(reduce_stage_) : static_cast<void*>(grads_);
    const DType t = bf16 ? DType::kBF16 : DType::kF32;
    const std::size_t es = dtype_size(t);
    if (bf16)
      cuda::convert_f32_to_bf16(reduce_stage_ + lo, grads_ + lo, hi - lo, nccl_dp_->stream());
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
      cuda::convert_bf16_to_f32(grads_ + mine.begin, reduce_stage_ + mine.begin, mine.size(),
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

  const Deck& deck_;
  Mesh& mesh_;
  long steps_done_ = 0, profile_begin_ = -1, profile_end_ = -1;
  int micro_steps_ = 0, micro_steps_per_step_ = 1;
  std::size_t reduced_from_ = 0;  // grads_[reduced_from_, numel) have their reduction enqueued
  std::vector<Range> owners_;     // ZeRO-1: the flat range each dp rank updates
  std::size_t bucket_elems_ = 0;
  cuda::bf16* reduce_stage_ = nullptr;  // bf16 copy of the gradients (optim.grad_reduce = bf16)
  cuda::Event grads_event_;
  ParamLayout layout_;
  int device_;
  cuda::DeviceArena arena_;
  cuda::Stream stream_;
  std::size_t chunk_ = 0, padded_ = 0;
  Range range_;
  void* gemm_ws_ = nullptr;
  float *master_ = nullptr, *grads_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  cuda::bf16* weights_ = nullptr;
  void* norm_ws_ = nullptr;
  cuda::AdamWSegment* segments_ = nullptr;
  int num_segments_ = 0;
  std::int32_t *inputs_ = nullptr, *targets_ = nullptr;
  std::int32_t* positions_ = nullptr;  // device [B, T] RoPE positions (packing)
  std::unique_ptr<cuda::Qwen3Cuda> model_;
  std::unique_ptr<cuda::NcclComm> nccl_dp_;
  std::vector<float> host_params_, host_m_, host_v_;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_backend(const Deck& deck, Mesh& mesh) {
  if (deck.lora.enabled()) return make_cuda_lora_backend(deck, mesh);
  return std::make_unique<CudaBackend>(deck, mesh);
}

}  // namespace qt
