// What every CUDA training back end shares besides its optimizer state (cuda/sharded_state_cuda.h):
// a base class, the device buffers of a micro-batch and the arena's sizing and report.
#pragma once

#include <cstdint>
#include <string>

#include "cuda/device.h"
#include "qtrain/mesh.h"
#include "train/backend.h"

namespace qt::cuda {

// The CUDA training back ends' base (backend_cuda*.cpp).
class CudaTrainBackend : public TrainBackend {
 public:
  // TrainBackend's default (a forward and backward with loss scale 0 between zero_grads), then
  // every stream of the device drained: the last micro-batch's gradient reductions run on the
  // communicators' streams, which the next step's first backward, overwriting the gradients,
  // does not wait for.
  double eval_loss(const MicroBatches& mb) override;
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
// Host threads for offload's AdamW: the CPUs this rank may run on; ranks left unbound (mpirun
// --bind-to none) each see the whole node and share it.
unsigned offload_threads(const Mesh& mesh);
// "GPU arena X used, Y peak; device Z free of W" for the step log.
std::string memory_report(const DeviceArena& arena);

}  // namespace qt::cuda
