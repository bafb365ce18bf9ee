// Devices, streams, events and device memory of the CUDA back end (host code).
//
// Memory strategy: one DeviceArena per rank takes one large cudaMalloc at start-up and hands out
// 256-byte-aligned blocks by bumping an offset; per-step scratch is freed by releasing to a mark.
// Nothing in the step loop calls cudaMalloc. DeviceBuffer is for the few small set-up allocations
// that live outside the arena (the arena's own block, a communicator's scratch word).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace qt::cuda {

// Selects this rank's GPU, local_rank % device count (the ranks of a node share its GPUs round
// robin), makes it current and returns its index. Throws qt::UserError when no GPU is visible.
int select_device(int local_rank);

struct DeviceInfo {
  int index = -1;
  std::string name;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  std::size_t total_bytes = 0;
  std::size_t l2_bytes = 0;
};
// Properties of `device`, or of the current device when -1.
DeviceInfo device_info(int device = -1);

// Free and total memory of the current device (cudaMemGetInfo), for the step log.
struct DeviceMemory {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};
DeviceMemory device_memory();

// n rounded up to a multiple of a (a > 0): block sizes and offsets of device buffers.
inline std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

// "1.50 GiB", "256.0 KiB", "17 B": for log lines and error messages.
std::string format_bytes(std::size_t bytes);

// Thrown when the arena (or the cudaMalloc behind a DeviceBuffer) cannot satisfy a request. The
// message names the arena, the request and the state; the arena is unchanged and stays usable.
class OutOfMemory : public std::runtime_error {
 public:
  explicit OutOfMemory(const std::string& msg) : std::runtime_error(msg) {}
};

// One cudaMalloc'd block, freed on destruction. For set-up time only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Throws OutOfMemory (naming `what`) when the device has too little memory.
  DeviceBuffer(std::size_t bytes, const std::string& what);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Bump allocator over one DeviceBuffer. Every block starts at a multiple of kAlignment bytes from
// the (cudaMalloc-aligned) base and its size is rounded up to kAlignment. Not thread-safe.
//   weights = arena.allocate<bf16>(n);          // lives until the arena dies
//   { DeviceArena::Scope s(arena); ... }         // per-step scratch, released at scope end
class DeviceArena {
 public:
  static constexpr std::size_t kAlignment = 256;

  // Takes `capacity_bytes` (rounded up to kAlignment) from the current device at once.
  DeviceArena(std::size_t capacity_bytes, std::string name = "device arena");
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // A block of `bytes` (0 gives a valid pointer to an empty block). Throws OutOfMemory.
  void* allocate(std::size_t bytes);
  template <typename T>
  T* allocate(std::size_t count) {
    if (count > static_cast<std::size_t>(-1) / sizeof(T)) overflow(count, sizeof(T));
    return static_cast<T*>(allocate(count * sizeof(T)));
  }

  // A mark is the current offset; release(m) frees every block allocated after mark() returned m.
  std::size_t mark() const { return used_; }
  // Throws std::logic_error when m is past the current offset (released twice, or a stale mark).
  void release(std::size_t m);

  std::size_t used() const { return used_; }          // bytes in use, alignment padding included
  std::size_t peak() const { return peak_; }          // highest used() since creation/reset_peak
  std::size_t capacity() const { return buffer_.bytes(); }
  std::size_t available() const { return capacity() - used_; }
  void reset_peak() { peak_ = used_; }
  const std::string& name() const { return name_; }
  // True when p points into this arena's block.
  bool owns(const void* p) const;

  // Releases to the mark taken at construction when it goes out of scope.
  class Scope {
   public:
    explicit Scope(DeviceArena& a) : arena_(a), mark_(a.mark()) {}
    ~Scope() { arena_.release(mark_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    DeviceArena& arena_;
    std::size_t mark_;
  };

 private:
  [[noreturn]] void overflow(std::size_t count, std::size_t elem) const;

  std::string name_;
  DeviceBuffer buffer_;
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
};

// Hands out a list of blocks from an arena, or (arena null) only counts their bytes (aligned as
// the arena aligns them), so an arena's size and the blocks carved from it come from one list.
class ArenaCarver {
 public:
  explicit ArenaCarver(DeviceArena* arena) : arena_(arena) {}
  template <typename T>
  T* take(std::size_t count) {
    bytes_ += round_up(count * sizeof(T), DeviceArena::kAlignment);
    return arena_ != nullptr ? arena_->allocate<T>(count) : nullptr;
  }
  bool counting() const { return arena_ == nullptr; }
  std::size_t bytes() const { return bytes_; }

 private:
  DeviceArena* arena_;
  std::size_t bytes_ = 0;
};

// Copies `bytes` of host memory to the device and returns once they have landed. A plain
// cudaMemcpy from pageable memory may return before its DMA completes, and work on our
// non-blocking streams is not ordered after it: set-up copies go through this. Not for the step loop.
void upload(void* dst, const void* src, std::size_t bytes);

// fp32 values staged per upload_as_bf16 call: 64 MiB.
constexpr std::size_t kUploadStageFloats = std::size_t{16} << 20;

// dst[k] = bf16(src[k]) for k < n (round to nearest even): host fp32 to device bf16 through a
// staging block of min(n, kUploadStageFloats) fp32 taken from `arena` and released on return.
// Set-up time only: waits for `stream` after each block.
void upload_as_bf16(__nv_bfloat16* dst, const float* src, std::size_t n, DeviceArena& arena,
                    cudaStream_t stream);

// Page-locked host memory (cudaHostAlloc), for copies that overlap with other work.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// A CUDA stream, created non-blocking with respect to the legacy default stream.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }
  void synchronize() const;

 private:
  cudaStream_t s_ = nullptr;
};

// A CUDA event; timing events measure elapsed milliseconds, the others only order streams.
class Event {
 public:
  explicit Event(bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }
  void record(cudaStream_t s) const;
  void synchronize() const;
  // Milliseconds from `start` to this event (both timing events, both completed).
  float elapsed_ms_since(const Event& start) const;

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace qt::cuda
