// See training_buffers.h.
#include "cuda/training_buffers.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <thread>

#include "cuda/check.h"
#include "qtrain/error.h"

namespace qt::cuda {

double CudaTrainBackend::eval_loss(const MicroBatches& mb) {
  const double loss = TrainBackend::eval_loss(mb);
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  return loss;
}

unsigned offload_threads(const Mesh& mesh) {
  const unsigned all = std::max(1u, std::thread::hardware_concurrency());
  unsigned cpus = all;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = static_cast<unsigned>(CPU_COUNT(&set));
  if (cpus >= all && mesh.local_size() > 1) cpus /= static_cast<unsigned>(mesh.local_size());
  return std::clamp(cpus, 1u, 64u);
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
