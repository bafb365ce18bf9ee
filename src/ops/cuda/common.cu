// The second pass of the deterministic weight-gradient reductions (common.cuh).
#include "ops/cuda/common.cuh"

namespace qt::cuda {

static constexpr int kColumns = 32;  // columns per block (threadIdx.x)
static constexpr int kSlices = 32;   // partial rows summed in parallel per column (threadIdx.y)

// dw[c] += sum_g partial[g, c]. Slice y sums rows g = y, y + 32, ... in increasing order; the 32
// slice sums are then added in slice order. The order depends on G and C only.
static __global__ void column_sum_accumulate_kernel(float* dw, const float* partial, int G, int C,
                                                    bool accumulate) {
  __shared__ float sums[kSlices][kColumns + 1];
  const int c = blockIdx.x * kColumns + threadIdx.x;
  float s = 0.0f;
  if (c < C)
    for (int g = threadIdx.y; g < G; g += kSlices)
      s += partial[static_cast<std::size_t>(g) * C + c];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.0f;
    for (int y = 0; y < kSlices; ++y) t += sums[y][threadIdx.x];
    dw[c] = accumulate ? dw[c] + t : t;
  }
}

void column_sum_accumulate(float* dw, const float* partial, int G, int C, cudaStream_t stream,
                           bool accumulate) {
  const dim3 block(kColumns, kSlices);
  column_sum_accumulate_kernel<<<ceil_div(C, kColumns), block, 0, stream>>>(dw, partial, G, C,
                                                                            accumulate);
  QT_CHECK_LAUNCH();
}

}  // namespace qt::cuda
