// The receiving side of expert-parallel dispatch (cuda/cuda_ops_moe_ep.cpp; the CPU reference is
// parallel/expert_parallel.cpp): the ep group's P ranks each route their own tokens over all E
// experts (moe.cuh's moe_route) and send each rank p the rows of its El = E / P experts
// [p El, (p + 1) El), in the sender's expert order. Rank r thus receives, from each source p in
// rank order, source p's rows of its local expert 0, then 1, ..., El - 1 ("received order").
// The experts' grouped GEMMs need each local expert's rows contiguous ("expert order": expert
// e's rows from source 0, then from source 1, ...). This op builds the maps between the two
// orders on the device from the group's routing counts; moe_permute (moe.cuh) with k = 1 then
// moves the rows either way.
#pragma once

#include <cuda_runtime_api.h>

namespace qt::cuda {

// counts [P, E] int32 (device): row p is rank p's moe_route counts (token-slots it routed to each
// global expert; the ep group's all-gather). rank: this rank r; R: the rows it receives, the sum
// over p of counts[p, r El + e] over its El local experts (the caller knows it from the host
// copy; checked against nothing here). Written:
//   offsets [El + 1]: local expert e owns rows [offsets[e], offsets[e + 1]) in expert order;
//   to_expert [R]: received row j's row in expert order;
//   from_expert [R]: expert-order row i's received row (the inverse of to_expert).
// segments: device scratch of 2 E int32. E <= 1024, P divides E.
void moe_ep_recv_order(int* offsets, int* to_expert, int* from_expert, const int* counts, int P,
                       int E, int rank, int R, int* segments, cudaStream_t stream);

}  // namespace qt::cuda
