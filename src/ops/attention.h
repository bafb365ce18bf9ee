// Causal grouped-query attention (GQA), scale 1/sqrt(hd).
// Query head j uses kv head j / (nh / nkv). Never stores the [T, T] probabilities between
// forward and backward: the backward recomputes them from the saved log-sum-exp.
// Packed sequences: with pos [B, T] (the RoPE position of each token), query t of row b attends
// key j iff t - pos[b, t] <= j <= t (its own document only); pos == nullptr is plain causal
// (pos[b, t] = t). A valid row has pos[0] = 0 and pos[t] in {pos[t-1] + 1, 0}.
#pragma once

#include <cstdint>

namespace qt::cpu {

// q: [B, T, nh, hd]; k, v: [B, T, nkv, hd]; out: [B, T, nh, hd] (written);
// lse: [B, nh, T] log-sum-exp of the scaled scores of each query row (written).
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, int B, int Tn, int nh,
                       int nkv, int hd, const std::int32_t* pos = nullptr);

// dq [B, T, nh, hd], dk and dv [B, T, nkv, hd]: written (=).
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, int B, int Tn, int nh, int nkv, int hd,
                        const std::int32_t* pos = nullptr);

}  // namespace qt::cpu
