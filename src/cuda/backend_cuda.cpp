// The CUDA back end: fp32 master weights, gradients and AdamW moments on the GPU, a bf16 compute
// copy of the weights, Qwen3Cuda for forward and backward, NCCL over dp, AdamW fused on the GPU.
//
// Memory: one DeviceArena per rank takes the GPU's free memory less a margin for NCCL and cuBLASLt
// at start-up; every buffer comes from it, so the step loop never calls cudaMalloc.
#include <cmath>
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
    if (deck.train.recompute)
      fail_user("train.recompute = true is not built yet for train.device = cuda; set it to false");
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
    shard_ = arena_.allocate<float>(chunk_);
    norm_ws_ = arena_.allocate(cuda::grad_norm_workspace_bytes());
    std::vector<cuda::AdamWSegment> segs;
    for (const ParamInfo& p : layout_.params())
      segs.push_back({p.offset, p.offset + p.numel, p.weight_decay ? 1 : 0});
    segments_ = arena_.allocate<cuda::AdamWSegment>(segs.size());
    num_segments_ = static_cast<int>(segs.size());
    QT_CHECK_CUDA(cudaMemcpy(segments_, segs.data(), segs.size() * sizeof(segs[0]),
                             cudaMemcpyHostToDevice));
    QT_CHECK_CUDA(cudaMemset(master_, 0, padded_ * sizeof(float)));
    QT_CHECK_CUDA(cudaMemset(m_, 0, range_.size() * sizeof(float)));
    QT_CHECK_CUDA(cudaMemset(v_, 0, range_.size() * sizeof(float)));
    const std::size_t tokens = static_cast<std::size_t>(deck.train.micro_batch) * deck.train.seq_len;
    inputs_ = arena_.allocate<std::int32_t>(tokens);
    targets_ = arena_.allocate<std::int32_t>(tokens);
    model_ = std::make_unique<cuda::Qwen3Cuda>(deck.model, deck.train.micro_batch,
                                               deck.train.seq_len, arena_);
    if (dp > 1) nccl_dp_ = std::make_unique<cuda::NcclComm>(mesh.dp(), "dp");
    host_params_.assign(padded_, 0.0f);
    host_m_.assign(range_.size(), 0.0f);
    host_v_.assign(range_.size(), 0.0f);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
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
    QT_CHECK_CUDA(cudaMemcpy(master_, host_params_.data(), n * 4, cudaMemcpyHostToDevice));
    QT_CHECK_CUDA(cudaMemcpy(m_, host_m_.data(), range_.size() * 4, cudaMemcpyHostToDevice));
    QT_CHECK_CUDA(cudaMemcpy(v_, host_v_.data(), range_.size() * 4, cudaMemcpyHostToDevice));
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
    QT_CHECK_CUDA(cudaMemsetAsync(grads_, 0, padded_ * sizeof(float), stream_.get()));
  }

  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    float loss_scale) override {
    const std::size_t bytes =
        static_cast<std::size_t>(deck_.train.micro_batch) * deck_.train.seq_len * 4;
    QT_CHECK_CUDA(cudaMemcpyAsync(inputs_, inputs, bytes, cudaMemcpyHostToDevice, stream_.get()));
    QT_CHECK_CUDA(cudaMemcpyAsync(targets_, targets, bytes, cudaMemcpyHostToDevice, stream_.get()));
    return model_->forward_backward(weights_, grads_, inputs_, targets_, loss_scale, stream_.get());
  }

  OptimStepStats optimizer_step(std::int64_t step) override {
    OptimStepStats s;
    const OptimConfig& o = deck_.optim;
    s.lr = lr_at(o, deck_.train.steps, step);
    const bool zero1 = o.zero_stage == 1;
    const float* g = grads_ + range_.begin;
    stream_.synchronize();  // gradients complete before NCCL reads them
    if (zero1 && nccl_dp_) {
      nccl_dp_->reduce_scatter(grads_, shard_, chunk_, DType::kF32, ReduceOp::kSum);
      g = shard_;
    } else if (nccl_dp_) {
      nccl_dp_->all_reduce(grads_, layout_.numel(), DType::kF32, ReduceOp::kSum);
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

  const Deck& deck_;
  Mesh& mesh_;
  ParamLayout layout_;
  int device_;
  cuda::DeviceArena arena_;
  cuda::Stream stream_;
  std::size_t chunk_ = 0, padded_ = 0;
  Range range_;
  void* gemm_ws_ = nullptr;
  float *master_ = nullptr, *grads_ = nullptr, *m_ = nullptr, *v_ = nullptr, *shard_ = nullptr;
  cuda::bf16* weights_ = nullptr;
  void* norm_ws_ = nullptr;
  cuda::AdamWSegment* segments_ = nullptr;
  int num_segments_ = 0;
  std::int32_t *inputs_ = nullptr, *targets_ = nullptr;
  std::unique_ptr<cuda::Qwen3Cuda> model_;
  std::unique_ptr<cuda::NcclComm> nccl_dp_;
  std::vector<float> host_params_, host_m_, host_v_;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_backend(const Deck& deck, Mesh& mesh) {
  return std::make_unique<CudaBackend>(deck, mesh);
}

}  // namespace qt
