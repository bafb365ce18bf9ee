// KvDecoder (src/generate/kv_decoder.h) against the training model: the logits of a prefill plus
// token-by-token decoding with the key/value cache equal Qwen3Model::forward's logits of the whole
// sequence (fp32, relative error <= 1e-5), and greedy decoding is the argmax chain of full
// forwards over the growing sequence.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "generate/kv_decoder.h"
#include "generate/sampler.h"
#include "model/qwen3.h"
#include "ops/cross_entropy.h"
#include "support/compare.h"
#include "support/random.h"
#include "support/random_model.h"

namespace qt {
namespace {

using test::rel_error;

struct Case {
  const char* name;
  int heads, kv_heads, head_dim;
  bool tied;
  int experts = 0;  // Qwen3-MoE: 6 experts, 2 a token, layer 1 dense
};

// GQA 2 (4 query heads on 2 kv heads), head_dim 64 and 128, tied and untied lm head.
const Case kCases[] = {{"gqa2_hd64_tied", 4, 2, 64, true},
                       {"gqa2_hd64_untied", 4, 2, 64, false},
                       {"gqa2_hd128_tied", 4, 2, 128, true},
                       {"gqa2_hd128_untied", 4, 2, 128, false},
                       {"moe_gqa2_hd64_untied", 4, 2, 64, false, 6}};

ModelConfig config(const Case& k) {
  ModelConfig c;
  c.vocab_size = 101;
  c.hidden_size = 48;
  c.intermediate_size = 80;
  c.num_layers = 2;
  c.num_heads = k.heads;
  c.num_kv_heads = k.kv_heads;
  c.head_dim = k.head_dim;
  c.tie_word_embeddings = k.tied;
  c.rope_theta = 10000.0;
  if (k.experts > 0) {
    c.num_layers = 3;
    c.num_experts = k.experts;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 24;
    c.mlp_only_layers = {1};
  }
  return c;
}

std::vector<float> random_params(const ModelConfig& c, std::mt19937_64& rng) {
  return test::random_model_params(ParamLayout(c), rng);
}

std::vector<std::int32_t> random_tokens(int n, int V, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> tok(0, V - 1);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& t : ids) t = tok(rng);
  return ids;
}

// [T, V] logits of the training model's forward over `ids` (one sequence).
std::vector<float> full_logits(const ModelConfig& c, const std::vector<float>& params,
                               const std::vector<std::int32_t>& ids) {
  const int T = static_cast<int>(ids.size());
  Qwen3Model model(c, 1, T, false);
  const std::vector<std::int32_t> targets(ids.size(), cpu::kIgnoreIndex);
  model.forward(params.data(), ids.data(), targets.data());
  return std::vector<float>(model.logits(),
                            model.logits() + static_cast<std::size_t>(T) * c.vocab_size);
}

class KvDecoderTest : public ::testing::TestWithParam<Case> {};

TEST_P(KvDecoderTest, PrefillAndStepsEqualFullForward) {
  const ModelConfig c = config(GetParam());
  std::mt19937_64 rng(test::test_seed());
  const std::vector<float> params = random_params(c, rng);
  const int T = 13, V = c.vocab_size;
  const std::vector<std::int32_t> ids = random_tokens(T, V, rng);
  const std::vector<float> want = full_logits(c, params, ids);

  gen::KvDecoder dec(c, params.data(), T);
  // Prefill lengths: one token (all steps), a part, the whole sequence in one pass.
  for (int prefill : {1, 5, T}) {
    dec.reset();
    std::vector<float> got;
    const float* l = dec.append(std::span(ids.data(), prefill), true);  // [prefill, V]
    got.insert(got.end(), l, l + static_cast<std::size_t>(prefill) * V);
    for (int t = prefill; t < T; ++t) {
      l = dec.append(std::span(ids.data() + t, 1));  // [V]
      got.insert(got.end(), l, l + V);
    }
    ASSERT_EQ(dec.length(), T);
    const double err = rel_error(got, want);
    EXPECT_LE(err, 1e-5) << "prefill " << prefill;
    // The last-row-only logits of a prefill are the last row of the all-rows ones.
    dec.reset();
    const float* last = dec.append(std::span(ids.data(), prefill));
    EXPECT_LE(rel_error(last, want.data() + static_cast<std::size_t>(prefill - 1) * V, V), 1e-5)
        << "prefill " << prefill << ", last row only";
  }
}

TEST_P(KvDecoderTest, GreedyIsArgmaxChainOfFullForwards) {
  const ModelConfig c = config(GetParam());
  std::mt19937_64 rng(test::test_seed() + 1);
  const std::vector<float> params = random_params(c, rng);
  const int V = c.vocab_size, prompt_len = 4, steps = 6;
  std::vector<std::int32_t> seq = random_tokens(prompt_len, V, rng);

  gen::KvDecoder dec(c, params.data(), prompt_len + steps);
  gen::Sampler greedy(0.0, 1.0, 0);
  const float* logits = dec.append(seq);
  for (int s = 0; s < steps; ++s) {
    const std::int32_t ours = greedy.next(logits, V);
    // The reference: a full forward over the whole sequence so far, argmax of its last row.
    const std::vector<float> full = full_logits(c, params, seq);
    const float* last = full.data() + (seq.size() - 1) * V;
    const std::int32_t want = gen::argmax(last, V);
    std::vector<float> sorted(last, last + V);
    std::sort(sorted.rbegin(), sorted.rend());
    // A near-tie (gap below the fp32 agreement of the two paths) may go either way.
    if (sorted[0] - sorted[1] > 1e-4f * std::max(1.0f, std::abs(sorted[0])))
      EXPECT_EQ(ours, want) << "step " << s;
    else
      EXPECT_TRUE(ours == want || last[ours] == sorted[1]) << "step " << s;
    seq.push_back(ours);
    if (s + 1 < steps) logits = dec.append(std::span(&seq.back(), 1));
  }
  EXPECT_EQ(dec.length(), prompt_len + steps - 1);
}

INSTANTIATE_TEST_SUITE_P(Cases, KvDecoderTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// cached_attention against a direct evaluation in double, for one query over a random cache.
TEST(CachedAttention, MatchesDirectSoftmaxInDouble) {
  std::mt19937_64 rng(test::test_seed() + 2);
  const int len = 9, nh = 6, nkv = 2, hd = 32;
  const auto q = test::random_vector<float>(static_cast<std::size_t>(nh) * hd, rng);
  const auto k = test::random_vector<float>(static_cast<std::size_t>(len) * nkv * hd, rng);
  const auto v = test::random_vector<float>(static_cast<std::size_t>(len) * nkv * hd, rng);
  std::vector<float> out(static_cast<std::size_t>(nh) * hd);
  gen::cached_attention(out.data(), q.data(), k.data(), v.data(), len, nh, nkv, hd);
  std::vector<double> want(out.size());
  for (int h = 0; h < nh; ++h) {
    const int g = h / (nh / nkv);
    std::vector<double> s(len);
    double m = -1e300, sum = 0;
    for (int j = 0; j < len; ++j) {
      double d = 0;
      for (int x = 0; x < hd; ++x) d += double(q[h * hd + x]) * k[(j * nkv + g) * hd + x];
      s[j] = d / std::sqrt(double(hd));
      m = std::max(m, s[j]);
    }
    for (int j = 0; j < len; ++j) sum += (s[j] = std::exp(s[j] - m));
    for (int j = 0; j < len; ++j)
      for (int x = 0; x < hd; ++x) want[h * hd + x] += s[j] / sum * v[(j * nkv + g) * hd + x];
  }
  EXPECT_LE(rel_error(out, want), 1e-6);
}

}  // namespace
}  // namespace qt
