// Attention of a few new query rows over a bf16 key/value cache (inference, docs/generate.md),
// and the write of new keys and values into that cache. bf16 in and out; scores, softmax and
// the weighted sum of values in fp32 (no bf16 rounding of the probabilities).
//
// Cache layout, per layer: k_cache, v_cache [nkv, cap, hd] bf16 (each kv head's rows
// contiguous); rows 0 .. start + n - 1 hold the keys (after k-norm and RoPE) and values of the
// positions 0 .. start + n - 1. Query row i (position start + i) attends to keys [0, start + i]
// (causal); query head h reads kv head h / (nh / nkv); scale 1/sqrt(hd).
//
// Algorithm (flash-decoding): the keys of each (row, kv head) are cut into `splits` chunks; one
// block per (chunk, kv head, row) runs an online softmax over its chunk for all nh / nkv query
// heads of the kv head at once (each key and value row is read once per block), and writes
// unnormalised partial sums with their max and sum to the workspace; a second kernel merges the
// chunks of each (row, head) in a fixed order. Deterministic: the same inputs give the same bits.
//
// Limits: hd 64 or 128; nh a multiple of nkv with nh / nkv <= 16; every pointer 16-byte aligned.
// Violations throw std::invalid_argument.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// The number of key chunks decode_attention uses when `splits` is 0: enough blocks to fill a
// large GPU (about 1024 with n * nkv blocks per chunk), at least 64 keys per chunk, at most 256
// chunks. kv_len = start + n, the keys of the last row.
int decode_attention_splits(int n, int nkv, int kv_len);

// Bytes of device workspace for decode_attention with these arguments (splits 0: automatic).
std::size_t decode_attention_workspace_bytes(int n, int nh, int nkv, int hd, int kv_len,
                                             int splits = 0);

// out[i, h, :] = softmax_j(q[i, h, :] . k_cache[h / g, j, :] / sqrt(hd)) v_cache[h / g, j, :],
// j in [0, start + i], g = nh / nkv.
// q, out: [n, nh, hd] bf16 (out written; must not alias q); k_cache, v_cache: [nkv, cap, hd]
// (one layer); start + n <= cap; n <= 65535. workspace: decode_attention_workspace_bytes(n, nh,
// nkv, hd, start + n, splits) bytes, 16-byte aligned. splits 0 chooses decode_attention_splits();
// a larger value than there are 32-key tiles is reduced to the number of tiles.
void decode_attention(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache, int n,
                      int start, int nh, int nkv, int hd, int cap, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream, int splits = 0);

// Stores n new rows at positions start .. start + n - 1 of one layer's cache:
//   k_cache[g, start + i, :] = k[i * k_ld + g * hd + d],  v_cache likewise from v,  g < nkv.
// k, v: rows of nkv * hd bf16 with row strides k_ld, v_ld (elements, multiples of 8, >= nkv*hd),
// e.g. v read straight from the fused q/k/v GEMM's output. start + n <= cap.
void kv_cache_write(bf16* k_cache, bf16* v_cache, const bf16* k, int k_ld, const bf16* v, int v_ld,
                    int n, int start, int nkv, int hd, int cap, cudaStream_t stream);

}  // namespace qt::cuda
