// Dropout on the LoRA adapters' input on the GPU, with the CPU's masks bit for bit
// (qt::LoraAdapters, src/model/lora.h). Row n of an [N, in] micro-batch is token n % T of the
// sequence with index first_sample + n / T in the data order, so its element i is kept iff
//   rng::uniform(stream, (first_sample * T + n) * width + col0 + i) >= p   (src/runtime/rng.h,
// in double), with stream = qt::lora_dropout_stream(seed, layer, target); the mask value m is
// keep_scale = float(1 / (1 - p)) when kept, else 0. The mask is regenerated, never stored.
// width = key.row_width (0: in) and col0 = key.col0: the input may be columns [col0, col0 + in)
// of wider mask rows (a row-parallel projection's input under tensor parallelism, as
// LoraAdapters::set_tensor_parallel).
// in % 8 == 0 and 16-byte aligned pointers (one 16-byte vector of 8 bf16 per thread); any N.
// Violations throw std::invalid_argument.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

struct LoraDropoutKey {
  std::uint64_t stream = 0;  // qt::lora_dropout_stream(seed, layer, target)
  std::int64_t first_row = 0;  // first_sample * T: the data-order index of row 0's token
  double p = 0;                // dropout probability, in [0, 1)
  float keep_scale = 1;        // float(1.0 / (1.0 - p)), as the CPU computes it
  int row_width = 0;           // elements of a mask row (0: in, the input's own width)
  int col0 = 0;                // the mask column of the input's column 0
};

// xd[n, i] = bf16(float(x[n, i]) * m[n, i]). x, xd [N, in] bf16; xd must not alias x.
void lora_dropout_forward(bf16* xd, const bf16* x, int N, int in, const LoraDropoutKey& key,
                          cudaStream_t stream);

// dx[n, i] = bf16(float(dx[n, i]) + float(d[n, i]) * m[n, i])   (the gradient through the mask,
// accumulated). dx, d [N, in] bf16, not overlapping.
void lora_dropout_backward(bf16* dx, const bf16* d, int N, int in, const LoraDropoutKey& key,
                           cudaStream_t stream);

}  // namespace qt::cuda
