// The trained parameters of a CUDA back end on the GPU, and what both back ends share (see
// trained_state.h).
#include "cuda/trained_state.h"

#include <cmath>
#include <fmt/format.h>

#include "cuda/check.h"
#include "ops/cuda/convert.cuh"
#include "optim/schedule.h"
#include "qtrain/error.h"

namespace qt::cuda {

TrainedState::TrainedState(const ParamLayout& layout, const MpiComm& dp, bool zero1,
                           DeviceArena& arena)
    : numel_(layout.numel()), zero1_(zero1), dp_rank_(dp.rank()) {
  chunk_ = (numel_ + dp.size() - 1) / dp.size();
  padded_ = chunk_ * dp.size();
  range_ = zero1 ? split_range(numel_, dp.size(), dp.rank()) : Range{0, numel_};
  master_ = arena.allocate<float>(padded_);
  weights_ = arena.allocate<bf16>(padded_);
  grads_ = arena.allocate<float>(padded_);
  m_ = arena.allocate<float>(range_.size());
  v_ = arena.allocate<float>(range_.size());
  norm_ws_ = arena.allocate(grad_norm_workspace_bytes());
  std::vector<AdamWSegment> segs;
  for (const ParamInfo& p : layout.params())
    segs.push_back({p.offset, p.offset + p.numel, p.weight_decay ? 1 : 0});
  segments_ = arena.allocate<AdamWSegment>(segs.size());
  num_segments_ = static_cast<int>(segs.size());
  upload(segments_, segs.data(), segs.size() * sizeof(segs[0]));
  QT_CHECK_CUDA(cudaMemset(master_, 0, padded_ * sizeof(float)));  // the padding stays zero
  QT_CHECK_CUDA(cudaMemset(grads_, 0, padded_ * sizeof(float)));
  QT_CHECK_CUDA(cudaMemset(m_, 0, range_.size() * sizeof(float)));
  QT_CHECK_CUDA(cudaMemset(v_, 0, range_.size() * sizeof(float)));
  host_params_.assign(padded_, 0.0f);
  host_m_.assign(range_.size(), 0.0f);
  host_v_.assign(range_.size(), 0.0f);
}

void TrainedState::push(cudaStream_t s) {
  upload(master_, host_params_.data(), numel_ * 4);
  upload(m_, host_m_.data(), range_.size() * 4);
  upload(v_, host_v_.data(), range_.size() * 4);
  convert_f32_to_bf16(weights_, master_, padded_, s);
  QT_CHECK_CUDA(cudaStreamSynchronize(s));
}

void TrainedState::pull(cudaStream_t s) {
  QT_CHECK_CUDA(cudaStreamSynchronize(s));
  QT_CHECK_CUDA(cudaMemcpy(host_params_.data(), master_, numel_ * 4, cudaMemcpyDeviceToHost));
  QT_CHECK_CUDA(cudaMemcpy(host_m_.data(), m_, range_.size() * 4, cudaMemcpyDeviceToHost));
  QT_CHECK_CUDA(cudaMemcpy(host_v_.data(), v_, range_.size() * 4, cudaMemcpyDeviceToHost));
}

MemorySplit TrainedState::bytes() const {
  MemorySplit b;
  b.params = 2.0 * static_cast<double>(padded_);
  b.grads = 4.0 * static_cast<double>(padded_);
  b.optimizer = 4.0 * static_cast<double>(padded_) + 8.0 * static_cast<double>(range_.size()) +
                static_cast<double>(grad_norm_workspace_bytes()) +
                static_cast<double>(num_segments_ * sizeof(AdamWSegment));
  return b;
}

void TrainedState::zero_grads(cudaStream_t s) {
  QT_CHECK_CUDA(cudaMemsetAsync(grads_, 0, padded_ * sizeof(float), s));
}

OptimStepStats TrainedState::step(const OptimConfig& o, std::int64_t total_steps,
                                  std::int64_t step, MpiComm& dp, NcclComm* nccl,
                                  cudaStream_t s) {
  OptimStepStats st;
  st.lr = lr_at(o, total_steps, step);
  const float* g = grads_ + range_.begin;  // with ZeRO-1, this rank's reduced shard
  double sumsq = grad_norm_squared_sync(g, range_.size(), norm_ws_, s);
  if (zero1_) sumsq = dp.sum(sumsq);
  st.grad_norm = std::sqrt(sumsq);
  if (o.grad_clip > 0 && st.grad_norm > o.grad_clip) st.clip_scale = o.grad_clip / (st.grad_norm + 1e-6);
  AdamWStepArgs args;
  args.lr = st.lr;
  args.beta1 = o.beta1;
  args.beta2 = o.beta2;
  args.eps = o.eps;
  args.weight_decay = o.weight_decay;
  args.clip_scale = st.clip_scale;
  args.step = step + 1;
  adamw_step(master_ + range_.begin, weights_ + range_.begin, m_, v_, g, range_.size(),
             range_.begin, segments_, num_segments_, args, s);
  if (zero1_ && nccl != nullptr) {
    // Every rank's updated shard to every rank (in place), then the bf16 copy of the whole.
    QT_CHECK_CUDA(cudaStreamSynchronize(s));
    nccl->all_gather(master_ + chunk_ * dp_rank_, master_, chunk_, DType::kF32);
    convert_f32_to_bf16(weights_, master_, padded_, s);
  }
  return st;
}

BatchBuffers::BatchBuffers(int B, int T, DeviceArena& arena)
    : bytes_(static_cast<std::size_t>(B) * T * sizeof(std::int32_t)) {
  const std::size_t tokens = static_cast<std::size_t>(B) * T;
  inputs_ = arena.allocate<std::int32_t>(tokens);
  targets_ = arena.allocate<std::int32_t>(tokens);
  positions_ = arena.allocate<std::int32_t>(tokens);  // used only when packing
}

const std::int32_t* BatchBuffers::upload(const std::int32_t* inputs, const std::int32_t* targets,
                                         const std::int32_t* positions, cudaStream_t s) {
  QT_CHECK_CUDA(cudaMemcpyAsync(inputs_, inputs, bytes_, cudaMemcpyHostToDevice, s));
  QT_CHECK_CUDA(cudaMemcpyAsync(targets_, targets, bytes_, cudaMemcpyHostToDevice, s));
  if (positions == nullptr) return nullptr;
  QT_CHECK_CUDA(cudaMemcpyAsync(positions_, positions, bytes_, cudaMemcpyHostToDevice, s));
  return positions_;
}

std::size_t training_arena_bytes() {
  constexpr std::size_t reserved = std::size_t{3} << 30;
  const DeviceMemory m = device_memory();
  if (m.free_bytes <= reserved + (std::size_t{1} << 30))
    fail_user("the GPU has only {} free; qtrain needs more than {}", format_bytes(m.free_bytes),
              format_bytes(reserved + (std::size_t{1} << 30)));
  return m.free_bytes - reserved;
}

std::string memory_report(const DeviceArena& arena) {
  const DeviceMemory m = device_memory();
  return fmt::format("GPU arena {} used, {} peak; device {} free of {}", format_bytes(arena.used()),
                     format_bytes(arena.peak()), format_bytes(m.free_bytes),
                     format_bytes(m.total_bytes));
}

}  // namespace qt::cuda
