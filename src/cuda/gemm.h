// cuBLASLt context of one device: the handle, the workspace and the plan cache behind
// qt::cuda::gemm / linear_* (src/ops/cuda/gemm.cuh). Host code only.
#pragma once

#include <cublasLt.h>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/device.h"
#include "ops/cuda/gemm.cuh"

namespace qt::cuda {

// Fused epilogues (hook): kNone is all there is today. A new one sets CUBLASLT_MATMUL_DESC_EPILOGUE
// when its plan is made and its per-call pointers (bias, aux) on the cached descriptor in matmul().
enum class GemmEpilogue : std::uint8_t { kNone };

// One GEMM, row-major, in the terms of qt::cuda::gemm.
struct GemmArgs {
  bool trans_a = false, trans_b = false;
  int M = 0, N = 0, K = 0;
  float alpha = 1.f;
  const bf16* A = nullptr;
  int lda = 0;
  const bf16* B = nullptr;
  int ldb = 0;
  float beta = 0.f;
  void* C = nullptr;
  int ldc = 0;
  bool c_is_f32 = false;  // C is float (else bf16)
  GemmEpilogue epilogue = GemmEpilogue::kNone;
};

class GemmContext {
 public:
  // On the current device. The workspace is borrowed when given, else one is allocated.
  GemmContext(void* workspace, std::size_t workspace_bytes);
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  // The current device's context, made on first use (with its own kGemmWorkspaceBytes workspace).
  static GemmContext& current();
  // Replaces the current device's context (gemm_init).
  static void install(void* workspace, std::size_t workspace_bytes);

  // Validates (std::invalid_argument), finds or makes the plan, and enqueues one cublasLtMatmul.
  void matmul(const GemmArgs& g, cudaStream_t stream);

  // Set-up time only (not concurrently with GEMMs of this shape): times the heuristic's first
  // `max_algos` algorithms on g's buffers, `reps` runs each after a warm-up, and keeps the fastest
  // in g's plan. C is overwritten (accumulated into when beta != 0): pass scratch buffers of the
  // real shape and alignment. Returns ms per run in heuristic order (-1: algorithm refused); entry
  // 0 is what the heuristic alone would have used. Synchronises the stream.
  std::vector<float> tune(const GemmArgs& g, cudaStream_t stream, int max_algos = 8, int reps = 5);

  int device() const { return device_; }
  std::size_t plan_count() const;
  std::size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  // What a plan depends on (in cuBLASLt's column-major terms: m = N, n = M).
  struct Key {
    bool trans_a, trans_b, c_is_f32;
    int M, N, K, lda, ldb, ldc;
    int align_a, align_b, align_c;  // pointer alignment in bytes, capped at 16
    GemmEpilogue epilogue;
    auto operator<=>(const Key&) const = default;
  };
  struct Plan;

  static Key key_of(const GemmArgs& g);
  Plan& plan_for(const Key& k);
  std::vector<cublasLtMatmulHeuristicResult_t> heuristics(const Key& k, const Plan& p,
                                                          int max_algos) const;

  int device_ = -1;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer own_workspace_;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  mutable std::mutex mutex_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace qt::cuda
