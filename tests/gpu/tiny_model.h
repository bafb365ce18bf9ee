// The small Qwen3 and the random inputs that the GPU model tests share (test_qwen3_cuda,
// test_lora_cuda, test_generate_cuda): the CUDA model against the CPU one on the same
// bf16-representable weights, so that only the activations' rounding tells them apart.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "support/random.h"

namespace qt::test {

// vocab 512, hidden 128, intermediate 256, two layers, the attention shape given; positions up
// to 4096.
inline ModelConfig tiny_model(int heads, int kv_heads, int head_dim, bool tied) {
  ModelConfig c;
  c.preset = "";
  c.vocab_size = 512;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_layers = 2;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.tie_word_embeddings = tied;
  c.max_position_embeddings = 4096;
  return c;
}

inline float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Weights of N(0, 0.05), norm weights 1 + N(0, 0.05), the lm head (or the tied embedding)
// times `head_scale` (spreads the logits), every value rounded to bf16.
inline std::vector<float> bf16_weights(const ModelConfig& c, std::mt19937_64& rng,
                                       double head_scale = 1.0) {
  const ParamLayout layout(c);
  std::vector<float> p = random_vector<float>(layout.numel(), rng, 0.05);
  const std::string head = c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  for (const ParamInfo& info : layout.params())
    for (std::size_t i = 0; i < info.numel; ++i) {
      float& x = p[info.offset + i];
      if (info.shape.size() == 1) x += 1.0f;
      else if (info.name == head) x *= static_cast<float>(head_scale);
    }
  for (float& x : p) x = round_bf16(x);
  return p;
}

// B x T random tokens of a vocabulary; targets random with every 7th (i % 7 == 3) ignored
// (-100); positions of packed rows: documents of 1 to 80 tokens, cut at each row's end (some
// cross a 64-key tile). counted: the targets that are not ignored.
struct TokenBatch {
  std::vector<std::int32_t> inputs, targets, positions;
  long counted = 0;
};

inline TokenBatch random_batch(int B, int T, int vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> tok(0, vocab - 1);
  TokenBatch b;
  const int n = B * T;
  b.inputs.resize(n);
  b.targets.resize(n);
  b.positions.resize(n);
  for (int i = 0, len = 0; i < n; ++i) {
    b.inputs[i] = tok(rng);
    b.targets[i] = i % 7 == 3 ? -100 : tok(rng);
    b.counted += b.targets[i] != -100;
    if (i % T == 0 || len == 0) {
      len = 1 + static_cast<int>(rng() % 80);
      b.positions[i] = 0;
    } else {
      b.positions[i] = b.positions[i - 1] + 1;
    }
    --len;
  }
  return b;
}

}  // namespace qt::test
