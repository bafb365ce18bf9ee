// VisionCpuOps: the vision program's ops in fp32 over the reference ops of src/ops/cpu.
#include "vision/vision_cpu_ops.h"

#include <cstring>

#include "ops/bidirectional_attention.h"
#include "ops/gelu.h"
#include "ops/layernorm.h"
#include "ops/linear_bias.h"
#include "ops/rope.h"

namespace qt {

void VisionCpuOps::linear(float* y, const float* x, const float* w, const float* b, int N, int in,
                          int out) {
  cpu::linear_bias_forward<float>(y, x, w, b, N, in, out);
}
void VisionCpuOps::linear_backward(float* dx, float* dw, float* db, const float* dy,
                                   const float* x, const float* w, int N, int in, int out) {
  cpu::linear_bias_backward<float>(dx, dw, db, dy, x, w, N, in, out);
}
void VisionCpuOps::layernorm(float* y, float* mean, float* rstd, const float* x, const float* w,
                             const float* b, int N, int C, double eps) {
  cpu::layernorm_forward<float>(y, mean, rstd, x, w, b, N, C, eps);
}
void VisionCpuOps::layernorm_backward(float* dx, float* dw, float* db, const float* dy,
                                      const float* x, const float* w, const float* mean,
                                      const float* rstd, int N, int C) {
  cpu::layernorm_backward<float>(dx, dw, db, dy, x, w, mean, rstd, N, C);
}
void VisionCpuOps::gelu_tanh(float* y, const float* x, std::size_t n) {
  cpu::gelu_tanh_forward<float>(y, x, n);
}
void VisionCpuOps::gelu_tanh_backward(float* dx, const float* dy, const float* x, std::size_t n) {
  cpu::gelu_tanh_backward<float>(dx, dy, x, n);
}
void VisionCpuOps::gelu_erf(float* y, const float* x, std::size_t n) {
  cpu::gelu_erf_forward<float>(y, x, n);
}
void VisionCpuOps::gelu_erf_backward(float* dx, const float* dy, const float* x, std::size_t n) {
  cpu::gelu_erf_backward<float>(dx, dy, x, n);
}

// x[n] += sum_t weight[t] table[index[t]], in fp32 as transformers (before its bf16 cast).
void VisionCpuOps::add_position_embedding(float* x, const float* table, int hv) {
  for (int n = 0; n < batch_->patches; ++n) {
    const PositionTaps& t = batch_->taps[n];
    float* xr = x + static_cast<std::size_t>(n) * hv;
    for (int c = 0; c < hv; ++c) {
      float s = 0;
      for (int j = 0; j < 4; ++j) s += t.weight[j] * table[static_cast<std::size_t>(t.index[j]) * hv + c];
      xr[c] += s;
    }
  }
}
void VisionCpuOps::position_embedding_backward(float* dtable, const float* dx, int hv) {
  for (int n = 0; n < batch_->patches; ++n) {
    const PositionTaps& t = batch_->taps[n];
    const float* dr = dx + static_cast<std::size_t>(n) * hv;
    for (int j = 0; j < 4; ++j) {
      float* row = dtable + static_cast<std::size_t>(t.index[j]) * hv;
      for (int c = 0; c < hv; ++c) row[c] += t.weight[j] * dr[c];
    }
  }
}

// qkv [N, 3 hv] = [q | k | v] (each [heads, hd]); q and k rotated by the patch's 2-D angles.
void VisionCpuOps::split_qkv_rope(float* q, float* k, float* v, const float* qkv, int heads,
                                  int hd) {
  const int N = batch_->patches, hv = heads * hd;
  for (int n = 0; n < N; ++n) {
    const float* r = qkv + static_cast<std::size_t>(n) * 3 * hv;
    std::memcpy(q + static_cast<std::size_t>(n) * hv, r, sizeof(float) * hv);
    std::memcpy(k + static_cast<std::size_t>(n) * hv, r + hv, sizeof(float) * hv);
    std::memcpy(v + static_cast<std::size_t>(n) * hv, r + 2 * hv, sizeof(float) * hv);
  }
  // The table has one row per patch: position = row index (pos null).
  cpu::rope_forward<float>(q, batch_->rope_cos.data(), batch_->rope_sin.data(), nullptr, 1, N,
                           heads, hd);
  cpu::rope_forward<float>(k, batch_->rope_cos.data(), batch_->rope_sin.data(), nullptr, 1, N,
                           heads, hd);
}
// dq, dk rotated back in place, then [dq | dk | dv] written into dqkv.
void VisionCpuOps::split_qkv_rope_backward(float* dqkv, float* dq, float* dk, const float* dv,
                                           int heads, int hd) {
  const int N = batch_->patches, hv = heads * hd;
  cpu::rope_backward<float>(dq, batch_->rope_cos.data(), batch_->rope_sin.data(), nullptr, 1, N,
                            heads, hd);
  cpu::rope_backward<float>(dk, batch_->rope_cos.data(), batch_->rope_sin.data(), nullptr, 1, N,
                            heads, hd);
  for (int n = 0; n < N; ++n) {
    float* r = dqkv + static_cast<std::size_t>(n) * 3 * hv;
    std::memcpy(r, dq + static_cast<std::size_t>(n) * hv, sizeof(float) * hv);
    std::memcpy(r + hv, dk + static_cast<std::size_t>(n) * hv, sizeof(float) * hv);
    std::memcpy(r + 2 * hv, dv + static_cast<std::size_t>(n) * hv, sizeof(float) * hv);
  }
}

void VisionCpuOps::attention(float* out, float* lse, const float* q, const float* k,
                             const float* v, int heads, int hd) {
  const auto& f = batch_->frames;
  cpu::bidirectional_attention_forward<float>(out, lse, q, k, v, f.data(),
                                              static_cast<int>(f.size()) - 1, heads, hd);
}
void VisionCpuOps::attention_backward(float* dq, float* dk, float* dv, const float* dout,
                                      const float* q, const float* k, const float* v,
                                      const float* out, const float* lse, int heads, int hd) {
  const auto& f = batch_->frames;
  cpu::bidirectional_attention_backward<float>(dq, dk, dv, dout, q, k, v, out, lse, f.data(),
                                               static_cast<int>(f.size()) - 1, heads, hd);
}

void VisionCpuOps::add(float* y, const float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace qt
