// The Qwen3-MoE block's kernels on the GPU (qwen3-spec.md 3; the CPU oracle is ops/moe_block.h):
// the router after its logits GEMM, the routing of the N x k (token, slot) pairs to the experts
// on the device, the gather of the experts' input rows and the weighted combine of their output
// rows, and their backward. The expert GEMMs themselves are cuda/grouped_gemm.h's.
//
// Shapes: N tokens of width H, E experts, k a token. A pair i = t k + j is token t's slot j.
// Routing on the device: the pairs grouped by expert, in pair order within an expert (stable, so
// deterministic); expert e owns rows [offsets[e], offsets[e + 1]) of the expert-ordered
// [N k, H] buffers; pos[i] is pair i's row there and pair[r] the pair of row r (inverses).
// Every reduction is in a fixed order (no floating-point atomics): the same bits on every run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// probs [N, E] = softmax(float(logits [N, E])) (fp32); idx [N, k] the k most probable experts,
// descending (ties: the lower expert first, as the CPU reference; torch.topk leaves ties
// unspecified); w [N, k] = bf16 of their probabilities, divided in fp32 by their sum when
// norm_topk. All written. E <= 1024. bias [E] fp32 on the device (auxiliary-loss-free
// balancing; null: none): added to the probabilities for the choice only, as the CPU
// reference's router_forward: idx the top-k of probs + bias, w still from the probabilities.
void moe_router_forward(float* probs, int* idx, bf16* w, const bf16* logits, int N, int E, int k,
                        bool norm_topk, cudaStream_t stream, const float* bias = nullptr);

// dlogits [N, E] = bf16 of the softmax backward of dp, where dp is the gradient through the
// routing weights (dw [N, k] fp32, the renormalisation's backward when norm_topk) plus, when
// balance_count is not null, aux_scale x balance_count[e] for every token (the load-balancing
// loss's gradient with the counts held constant: aux_scale = coef E / tokens^2). Written.
void moe_router_backward(bf16* dlogits, const float* dw, const float* probs, const int* idx,
                         const double* balance_count, float aux_scale, int N, int E, int k,
                         bool norm_topk, cudaStream_t stream);

// Device scratch of moe_route for n_pairs pairs and E experts (bytes, 256-aligned pieces).
std::size_t moe_route_workspace_bytes(int n_pairs, int E);

// Routes the pairs of idx [N k] (experts in [0, E)): counts [E] the pairs routed to each expert
// (written), kept [E] = min(counts, capacity) (written), offsets [E + 1] (exclusive scan of
// kept), pos [N k] and pair [N k] (above). When balance_count [E] is not null, counts are added
// to it (fp64). E <= 1024. No host synchronisation.
// capacity (ops/moe_capacity.h, model.moe_capacity_factor): each expert keeps its first
// `capacity` pairs in pair order; a dropped pair has pos -1, and the rows past offsets[E] have
// pair -1 (moe_permute writes them zero, the others skip dropped pairs: their slot adds nothing).
// kMoeDropless (or any capacity >= N): nothing is dropped and kept = counts.
inline constexpr int kMoeDropless = 0x7fffffff;
void moe_route(int* counts, int* kept, int* offsets, int* pos, int* pair, double* balance_count,
               const int* idx, int n_pairs, int E, int capacity, void* workspace,
               cudaStream_t stream);

// load [E] += counts [E] (int to fp64, exact): the load statistics, summed on the device.
void moe_load_add(double* load, const int* counts, int E, cudaStream_t stream);

// dropped [1] += sum over e of counts[e] - kept[e] (moe_route's): the pairs the capacity dropped.
void moe_dropped_add(double* dropped, const int* counts, const int* kept, int E,
                     cudaStream_t stream);

// psum [E] += the column sums of probs [N, E] (fp64, in a fixed order).
void moe_probs_colsum(double* psum, const float* probs, int N, int E, cudaStream_t stream);

// x_perm [N k, H]: row r = x [N, H] row pair[r] / k, zeros where pair[r] < 0. Written.
void moe_permute(bf16* x_perm, const bf16* x, const int* pair, int n_pairs, int k, int H,
                 cudaStream_t stream);

// y [N, H]: y[t] = bf16(sum_j bf16(w[t, j] out_perm[pos[t k + j]])), the sum over the k slots in
// fp32 in slot order and rounded once (transformers' grouped_mm path: the bf16 product, then one
// fp32 reduction); a dropped slot (pos -1) adds nothing. Written.
void moe_unpermute(bf16* y, const bf16* out_perm, const bf16* w, const int* pos, int N, int k,
                   int H, cudaStream_t stream);

// The backward of moe_unpermute: dout_perm [N k, H] row pos[i] = bf16(w[i] dy[t]) and
// dw [N k] (fp32) = dot(out_perm row pos[i], dy[t]) in fp32, i = t k + j; a dropped pair (pos
// -1) gets dw 0 and writes no row. Written.
void moe_unpermute_backward(bf16* dout_perm, float* dw, const bf16* dy, const bf16* out_perm,
                            const bf16* w, const int* pos, int N, int k, int H,
                            cudaStream_t stream);

// The backward of moe_permute plus another input gradient: dx [N, H] row t = bf16(sum_j
// dx_perm row pos[t k + j] + add[t]) in fp32 (add may be null; dropped slots, pos -1, skipped).
// Written.
void moe_permute_backward(bf16* dx, const bf16* dx_perm, const bf16* add, const int* pos, int N,
                          int k, int H, cudaStream_t stream);

}  // namespace qt::cuda
