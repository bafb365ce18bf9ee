// Softmax cross-entropy over bf16 logits on the GPU, fp32 math (transformers upcasts the bf16
// logits to fp32 for the loss, qwen3-spec.md 2.7). Contracts mirror qt::cpu::cross_entropy_*
// (src/ops/cross_entropy.h), stream last, with fp32 losses and lse. Targets of -100 are ignored;
// every other target must be in [0, V) (checked by the caller). Any V >= 1: rows are read as
// 16-byte vectors when V % 8 == 0 and logits is 16-byte aligned, element by element otherwise.
// The fused lm-head + cross-entropy calls these per chunk of tokens.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// logits [N, V] bf16, targets [N] int32. One block per row, online max and sum over the row.
//   lse[n]    = log(sum_v exp(logits[n, v]))                 [N] fp32 written
//   losses[n] = lse[n] - logits[n, targets[n]], 0 if ignored [N] fp32 written
//   *loss_sum += sum_n losses[n]   (device fp64 scalar, accumulated so that chunks add up;
//                                   summed in a fixed order; skipped when loss_sum is null)
// The host gets the sum by copying *loss_sum back when it needs it (no synchronisation here).
void cross_entropy_forward(float* losses, float* lse, const bf16* logits,
                           const std::int32_t* targets, int N, int V, double* loss_sum,
                           cudaStream_t stream);

// dlogits [N, V] bf16 = bf16(scale * (exp(logits - lse) - onehot(target))), 0 on ignored rows.
// dlogits may alias logits. lse from the forward.
void cross_entropy_backward(bf16* dlogits, const bf16* logits, const float* lse,
                            const std::int32_t* targets, float scale, int N, int V,
                            cudaStream_t stream);

// Both of the above, the gradient written over the logits (dlogits = logits): losses, lse and
// *loss_sum as cross_entropy_forward, then logits[n, :] = dlogits as cross_entropy_backward with
// that lse. Where V % 8 == 0, the rows are 16-byte aligned and half a row fits in 200 KB of
// shared memory (V up to 204800), one kernel does both, with each half row held in the shared
// memory of one block of a two-block cluster: every logit is read from memory once. Otherwise
// the two kernels above run.
void cross_entropy_forward_backward(float* losses, float* lse, bf16* logits,
                                    const std::int32_t* targets, float scale, int N, int V,
                                    double* loss_sum, cudaStream_t stream);

// Vocabulary-parallel (Megatron's; a tensor-parallel rank holds columns [first, first + V) of
// the logits, targets are ids of the whole vocabulary), in two passes around an all-gather:
//   cross_entropy_vp_partial: part [2, N] fp32 written: part[n] = log sum_v exp(logits[n, v])
//     over this rank's columns; part[N + n] = logits[n, targets[n] - first] where the target is
//     one of them, else 0 (ignored rows too).
//   (the caller all-gathers part over the tp ranks into parts [tp, 2, N], rank order)
//   cross_entropy_vp_finish: per row, lse = log sum over ranks of exp(part) (in rank order, the
//     same bits on every rank), losses[n] = lse - the target's logit (0 if ignored), *loss_sum as
//     cross_entropy_forward; local_targets[n] = the target's column here, -1 where another rank
//     holds it, -100 if ignored: cross_entropy_backward(dlogits, logits, lse, local_targets, ...)
//     over this rank's columns is then the gradient of the whole loss.
void cross_entropy_vp_partial(float* part, const bf16* logits, const std::int32_t* targets,
                              int N, int V, int first, cudaStream_t stream);
void cross_entropy_vp_finish(float* losses, float* lse, std::int32_t* local_targets,
                             const float* parts, int tp, const std::int32_t* targets, int N, int V,
                             int first, double* loss_sum, cudaStream_t stream);

}  // namespace qt::cuda
