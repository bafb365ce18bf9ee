// Expert-parallel receive order; see moe_ep.cuh. The segment tables (at most E = 1024 entries)
// come from one thread (a few microseconds a layer); then one thread a received row finds its
// (source, expert) segment by a binary search over the segments' starts in received order.
#include <string>

#include "ops/cuda/common.cuh"
#include "ops/cuda/moe_ep.cuh"

namespace qt::cuda {

static constexpr int kMapThreads = 256;

// seg_recv[s], seg_expert[s] for segment s = p El + e (source p, local expert e): its first row
// in received order and in expert order; offsets [El + 1] in expert order.
static __global__ void moe_ep_segments_kernel(int* offsets, int* seg_recv, int* seg_expert,
                                              const int* counts, int P, int E, int rank) {
  const int El = E / P;
  const int* mine = counts + rank * El;  // counts[p, rank El + e] = mine[p E + e]
  int at = 0;
  for (int p = 0; p < P; ++p)
    for (int e = 0; e < El; ++e) {
      seg_recv[p * El + e] = at;
      at += mine[p * E + e];
    }
  at = 0;
  for (int e = 0; e < El; ++e) {
    offsets[e] = at;
    for (int p = 0; p < P; ++p) {
      seg_expert[p * El + e] = at;
      at += mine[p * E + e];
    }
  }
  offsets[El] = at;
}

// Received row j lies in the last segment whose start is <= j (an empty segment starts where the
// next one does, so the last of equal starts is the one holding j).
static __global__ void moe_ep_rows_kernel(int* to_expert, int* from_expert, const int* seg_recv,
                                          const int* seg_expert, int segments, int R) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= R) return;
  int lo = 0, hi = segments - 1;  // seg_recv[0] = 0 <= j: the answer is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (seg_recv[mid] <= j)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int i = seg_expert[lo] + (j - seg_recv[lo]);
  to_expert[j] = i;
  from_expert[i] = j;
}

void moe_ep_recv_order(int* offsets, int* to_expert, int* from_expert, const int* counts, int P,
                       int E, int rank, int R, int* segments, cudaStream_t stream) {
  QT_CUDA_REQUIRE(P >= 1 && E >= 1 && E <= 1024 && E % P == 0 && rank >= 0 && rank < P && R >= 0,
                  "moe_ep_recv_order: need 1 <= E <= 1024, P dividing E, 0 <= rank < P, R >= 0; "
                  "got P=" + std::to_string(P) + " E=" + std::to_string(E) + " rank=" +
                      std::to_string(rank) + " R=" + std::to_string(R));
  int* seg_recv = segments;
  int* seg_expert = segments + E;
  moe_ep_segments_kernel<<<1, 1, 0, stream>>>(offsets, seg_recv, seg_expert, counts, P, E, rank);
  QT_CHECK_LAUNCH();
  if (R == 0) return;
  moe_ep_rows_kernel<<<ceil_div(R, kMapThreads), kMapThreads, 0, stream>>>(
      to_expert, from_expert, seg_recv, seg_expert, E, R);
  QT_CHECK_LAUNCH();
}

}  // namespace qt::cuda
