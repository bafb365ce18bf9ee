// Error check for cuBLAS / cuBLASLt calls (host code only). On failure: file:line, the expression,
// cuBLASLt's status name and text, rank, host and device, then every rank is aborted.
#pragma once

#include <cublasLt.h>

#include "cuda/check.h"

#define QT_CHECK_CUBLAS(expr)                                                      \
  do {                                                                             \
    cublasStatus_t qt_cublas_rc_ = (expr);                                         \
    if (qt_cublas_rc_ != CUBLAS_STATUS_SUCCESS)                                    \
      ::qt::fail_library("cuBLASLt", __FILE__, __LINE__, #expr,                    \
                         cublasLtGetStatusString(qt_cublas_rc_));                  \
  } while (0)
