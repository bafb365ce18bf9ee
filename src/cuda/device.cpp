// Devices, streams, events and the device arena.
#include "cuda/device.h"

#include <fmt/format.h>

#include <algorithm>

#include "cuda/check.h"
#include "ops/cuda/convert.cuh"
#include "qtrain/error.h"
#include "runtime/process.h"

namespace qt::cuda {

std::string format_bytes(std::size_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (std::size_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (bytes >= (std::size_t{1} << 20)) return fmt::format("{:.1f} MiB", b / (1 << 20));
  if (bytes >= (std::size_t{1} << 10)) return fmt::format("{:.1f} KiB", b / (1 << 10));
  return fmt::format("{} B", bytes);
}

int select_device(int local_rank) {
  if (local_rank < 0) fail_user("select_device: local rank {} is negative", local_rank);
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    const char* why = rc != cudaSuccess ? cudaGetErrorString(rc) : "device count is 0";
    cudaGetLastError();  // clear the error: the caller may report it and carry on
    fail_user("the CUDA back end needs a GPU, but none is visible on host {} ({}); "
              "check CUDA_VISIBLE_DEVICES and the driver",
              host_name(), why);
  }
  const int device = local_rank % count;
  QT_CHECK_CUDA(cudaSetDevice(device));
  return device;
}

DeviceInfo device_info(int device) {
  if (device < 0) QT_CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp p{};
  QT_CHECK_CUDA(cudaGetDeviceProperties(&p, device));
  DeviceInfo info;
  info.index = device;
  info.name = p.name;
  info.sm_count = p.multiProcessorCount;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.total_bytes = p.totalGlobalMem;
  info.l2_bytes = static_cast<std::size_t>(p.l2CacheSize);
  return info;
}

DeviceMemory device_memory() {
  DeviceMemory m;
  QT_CHECK_CUDA(cudaMemGetInfo(&m.free_bytes, &m.total_bytes));
  return m;
}

// ---- DeviceBuffer --------------------------------------------------------------------------------

DeviceBuffer::DeviceBuffer(std::size_t bytes, const std::string& what) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t rc = cudaMalloc(&ptr_, bytes);
  if (rc == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear it: the caller may carry on with a smaller request
    ptr_ = nullptr;
    std::size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    int dev = -1;
    cudaGetDevice(&dev);
    throw OutOfMemory(fmt::format("{}: cudaMalloc of {} ({} bytes) failed on device {}: {} free of {}",
                                  what, format_bytes(bytes), bytes, dev, format_bytes(free_b),
                                  format_bytes(total_b)));
  }
  QT_CHECK_CUDA(rc);
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);  // no check: destructors must not abort during unwinding
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

// ---- DeviceArena ---------------------------------------------------------------------------------

DeviceArena::DeviceArena(std::size_t capacity_bytes, std::string name)
    : name_(std::move(name)),
      buffer_(round_up(capacity_bytes, kAlignment), "device arena '" + name_ + "'") {}

void* DeviceArena::allocate(std::size_t bytes) {
  // Compare before rounding, so a huge request cannot wrap around.
  if (bytes > available() || round_up(bytes, kAlignment) > available()) {
    throw OutOfMemory(fmt::format(
        "device arena '{}' is out of memory: asked for {} ({} bytes) with {} of {} in use "
        "({} free, peak {})",
        name_, format_bytes(bytes), bytes, format_bytes(used_), format_bytes(capacity()),
        format_bytes(available()), format_bytes(peak_)));
  }
  void* p = static_cast<char*>(buffer_.get()) + used_;
  used_ += round_up(bytes, kAlignment);
  if (used_ > peak_) peak_ = used_;
  return p;
}

void DeviceArena::release(std::size_t m) {
  if (m > used_) {
    throw std::logic_error(fmt::format(
        "device arena '{}': release to mark {} beyond the current offset {} (stale mark?)", name_,
        m, used_));
  }
  used_ = m;
}

bool DeviceArena::owns(const void* p) const {
  const char* base = static_cast<const char*>(buffer_.get());
  const char* c = static_cast<const char*>(p);
  return base != nullptr && c >= base && c < base + capacity();
}

void DeviceArena::overflow(std::size_t count, std::size_t elem) const {
  throw OutOfMemory(fmt::format("device arena '{}': {} elements of {} bytes overflow size_t", name_,
                                count, elem));
}

// ---- Stream and Event ----------------------------------------------------------------------------

PinnedBuffer::PinnedBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes > 0) QT_CHECK_CUDA(cudaHostAlloc(&ptr_, bytes, cudaHostAllocDefault));
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void upload(void* dst, const void* src, std::size_t bytes) {
  QT_CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  QT_CHECK_CUDA(cudaDeviceSynchronize());
}

void upload_as_bf16(__nv_bfloat16* dst, const float* src, std::size_t n, DeviceArena& arena,
                    cudaStream_t stream) {
  DeviceArena::Scope scope(arena);
  float* stage = arena.allocate<float>(std::min(n, kUploadStageFloats));
  for (std::size_t lo = 0; lo < n; lo += kUploadStageFloats) {
    const std::size_t k = std::min(kUploadStageFloats, n - lo);
    upload(stage, src + lo, k * sizeof(float));
    convert_f32_to_bf16(dst + lo, stage, k, stream);
    QT_CHECK_CUDA(cudaStreamSynchronize(stream));  // before the next block overwrites the stage
  }
}

Stream::Stream() { QT_CHECK_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
Stream::~Stream() {
  if (s_ != nullptr) cudaStreamDestroy(s_);
}
void Stream::synchronize() const { QT_CHECK_CUDA(cudaStreamSynchronize(s_)); }

Event::Event(bool timing) {
  QT_CHECK_CUDA(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
}
Event::~Event() {
  if (e_ != nullptr) cudaEventDestroy(e_);
}
void Event::record(cudaStream_t s) const { QT_CHECK_CUDA(cudaEventRecord(e_, s)); }
void Event::synchronize() const { QT_CHECK_CUDA(cudaEventSynchronize(e_)); }
float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0.f;
  QT_CHECK_CUDA(cudaEventElapsedTime(&ms, start.e_, e_));
  return ms;
}

}  // namespace qt::cuda
