// Fused AdamW over a range of the flat fp32 master weights, and the deterministic sum of squares
// behind the global gradient norm. The math is qt::adamw_update's (src/optim/adamw_math.h),
// operation for operation, in the same precisions (double for the moment updates and the step, float for the
// stored values and the decay), without fused multiply-adds, so that the GPU reproduces the CPU
// optimizer bit for bit on the same inputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// Weight-decay flags as segments of global element indices: elements in [begin, end) take weight
// decay when decay != 0. Segments are sorted by begin and disjoint; elements outside every
// segment take none. One segment per parameter tensor (qt::ParamInfo offset, numel,
// weight_decay) gives the CPU driver's behaviour. Kept in device memory (built once at set-up).
struct AdamWSegment {
  std::uint64_t begin = 0, end = 0;
  std::int32_t decay = 0;
};

struct AdamWStepArgs {
  double lr = 0;  // this step's learning rate (qt::lr_at)
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.0;
  double clip_scale = 1.0;  // factor applied to the gradients (1 when not clipped)
  std::int64_t step = 1;    // 1-based, for the bias corrections 1 - beta^step
};

// For k in [0, n), with global index offset + k and g = float(grads[k] * clip_scale):
//   m[k] = float(b1 m + (1 - b1) g);  v[k] = float(b2 v + (1 - b2) g g)              (fp32 +=)
//   w  = params[k];  w -= float(lr * wd) * w  (decayed elements only)
//   w -= float((lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps));     (bc = 1 - beta^step; PyTorch's order)  params[k] = w;  params_bf16[k] = bf16(w)
// params, m, v, grads: [n] fp32; params_bf16: [n] bf16 compute copy, or null to skip it.
// grads is read only. 16-byte vectors when every pointer allows (params_bf16 8-byte aligned),
// a scalar path otherwise.
void adamw_step(float* params, bf16* params_bf16, float* m, float* v, const float* grads,
                std::size_t n, std::size_t offset, const AdamWSegment* segments, int num_segments,
                const AdamWStepArgs& args, cudaStream_t stream);

// Bytes of device scratch for grad_norm_squared (fixed: per-block partials and one result).
std::size_t grad_norm_workspace_bytes();

// *out = sum_k double(x[k])^2 over x [n] fp32 (device fp64 scalar, written). Two passes in a
// fixed order (per-block partial sums, then one block over the partials): the same bits on
// every run. out: device memory; workspace: grad_norm_workspace_bytes(), 8-byte aligned.
void grad_norm_squared(double* out, const float* x, std::size_t n, void* workspace,
                       cudaStream_t stream);

// Host convenience: the same sum, copied back after synchronising `stream`.
double grad_norm_squared_sync(const float* x, std::size_t n, void* workspace, cudaStream_t stream);

}  // namespace qt::cuda
