// The vocabulary-parallel embedding and cross-entropy (Megatron's), fp32 on the CPU: each tp rank
// holds rows [begin, begin + v_local) of the embedding and the lm head, so no rank ever holds
// the logits of the whole vocabulary. Shapes: N rows, C hidden. Targets -100 are not counted.
#pragma once

#include <cstdint>

#include "qtrain/comm.h"

namespace qt::cpu {

// x[N, C] = this rank's part of wte[ids[n]]: the row where the id is its own, else zero. Summed
// over tp (each id is one rank's), the lookup itself.
void embedding_lookup_vp(float* x, const std::int32_t* ids, const float* wte_local, int N, int C,
                         int begin, int v_local);
// dwte_local[ids[n] - begin] += dx[n] for the ids this rank holds, in token order.
void embedding_backward_vp(float* dwte_local, const float* dx, const std::int32_t* ids, int N,
                           int C, int begin, int v_local);
// losses[N], lse[N] (written) of logits_local [N, v_local]: the row maxima and the sums of their
// exponentials reduced over tp (in double), the target's logit from the rank holding it. Returns
// the sum of the losses over counted rows, the same on every tp rank.
double cross_entropy_forward_vp(float* losses, float* lse, const float* logits_local,
                                const std::int32_t* targets, int N, int v_local, int begin,
                                Comm& tp);
// dlogits [N, v_local] = scale * (softmax - onehot) over this rank's columns; may alias logits.
void cross_entropy_backward_vp(float* dlogits, const float* logits, const float* lse,
                               const std::int32_t* targets, float scale, int N, int v_local,
                               int begin);

}  // namespace qt::cpu
