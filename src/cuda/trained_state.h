// What both CUDA back ends (full training, backend_cuda.cpp; LoRA, backend_cuda_lora.cpp) hold
// for the parameters they train, one flat buffer of a ParamLayout (the model's, or the adapters'):
// fp32 master weights, fp32 gradients and the bf16 compute copy, each padded to a multiple of dp
// (the padding stays zero), AdamW moments of this rank's range (everything, or its ZeRO-1 shard),
// host copies for initialisation and checkpoints, and the clip + fused AdamW step. Also the
// device buffers of a micro-batch and the arena sizing both back ends share.
#pragma once

#include <cstdint>
#include <memory>
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
  // Zeroes the gradients on `s`, unless the overlapped update already zeroes them.
  void zero_grads(cudaStream_t s);

  // Overlapped update. With pieces set (ascending flat offsets, the last numel(): e.g. the
  // embedding, each layer, the final norm and lm head), step() enqueues the update piece by
  // piece on a low-priority stream of its own, each piece followed by the zeroing of its
  // gradients, and returns without waiting for it. Before the next forward reads weights at
  // offsets below `end`, it calls wait_weights(end, s): `s` waits (on the GPU) for the pieces
  // that start below `end`. So the update of later layers runs beside the forward of earlier
  // ones, with the same results. Only where this rank updates every element (not a ZeRO-1 shard
  // of dp > 1: its all-gather needs the whole update first); push() and pull() wait for it.
  void overlap_update(std::vector<std::size_t> piece_ends);
  void wait_weights(std::size_t end, cudaStream_t s);

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
  // The overlapped update: piece i is [piece_ends_[i - 1], piece_ends_[i]); pieces >= waited_
  // of the last step have not yet been waited for by the compute stream.
  std::vector<std::size_t> piece_ends_;
  std::vector<std::unique_ptr<Event>> piece_done_;
  std::size_t waited_ = 0;
  bool grads_zeroed_ = false;  // the last step's pieces zero the gradients
  Stream update_stream_{Stream::kLow};
  Event norm_done_;
  void finish_update();  // the host waits for the overlapped update
};

// Device copies of one micro-batch's inputs, targets and positions ([B, T] int32 each).
class BatchBuffers {
 public:
  BatchBuffers(int B, int T, DeviceArena& arena);
  const std::int32_t* inputs() const { return inputs_; }
  const std::int32_t* targets() const { return targets_; }
  // Enqueues the host -> device copies on `s`; returns the device positions, or null when
  // `positions` is null (plain causal).
  const std::int32_t* upload(const std::int32_t* inputs, const std::int32_t* targets,
                             const std::int32_t* positions, cudaStream_t s);

 private:
  std::size_t bytes_;
  std::int32_t *inputs_, *targets_, *positions_;
};

// The arena's size: the GPU's free memory less `reserved` (for NCCL, cuBLASLt and CUDA); a
// UserError when less than 1 GiB would be left. Call after select_device.
std::size_t arena_bytes_leaving(std::size_t reserved);
// "GPU arena X used, Y peak; device Z free of W" for the step log.
std::string memory_report(const DeviceArena& arena);

}  // namespace qt::cuda
