// One AdamW element update on the GPU, the CPU optimizer's operations in its order and
// precisions (adamw_update in src/optim/adamw_math.h): every double operation is an explicitly rounded intrinsic
// (__dmul_rn, ...), which nvcc never contracts into a fused multiply-add, so the results match the
// CPU's bit for bit. Used by adamw.cu and bench/bench_adamw_beside_gemm_cuda.cu; included by .cu
// files only.
#pragma once

#include <cuda_runtime_api.h>

namespace qt::cuda {

// The per-step constants, computed on the host exactly as qt::adamw_step does (adamw.cu).
struct AdamWConsts {
  double b1, b2, one_minus_b1, one_minus_b2, eps, clip;
  double step_size, inv_sqrt_bc2;  // lr / (1 - b1^t), 1 / sqrt(1 - b2^t): qt::adamw_bias_terms
  float decay;  // float(lr * weight_decay)
};

// One element; p, m, v updated in place. Same operations and order as qt::adamw_update.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float grad, bool decay,
                                              const AdamWConsts& k) {
  const float g = __double2float_rn(__dmul_rn(static_cast<double>(grad), k.clip));
  const double gd = g;
  m = __double2float_rn(
      __dadd_rn(__dmul_rn(k.b1, static_cast<double>(m)), __dmul_rn(k.one_minus_b1, gd)));
  v = __double2float_rn(__dadd_rn(__dmul_rn(k.b2, static_cast<double>(v)),
                                  __dmul_rn(__dmul_rn(k.one_minus_b2, gd), gd)));
  const double num = __dmul_rn(k.step_size, static_cast<double>(m));
  const double den = __dadd_rn(__dmul_rn(__dsqrt_rn(static_cast<double>(v)), k.inv_sqrt_bc2), k.eps);
  float w = p;
  w = __fsub_rn(w, __fmul_rn(decay ? k.decay : 0.0f, w));
  w = __fsub_rn(w, __double2float_rn(__ddiv_rn(num, den)));
  p = w;
}

}  // namespace qt::cuda
