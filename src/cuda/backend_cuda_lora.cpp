// The CUDA back end for LoRA ([lora] r > 0): the base model frozen in bf16, only the adapters
// train. What lives on the GPU:
//   base     bf16 weights only (2 bytes a parameter): no gradients, no optimizer state, no fp32
//            master copy; filled from the host's fp32 parameters through a bounded staging buffer
//   adapters fp32 master, gradients and AdamW moments (the moments sharded over dp with ZeRO-1,
//            as on the CPU) and their bf16 compute copy, in the adapter layout (PEFT's names)
//   Qwen3Cuda's activations (train.recompute as for full training) and LoraCuda's xa buffers
// The forward and backward are Qwen3Cuda's with G = null (no weight gradient of the base, no
// embedding backward). With dp > 1 the adapter gradients (small) are reduced over NCCL after the
// step's last backward: one all-reduce, fp32 or bf16 on the wire (optim.grad_reduce), whole
// (optim.reduce_bucket_mb does not apply). Then clipping and the fused AdamW over the adapters,
// with the CPU LoRA back end's weight-decay rule (each tensor's ParamInfo::weight_decay).
#include <cmath>
#include <fmt/format.h>
#include <memory>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/lora_cuda.h"
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

constexpr std::size_t kReservedBytes = std::size_t{3} << 30;    // left to NCCL, cuBLASLt, CUDA
constexpr std::size_t kStagingFloats = std::size_t{16} << 20;  // 64 MiB of fp32 base weights

class CudaLoraBackend final : public TrainBackend {
 public:
  CudaLoraBackend(const Deck& deck, Mesh& mesh)
      : deck_(deck), mesh_(mesh), layout_(deck.model),
        device_(cuda::select_device(mesh.local_rank())),
        arena_(arena_bytes(), fmt::format("GPU {} arena", device_)) {
    const int B = deck.train.micro_batch, T = deck.train.seq_len;
    gemm_ws_ = arena_.allocate(cuda::kGemmWorkspaceBytes);
    cuda::gemm_init(gemm_ws_, cuda::kGemmWorkspaceBytes);
    base_ = arena_.allocate<cuda::bf16>(layout_.numel());
    lora_ = std::make_unique<cuda::LoraCuda>(deck.model, deck.lora, B, T, arena_);
    const ParamLayout& al = lora_->layout();
    const std::size_t n = al.numel();
    const int dp = mesh.dp().size();
    chunk_ = (n + dp - 1) / dp;
    padded_ = chunk_ * dp;
    range_ = deck.optim.zero_stage == 1 ? split_range(n, dp, mesh.dp().rank()) : Range{0, n};
    master_ = arena_.allocate<float>(padded_);
    grads_ = arena_.allocate<float>(padded_);
    weights_ = arena_.allocate<cuda::bf16>(padded_);
    m_ = arena_.allocate<float>(range_.size());
    v_ = arena_.allocate<float>(range_.size());
    QT_CHECK_CUDA(cudaMemset(master_, 0, padded_ * sizeof(float)));  // the padding stays zero
    QT_CHECK_CUDA(cudaMemset(grads_, 0, padded_ * sizeof(float)));
    norm_ws_ = arena_.allocate(cuda::grad_norm_workspace_bytes());
    std::vector<cuda::AdamWSegment> segs;
    for (const ParamInfo& p : al.params())
      segs.push_back({p.offset, p.offset + p.numel, p.weight_decay ? 1 : 0});
    segments_ = arena_.allocate<cuda::AdamWSegment>(segs.size());
    num_segments_ = static_cast<int>(segs.size());
    cuda::upload(segments_, segs.data(), segs.size() * sizeof(segs[0]));
    const std::size_t tokens = static_cast<std::size_t>(B) * T;
    inputs_ = arena_.allocate<std::int32_t>(tokens);
    targets_ = arena_.allocate<std::int32_t>(tokens);
    positions_ = arena_.allocate<std::int32_t>(tokens);  // used only when packing
    model_ = std::make_unique<cuda::Qwen3Cuda>(deck.model, B, T, arena_, deck.train.recompute);
    model_->set_lora(lora_.get());
    lora_->bind(weights_, grads_);
    if (dp > 1) nccl_dp_ = std::make_unique<cuda::NcclComm>(mesh.dp(), "dp");
    if (dp > 1 && deck.optim.grad_reduce == "bf16")
      reduce_stage_ = arena_.allocate<cuda::bf16>(padded_);
    host_params_.assign(layout_.numel(), 0.0f);
    host_adapters_.assign(padded_, 0.0f);
    host_m_.assign(range_.size(), 0.0f);
    host_v_.assign(range_.size(), 0.0f);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
  }

  const ParamLayout& layout() const override { return layout_; }
  const ParamLayout& trained_layout() const override { return lora_->layout(); }
  std::string describe() const override {
    const cuda::DeviceInfo d = cuda::device_info(device_);
    return fmt::format(
        "cuda: GPU {} ({}, {} SMs), bf16 compute; LoRA: bf16 base frozen ({}, no gradients, "
        "moments or fp32 copy), {} adapter parameters trained (fp32 master, gradients and "
        "moments); arena {} ({} used after set-up)",
        device_, d.name, d.sm_count, cuda::format_bytes(layout_.numel() * 2),
        lora_->layout().numel(), cuda::format_bytes(arena_.capacity()),
        cuda::format_bytes(arena_.used()));
  }
  float* host_params() override { return host_params_.data(); }
  float* host_trained() override { return host_adapters_.data(); }
  MomentShard host_moments() override { return {range_, host_m_.data(), host_v_.data()}; }
  void set_first_sample(std::int64_t first) override { first_sample_ = first; }

  void push_state() override {
    // The base: fp32 on the host to bf16 on the GPU, one staging block at a time.
    {
      cuda::DeviceArena::Scope scope(arena_);
      const std::size_t n = layout_.numel();
      float* stage = arena_.allocate<float>(std::min(n, kStagingFloats));
      for (std::size_t lo = 0; lo < n; lo += kStagingFloats) {
        const std::size_t k = std::min(kStagingFloats, n - lo);
        cuda::upload(stage, host_params_.data() + lo, k * 4);
        cuda::convert_f32_to_bf16(base_ + lo, stage, k, stream_.get());
        stream_.synchronize();  // before the next block overwrites the staging buffer
      }
    }
    const std::size_t n = lora_->layout().numel();
    cuda::upload(master_, host_adapters_.data(), n * 4);
    cuda::upload(m_, host_m_.data(), range_.size() * 4);
    cuda::upload(v_, host_v_.data(), range_.size() * 4);
    cuda::convert_f32_to_bf16(weights_, master_, padded_, stream_.get());
    stream_.synchronize();
  }
  void pull_state() override {  // the adapters and their moments; the base never changes
    stream_.synchronize();
    const std::size_t n = lora_->layout().numel();
    QT_CHECK_CUDA(cudaMemcpy(host_adapters_.data(), master_, n * 4, cudaMemcpyDeviceToHost));
    QT_CHECK_CUDA(cudaMemcpy(host_m_.data(), m_, range_.size() * 4, cudaMemcpyDeviceToHost));
    QT_CHECK_CUDA(cudaMemcpy(host_v_.data(), v_, range_.size() * 4, cudaMemcpyDeviceToHost));
  }

  void zero_grads() override {
    QT_CHECK_CUDA(cudaMemsetAsync(grads_, 0, padded_ * sizeof(float), stream_.get()));
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
    lora_->set_dropout_key(deck_.train.seed, first_sample_);
    return model_->forward_backward(base_, nullptr, inputs_, targets_, loss_scale, stream_.get(),
                                    {}, positions ? positions_ : nullptr);
  }

  OptimStepStats optimizer_step(std::int64_t step) override {
    OptimStepStats s;
    const OptimConfig& o = deck_.optim;
    s.lr = lr_at(o, deck_.train.steps, step);
    const bool zero1 = o.zero_stage == 1;
    const std::size_t n = lora_->layout().numel();
    if (nccl_dp_) reduce_gradients(n);
    const float* g = grads_ + range_.begin;  // every rank holds the whole reduced gradient
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

  // Sums the adapter gradients grads_[0, n) over dp, in place on every rank (blocking).
  void reduce_gradients(std::size_t n) {
    stream_.synchronize();  // the backward is done before NCCL reads the gradients
    if (reduce_stage_ == nullptr) {
      nccl_dp_->all_reduce(grads_, n, DType::kF32, ReduceOp::kSum);
      return;
    }
    cuda::convert_f32_to_bf16(reduce_stage_, grads_, n, stream_.get());
    stream_.synchronize();
    nccl_dp_->all_reduce(reduce_stage_, n, DType::kBF16, ReduceOp::kSum);
    cuda::convert_bf16_to_f32(grads_, reduce_stage_, n, stream_.get());
  }

  const Deck& deck_;
  Mesh& mesh_;
  ParamLayout layout_;  // the base model's
  int device_;
  cuda::DeviceArena arena_;
  cuda::Stream stream_;
  void* gemm_ws_ = nullptr;
  cuda::bf16* base_ = nullptr;          // [numel] frozen base weights, bf16
  std::unique_ptr<cuda::LoraCuda> lora_;
  std::size_t chunk_ = 0, padded_ = 0;  // adapter elements per dp rank, and chunk_ * dp
  Range range_;                         // the adapter elements whose moments this rank holds
  float *master_ = nullptr, *grads_ = nullptr;  // [padded_] fp32 adapters and their gradients
  float *m_ = nullptr, *v_ = nullptr;           // [range_.size()] AdamW moments
  cuda::bf16* weights_ = nullptr;               // [padded_] bf16 compute copy of the adapters
  cuda::bf16* reduce_stage_ = nullptr;          // bf16 gradients (optim.grad_reduce = bf16)
  void* norm_ws_ = nullptr;
  cuda::AdamWSegment* segments_ = nullptr;
  int num_segments_ = 0;
  std::int32_t *inputs_ = nullptr, *targets_ = nullptr;
  std::int32_t* positions_ = nullptr;  // device [B, T] RoPE positions (packing)
  std::unique_ptr<cuda::Qwen3Cuda> model_;
  std::unique_ptr<cuda::NcclComm> nccl_dp_;
  std::int64_t first_sample_ = 0;
  std::vector<float> host_params_;  // [numel] the fp32 base as loaded (host only)
  std::vector<float> host_adapters_, host_m_, host_v_;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_lora_backend(const Deck& deck, Mesh& mesh) {
  return std::make_unique<CudaLoraBackend>(deck, mesh);
}

}  // namespace qt
