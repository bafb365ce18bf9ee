// The vision program's op contract (vision/vision_program.h) on the CPU, in fp32: each op one of
// the reference ops of src/ops/cpu (BLAS GEMMs, loops).
#pragma once

#include <cstddef>
#include <vector>

#include "vision/vision_positions.h"

namespace qt {

class VisionCpuOps {
 public:
  using Act = float;
  using Weight = float;
  template <class T>
  using Buffer = std::vector<T>;  // resize(n) zero-fills; data()

  void set_batch(const VisionBatch& batch) { batch_ = &batch; }

  void linear(float* y, const float* x, const float* w, const float* b, int N, int in, int out);
  void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                       const float* w, int N, int in, int out);
  void layernorm(float* y, float* mean, float* rstd, const float* x, const float* w,
                 const float* b, int N, int C, double eps);
  void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                          const float* w, const float* mean, const float* rstd, int N, int C);
  void gelu_tanh(float* y, const float* x, std::size_t n);
  void gelu_tanh_backward(float* dx, const float* dy, const float* x, std::size_t n);
  void gelu_erf(float* y, const float* x, std::size_t n);
  void gelu_erf_backward(float* dx, const float* dy, const float* x, std::size_t n);
  void add_position_embedding(float* x, const float* table, int hv);
  void position_embedding_backward(float* dtable, const float* dx, int hv);
  void split_qkv_rope(float* q, float* k, float* v, const float* qkv, int heads, int hd);
  void split_qkv_rope_backward(float* dqkv, float* dq, float* dk, const float* dv, int heads,
                               int hd);
  void attention(float* out, float* lse, const float* q, const float* k, const float* v,
                 int heads, int hd);
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                          const float* k, const float* v, const float* out, const float* lse,
                          int heads, int hd);
  void add(float* y, const float* x, std::size_t n);

 private:
  const VisionBatch* batch_ = nullptr;
};

}  // namespace qt
