// Qwen3 inference on the CPU with a key/value cache (docs/generate.md): the layer forward of the
// training program (qwen3_layer_forward, src/model/layer_program.h) over the CPU ops (CpuOps,
// fp32), for one sequence. A call appends n tokens at positions [len, len + n): one pass of
// GEMMs over the n rows (the whole prompt at once), their keys and values (after k-norm and RoPE)
// written straight into the cache, and each query attending to the cached positions [0, its own]
// (the one op the decoder's Ops replace).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "qtrain/model_config.h"
#include "qtrain/params.h"

namespace qt::gen {

// Single-query attention over a cache (the decode step; prefill calls it once per query).
// q, out: [nh, hd]; k, v: [len, nkv, hd] (rows 0..len-1 of the cache); query head h reads kv
// head h / (nh / nkv); scale 1/sqrt(hd), softmax sums in double. out is written.
void cached_attention(float* out, const float* q, const float* k, const float* v, int len, int nh,
                      int nkv, int hd);

// What `qtrain generate` needs from a model with a key/value cache: KvDecoder (CPU, fp32) or
// KvDecoderCuda (kv_decoder_cuda.h, GPU, bf16), chosen by --device.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int length() const = 0;    // tokens in the cache
  virtual int capacity() const = 0;  // cache size in tokens
  virtual void reset() = 0;          // forget the sequence (the cache is overwritten)
  // Appends ids (n >= 1 tokens in [0, V), length() + n <= capacity()). Returns the logits (fp32,
  // host memory) of the new positions, [n, V] when all_logits, else [V] of the last one; valid
  // until the next call.
  virtual const float* append(std::span<const std::int32_t> ids, bool all_logits = false) = 0;
  virtual std::size_t cache_bytes() const = 0;  // bytes of the key/value cache
};

class KvCpuOps;  // kv_decoder.cpp: CpuOps attending over the cache

class KvDecoder final : public Decoder {
 public:
  // params: the flat buffer of ParamLayout(cfg), kept by pointer (it must outlive the decoder).
  // capacity: cache size in tokens, at most cfg.max_position_embeddings.
  KvDecoder(const ModelConfig& cfg, const float* params, int capacity);
  ~KvDecoder() override;
  KvDecoder(const KvDecoder&) = delete;
  KvDecoder& operator=(const KvDecoder&) = delete;

  const ModelConfig& config() const override { return cfg_; }
  int length() const override { return len_; }
  int capacity() const override { return cap_; }
  void reset() override { len_ = 0; }
  const float* append(std::span<const std::int32_t> ids, bool all_logits = false) override;
  std::size_t cache_bytes() const override { return (k_.size() + v_.size()) * sizeof(float); }

 private:
  ModelConfig cfg_;
  ParamLayout layout_;
  ModelOffsets off_ = layout_.model_offsets();
  const float* P_;
  int cap_, len_ = 0;
  std::unique_ptr<KvCpuOps> ops_;       // the program's ops; RoPE tables for cap positions
  std::vector<float> k_, v_;            // [L, cap, nkv, hd] after k-norm and RoPE; v as is
  // Scratch for a chunk of n rows (the layer runs in place on x_ and ln_).
  std::vector<std::int32_t> pos_;       // [n] positions len..len+n-1
  std::vector<float> x_, ln_, tmp_;     // [n, H]
  std::vector<float> rstd_;             // [n]
  std::vector<float> qkv_, q_, att_;    // [n, QKV], [n, Q], [n, Q]
  std::vector<float> q_rstd_, k_rstd_;  // [n * nh], [n * nkv]
  std::vector<float> gu_, h_;           // [n, 2I], [n, I]
  std::vector<float> moe_probs_, moe_w_;  // Qwen3-MoE's router output: [n, E], [n, k]
  std::vector<int> moe_idx_;              // [n, k]
  std::vector<float> logits_;           // [n or 1, V]
};

}  // namespace qt::gen
