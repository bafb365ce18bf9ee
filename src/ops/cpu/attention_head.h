// One (batch row, query head) of the CPU attention ops (attention.cpp, attention_block.cpp) as
// strided views of q/out [B, Tq, nh, hd] and k/v [B, Tk, nkv, hd]: row t at off + t * ld.
#pragma once

#include <cstddef>

namespace qt::cpu {

struct HeadView {
  std::size_t q_off, kv_off;  // offsets of (b, row 0, head) in the q/out and k/v tensors
  int ldq, ldkv;              // row strides: nh * hd and nkv * hd
};

// Query head h of batch row b and the kv head it shares (GQA: h / (nh / nkv)).
inline HeadView head_view(int b, int h, int Tq, int Tk, int nh, int nkv, int hd) {
  const int g = h / (nh / nkv);
  HeadView v;
  v.ldq = nh * hd;
  v.ldkv = nkv * hd;
  v.q_off = static_cast<std::size_t>(b) * Tq * v.ldq + static_cast<std::size_t>(h) * hd;
  v.kv_off = static_cast<std::size_t>(b) * Tk * v.ldkv + static_cast<std::size_t>(g) * hd;
  return v;
}

}  // namespace qt::cpu
