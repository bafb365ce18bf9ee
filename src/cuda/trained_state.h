// What both CUDA back ends (full training, backend_cuda.cpp; LoRA, backend_cuda_lora.cpp) hold
// for the parameters they train, one flat buffer of a ParamLayout (the model's, or the adapters'):
// fp32 master weights, fp32 gradients and the bf16 compute copy, each padded to a multiple of dp
// (the padding stays zero), AdamW moments of this rank's range (everything, or its ZeRO-1 shard),
// host copies for initialisation and checkpoints, and the clip + fused AdamW step. Also the
// device buffers of a micro-batch and the arena sizing both back ends share.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "ops/cuda/adamw.cuh"
#include "optim/optimizer.h"
#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/params.h"
#include "runtime/memory.h"

namespace qt::cuda {

class TrainedState {
 public:
  // From `arena`, for the dp group `dp`; zero1: moments only of split_range(numel, dp, rank).
  TrainedState(const ParamLayout& layout, const MpiComm& dp, bool zero1, DeviceArena& arena);

  std::size_t numel() const { return numel_; }
  std::size_t chunk() const { return chunk_; }    // elements per dp rank
  std::size_t padded() const { return padded_; }  // chunk() * dp
  const Range& range() const { return range_; }   // the elements whose moments this rank holds
  float* master() { return master_; }             // [padded]
  float* grads() { return grads_; }               // [padded]
  bf16* weights() { return weights_; }            // [padded]

  float* host_params() { return host_params_.data(); }  // [padded]
  MomentShard host_moments() { return {range_, host_m_.data(), host_v_.data()}; }
  // Host -> device (master weights and moments), then the bf16 copy; synchronises `s`.
  void push(cudaStream_t s);
  // Device -> host (after synchronising `s`).
  void pull(cudaStream_t s);
  void zero_grads(cudaStream_t s);
  // Its device buffers by kind (activations and workspace left at 0).
  MemorySplit bytes() const;

  // The optimizer step on gradients already reduced over dp (grads()[range()] final): the
  // global norm (summed over dp with ZeRO-1), clipping at o.grad_clip, the fused AdamW of
  // range(), and with ZeRO-1 and `nccl` the all-gather of every rank's shard and the bf16 copy.
  OptimStepStats step(const OptimConfig& o, std::int64_t total_steps, std::int64_t step,
                      MpiComm& dp, NcclComm* nccl, cudaStream_t s);

 private:
  std::size_t numel_, chunk_, padded_;
  Range range_;
  bool zero1_;
  int dp_rank_;
  float *master_, *grads_, *m_, *v_;
  bf16* weights_;
  void* norm_ws_;
  AdamWSegment* segments_;
  int num_segments_;
  std::vector<float> host_params_, host_m_, host_v_;
};

// Device copies of one micro-batch's inputs, targets and positions ([B, T] int32 each).
class BatchBuffers {
 public:
  BatchBuffers(int B, int T, DeviceArena& arena);
  const std::int32_t* inputs() const { return inputs_; }
  const std::int32_t* targets() const { return targets_; }
  double bytes() const { return 3.0 * static_cast<double>(bytes_); }  // inputs, targets, positions
  // Enqueues the host -> device copies on `s`; returns the device positions, or null when
  // `positions` is null (plain causal).
  const std::int32_t* upload(const std::int32_t* inputs, const std::int32_t* targets,
                             const std::int32_t* positions, cudaStream_t s);

 private:
  std::size_t bytes_;
  std::int32_t *inputs_, *targets_, *positions_;
};

// A training back end's arena: the GPU's free memory less 3 GiB left to NCCL, cuBLASLt and CUDA;
// a UserError when less than 1 GiB would be left. Call after select_device.
std::size_t training_arena_bytes();
// "GPU arena X used, Y peak; device Z free of W" for the step log.
std::string memory_report(const DeviceArena& arena);

}  // namespace qt::cuda
