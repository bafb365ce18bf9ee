#include "cuda/check.h"

#include <fmt/format.h>

#include "qtrain/error.h"

namespace qt {

void fail_library(const char* library, const char* file, int line, const char* expr,
                  const char* message) {
  int device = -1;
  cudaGetDevice(&device);
  fatal_one(file, line, fmt::format("{} call failed on device {}: {}: {}", library, device, expr,
                                    message ? message : "?"));
}

}  // namespace qt
