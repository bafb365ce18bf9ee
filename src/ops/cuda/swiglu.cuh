// SwiGLU on the GPU, bf16 in and out, fp32 math, rounded where transformers rounds
// (qwen3-spec.md 7.2): a = bf16(silu(g)), h = bf16(a * u), silu(g) = g / (1 + exp(-g)).
// Contracts mirror qt::cpu::swiglu_* (src/ops/swiglu.h), stream last. Any N, I; 16-byte vectors
// are used when every pointer is 16-byte aligned (and, with a row stride, I and ld are multiples
// of 8), a scalar path otherwise.
//
// The *_strided forms read gate and up (and write dgate, dup) with a row stride of `ld` elements
// (>= I), so both can live in one [N, 2I] buffer [gate | up] made by one GEMM against the adjacent
// gate_proj and up_proj weights; h and dh stay [N, I] contiguous.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace qt::cuda {

using bf16 = __nv_bfloat16;

// gate, up, h: [N, I] bf16; h written. h may alias gate or up.
void swiglu_forward(bf16* h, const bf16* gate, const bf16* up, int N, int I, cudaStream_t stream);

// dgate = dh * u * s * (1 + g (1 - s)),  s = sigmoid(g)     [N, I] bf16 written
// dup   = dh * bf16(silu(g))  (the rounded factor the forward multiplied by)   [N, I] written
// Each output may alias any input (every element is read before it is written, by one thread).
void swiglu_backward(bf16* dgate, bf16* dup, const bf16* dh, const bf16* gate, const bf16* up,
                     int N, int I, cudaStream_t stream);

void swiglu_forward_strided(bf16* h, const bf16* gate, const bf16* up, int ld, int N, int I,
                            cudaStream_t stream);
void swiglu_backward_strided(bf16* dgate, bf16* dup, const bf16* dh, const bf16* gate,
                             const bf16* up, int ld, int N, int I, cudaStream_t stream);

}  // namespace qt::cuda
