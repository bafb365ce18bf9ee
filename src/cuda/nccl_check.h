// Error check for NCCL calls that must succeed at once (ncclSuccess only; a non-blocking
// communicator's ncclInProgress is handled by NcclComm, not here). On failure: file:line, the
// expression, NCCL's message, rank, host and device, then every rank is aborted.
#pragma once

#include <nccl.h>

#include "cuda/check.h"

#define QT_CHECK_NCCL(expr)                                                        \
  do {                                                                             \
    ncclResult_t qt_nccl_rc_ = (expr);                                             \
    if (qt_nccl_rc_ != ncclSuccess)                                                \
      ::qt::fail_library("NCCL", __FILE__, __LINE__, #expr,                        \
                         ncclGetErrorString(qt_nccl_rc_));                         \
  } while (0)
