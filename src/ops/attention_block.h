// Attention of a block of query rows against a block of key/value rows of the same sequences:
// the building block of context parallelism (issue 24, ring attention), where each rank holds
// some of a sequence's tokens, passes its K/V around the ring, and merges the partial results by
// their log-sum-exp. Rows carry global token indices, so the blocks need not be contiguous (a
// load-balanced rank holds a chunk from the front and its mirror from the back).
//
// Visibility (causal, documents kept apart as ops/attention.h does with pos): query i of batch
// row b, at global index qi = q_index[i], sees key j at kj = k_index[j] iff
//   q_first[b, i] <= kj <= qi,   q_first[b, i] = qi - pos[b, qi] (its document's first token).
// Summing the blocks over every key block of the sequence (attention_merge) gives
// attention_forward's out and lse; attention_block_backward over every (query, key) block pair,
// from those merged out and lse, sums to attention_backward's gradients.
#pragma once

#include <cstdint>

namespace qt::cpu {

struct AttentionBlockRows {
  const std::int32_t* q_index = nullptr;  // [Tq] global index of each query row (every batch row)
  const std::int32_t* k_index = nullptr;  // [Tk] global index of each key row
  const std::int32_t* q_first = nullptr;  // [B, Tq] first key each query may see; null: 0
};

// out [B, Tq, nh, hd], lse [B, nh, Tq] (written): the block's attention, normalised over the keys
// of this block the row sees; a row that sees none gets out 0 and lse -inf.
// q [B, Tq, nh, hd]; k, v [B, Tk, nkv, hd]; scale 1/sqrt(hd).
template <typename T>
void attention_block_forward(T* out, T* lse, const T* q, const T* k, const T* v, int B, int Tq,
                             int Tk, int nh, int nkv, int hd, const AttentionBlockRows& rows);

// Merges a block's result (out_b, lse_b) into the running one (out, lse), row by row:
//   lse' = log(e^lse + e^lse_b),  out' = out e^(lse - lse') + out_b e^(lse_b - lse').
// A running lse of -inf takes the block's as it is.
template <typename T>
void attention_merge(T* out, T* lse, const T* out_b, const T* lse_b, int B, int Tq, int nh, int hd);

// The block's share of the backward (accumulated: +=), from the whole row's merged out and lse:
//   P = exp(S - lse) on the visible pairs, D = rowsum(dout * out),
//   dq += scale (P (dout V^T - D)) K,  dk += scale (...)^T Q,  dv += P^T dout.
template <typename T>
void attention_block_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                              const T* v, const T* out, const T* lse, int B, int Tq, int Tk, int nh,
                              int nkv, int hd, const AttentionBlockRows& rows);

}  // namespace qt::cpu
