// Non-causal multi-head attention within segments of rows (the vision tower's: every patch of a
// frame attends to every patch of the same frame, none of another), scale 1/sqrt(hd):
//   out[i] = sum_{j in seg(i)} softmax_j(q[i] . k[j] / sqrt(hd)) v[j], per head.
// Segments are [seg[s], seg[s + 1]) for s < num_segments (seg = cu_seqlens, seg[0] = 0).
// As attention.h, the backward recomputes the probabilities from the saved log-sum-exp.
#pragma once

namespace qt::cpu {

// q, k, v, out: [N, heads, hd]; lse: [heads, N] (written). N = seg[num_segments].
template <typename T>
void bidirectional_attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                                     const int* seg, int num_segments, int heads, int hd);

// dq, dk, dv [N, heads, hd]: written.
template <typename T>
void bidirectional_attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                                      const T* v, const T* out, const T* lse, const int* seg,
                                      int num_segments, int heads, int hd);

}  // namespace qt::cpu
