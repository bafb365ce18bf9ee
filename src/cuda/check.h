// Error checks for the CUDA runtime, usable from .cu files (no fmt here: fmt does not compile under
// nvcc in C++20 mode). On failure: file:line, the expression, the library's message, rank and host,
// then every rank is aborted (one rank saw it).
#pragma once

#include <cuda_runtime_api.h>

namespace qt {
[[noreturn]] void fail_library(const char* library, const char* file, int line, const char* expr,
                               const char* message);
}  // namespace qt

#define QT_CHECK_CUDA(expr)                                                          \
  do {                                                                               \
    cudaError_t qt_cuda_rc_ = (expr);                                                \
    if (qt_cuda_rc_ != cudaSuccess)                                                  \
      ::qt::fail_library("CUDA", __FILE__, __LINE__, #expr, cudaGetErrorString(qt_cuda_rc_)); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define QT_CHECK_LAUNCH() QT_CHECK_CUDA(cudaGetLastError())
