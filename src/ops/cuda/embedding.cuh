// Token embedding on the GPU: bf16 table, fp32 gradient. Contracts mirror qt::cpu::embedding_*
// (src/ops/embedding.h), stream last. C % 8 == 0 and 16-byte aligned pointers (one 16-byte
// vector of 8 columns per thread); ids in [0, V), checked by the caller. Violations of the shape
// and alignment rules throw std::invalid_argument.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// x[N, C] = wte[ids[n], :]  (bf16, written). wte [V, C] bf16, ids [N] int32.
void embedding_forward(bf16* x, const std::int32_t* ids, const bf16* wte, int N, int C,
                       cudaStream_t stream);

// The vocabulary-parallel form (a tensor-parallel rank's part of the table): wte [count, C]
// holds table rows [first, first + count); x[n] = wte[ids[n] - first] where the id is one of
// them, else zeros (the ranks' rows summed give the whole lookup).
void embedding_forward_rows(bf16* x, const std::int32_t* ids, const bf16* wte, int N, int C,
                            std::int64_t first, std::int64_t count, cudaStream_t stream);

// Bytes of device scratch for embedding_backward over N tokens (the sorted ids and positions and
// the sort's own temporary storage).
std::size_t embedding_backward_workspace_bytes(int N);

// dwte[ids[n], :] += dx[n, :]   (dwte [V, C] fp32 accumulated; dx [N, C] bf16).
// Deterministic, and bit-equal to adding the rows in token order n = 0, 1, ... (the CPU op's
// order): the (id, position) pairs are sorted by id with a stable radix sort, so each id's
// positions stay ascending; then one block per distinct id adds that id's rows, in that order,
// to the row of dwte it alone owns. No atomics: every run gives the same bits whatever the
// scheduling. (The alternative, one pass over the tokens per column slice, is deterministic too
// but serial in N.) workspace: embedding_backward_workspace_bytes(N), 16-byte aligned.
void embedding_backward(float* dwte, const bf16* dx, const std::int32_t* ids, int N, int C,
                        void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// The same for the part of the table in the flat element range [lo, hi) (a ZeRO shard of it,
// which may start and end inside rows): out[e - lo] += (embedding_backward's dwte)[e] for e in
// [lo, hi); no alignment asked of out. Same order of additions, so the same bits there.
void embedding_backward_range(float* out, std::size_t lo, std::size_t hi, const bf16* dx,
                              const std::int32_t* ids, int N, int C, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace qt::cuda
