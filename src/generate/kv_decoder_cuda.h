// Qwen3 inference on one GPU with a bf16 key/value cache (docs/generate.md): the KvDecoder
// interface over the CUDA training ops (src/ops/cuda), with the math and bf16 rounding points of
// the CUDA training forward (src/cuda/qwen3_cuda.cpp). Built only with the CUDA back end
// (QTRAIN_CUDA; the .cpp is CUDA host code); this header has no CUDA type, so generate.cpp can
// include it under QTRAIN_HAVE_CUDA without the CUDA headers.
//
// A call appends n tokens at positions [len, len + n): the GEMMs run over the n rows at once;
// keys (after k-norm and RoPE) and values go into the cache [layers][nkv, cap, hd]. Attention:
// on an empty cache (the prompt), the batched causal flash attention of training
// (attention_forward); otherwise the flash-decoding kernel over the cache (decode_attention.cuh),
// query row i seeing positions [0, len + i]. Only the asked-for rows get the final norm's lm head,
// in fp32, copied to the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "generate/kv_decoder.h"

namespace qt::gen {

class KvDecoderCuda final : public Decoder {
 public:
  // Makes GPU 0 current (UserError when there is none). params: the host fp32 flat buffer of
  // ParamLayout(cfg), rounded to bf16 on the device here and not kept. capacity: cache size in
  // tokens, at most cfg.max_position_embeddings. UserError for a model the CUDA ops do not take
  // (head_dim other than 64 and 128, more than 16 query heads per kv head, hidden size not a
  // multiple of 8 or above 8192) and when the GPU has too little free memory.
  KvDecoderCuda(const ModelConfig& cfg, const float* params, int capacity);
  // The model checks of the constructor without touching a GPU, for refusing early: UserError.
  static void check_supported(const ModelConfig& cfg);
  ~KvDecoderCuda() override;
  KvDecoderCuda(const KvDecoderCuda&) = delete;
  KvDecoderCuda& operator=(const KvDecoderCuda&) = delete;

  const ModelConfig& config() const override;
  int length() const override;
  int capacity() const override;
  void reset() override;
  // As Decoder::append; waits for the GPU (the logits are on the host when it returns).
  const float* append(std::span<const std::int32_t> ids, bool all_logits = false) override;
  std::size_t cache_bytes() const override;

  // "GPU 0 (NVIDIA H100 80GB HBM3)", for the log line.
  std::string device_description() const;
  // Bytes of device memory held: weights, cache and the per-call buffers.
  std::size_t device_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace qt::gen
