// Helpers for GPU tests: skip with a message where no GPU is present, and guarded device buffers
// that catch out-of-bounds writes (sentinel bytes after every output).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"

namespace qt::test {

inline bool gpu_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the error before carrying on without a GPU
    return false;
  }
  return n > 0;
}

// bf16 bit patterns on the host: round to nearest even (finite inputs), and back (exact).
inline std::uint16_t bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
inline float bf16_value(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#define QT_REQUIRE_GPU()                                                   \
  do {                                                                     \
    if (!::qt::test::gpu_available()) GTEST_SKIP() << "no CUDA GPU present"; \
  } while (0)

// Skips the test unless at least n GPUs are visible.
#define QT_REQUIRE_GPUS(n)                                                           \
  do {                                                                               \
    int gpus_ = 0;                                                                   \
    if (cudaGetDeviceCount(&gpus_) != cudaSuccess || gpus_ < (n)) {                  \
      cudaGetLastError();                                                            \
      GTEST_SKIP() << "needs " << (n) << " GPUs, found " << gpus_;                   \
    }                                                                                \
  } while (0)

// A device buffer of n elements of T followed by kGuard sentinel bytes.
template <typename T>
class GuardedBuffer {
 public:
  static constexpr std::size_t kGuard = 256;
  static constexpr unsigned char kSentinel = 0xA5;
  explicit GuardedBuffer(std::size_t n) : n_(n) {
    QT_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&ptr_), bytes() + kGuard));
    QT_CHECK_CUDA(cudaMemset(ptr_, 0, bytes()));
    QT_CHECK_CUDA(cudaMemset(reinterpret_cast<char*>(ptr_) + bytes(), kSentinel, kGuard));
    QT_CHECK_CUDA(cudaDeviceSynchronize());  // cudaMemset is asynchronous: order it before any stream
  }
  explicit GuardedBuffer(const std::vector<T>& host) : GuardedBuffer(host.size()) { upload(host); }
  ~GuardedBuffer() { cudaFree(ptr_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  T* get() { return ptr_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  void upload(const std::vector<T>& host) {
    qt::cuda::upload(ptr_, host.data(), bytes());
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    QT_CHECK_CUDA(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  // True when the guard bytes after the data are untouched.
  bool guard_intact() const {
    std::vector<unsigned char> g(kGuard);
    QT_CHECK_CUDA(cudaMemcpy(g.data(), reinterpret_cast<const char*>(ptr_) + bytes(), kGuard,
                             cudaMemcpyDeviceToHost));
    for (unsigned char c : g)
      if (c != kSentinel) return false;
    return true;
  }

 private:
  T* ptr_ = nullptr;
  std::size_t n_;
};

}  // namespace qt::test
