// Packing in the CPU model: the loss and every gradient of a packed batch (documents side by side
// in [B, T] rows, positions restarting at each document) equal the sums over the same documents
// run one by one as separate sequences. fp32 both ways; random weights and document lengths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "model/qwen3.h"
#include "support/compare.h"
#include "support/random.h"
#include "support/random_model.h"

namespace qt {
namespace {

using Row = std::vector<std::int32_t>;

ModelConfig small_config(bool tied) {
  ModelConfig c;
  c.vocab_size = 37;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.tie_word_embeddings = tied;
  c.rope_theta = 10000.0;
  return c;
}

struct Doc {
  Row inputs, targets;  // [L] each; targets -100 are not counted
};

// B rows of T tokens, each filled with documents of random lengths 1 .. T (the last one of a row
// cut to fit), inputs and targets random (some ignored).
struct Packed {
  int B, T;
  Row inputs, targets, positions;  // [B, T]
  std::vector<Doc> docs;

  Packed(int B_, int T_, int vocab, std::mt19937_64& rng) : B(B_), T(T_) {
    std::uniform_int_distribution<int> tok(0, vocab - 1);
    for (int b = 0; b < B; ++b) {
      int t = 0;
      while (t < T) {
        // Short documents often (several per row), sometimes one that fills the row.
        const int len = std::min<int>(T - t, 1 + static_cast<int>(rng() % (rng() % 3 ? 6 : T)));
        Doc d;
        for (int i = 0; i < len; ++i) {
          d.inputs.push_back(tok(rng));
          d.targets.push_back(rng() % 6 == 0 ? -100 : tok(rng));
          inputs.push_back(d.inputs.back());
          targets.push_back(d.targets.back());
          positions.push_back(i);
        }
        docs.push_back(std::move(d));
        t += len;
      }
    }
  }
};

// Loss and gradients (loss_scale 1) of the packed batch, with or without its positions.
double packed_run(const ModelConfig& cfg, const Packed& pk, const std::vector<float>& params,
                  std::vector<float>& grads, bool with_positions, bool recompute) {
  Qwen3Model model(cfg, pk.B, pk.T, recompute);
  grads.assign(params.size(), 0.0f);
  const double loss = model.forward(params.data(), pk.inputs.data(), pk.targets.data(),
                                    with_positions ? pk.positions.data() : nullptr);
  model.backward(params.data(), grads.data(), 1.0f);
  return loss;
}

// Sum of the losses and gradients of each document run alone as one sequence ([1, L]).
double one_by_one(const ModelConfig& cfg, const std::vector<Doc>& docs,
                  const std::vector<float>& params, std::vector<float>& grads) {
  grads.assign(params.size(), 0.0f);
  double loss = 0;
  for (const Doc& d : docs) {
    Qwen3Model model(cfg, 1, static_cast<int>(d.inputs.size()), false);
    loss += model.forward(params.data(), d.inputs.data(), d.targets.data());
    model.backward(params.data(), grads.data(), 1.0f);  // accumulates
  }
  return loss;
}

TEST(PackedModel, LossAndGradientsEqualDocumentsOneByOne) {
  std::mt19937_64 rng(test::test_seed());
  for (bool tied : {false, true}) {
    const ModelConfig cfg = small_config(tied);
    const ParamLayout layout(cfg);
    const std::vector<float> params = test::random_model_params(layout, rng);
    const Packed pk(3, 29, cfg.vocab_size, rng);
    ASSERT_GT(pk.docs.size(), 3u);

    std::vector<float> g_ref, g_packed, g_recompute, g_plain;
    const double l_ref = one_by_one(cfg, pk.docs, params, g_ref);
    const double l_packed = packed_run(cfg, pk, params, g_packed, true, false);
    const double l_recompute = packed_run(cfg, pk, params, g_recompute, true, true);
    SCOPED_TRACE(testing::Message() << "tied " << tied << ", " << pk.docs.size() << " documents");
    ASSERT_TRUE(std::isfinite(l_packed));
    EXPECT_NEAR(l_packed, l_ref, 1e-5 * std::abs(l_ref));
    EXPECT_EQ(l_recompute, l_packed) << "recompute gives the same bits";
    for (const ParamInfo& p : layout.params()) {
      const double e = test::rel_error(g_packed.data() + p.offset, g_ref.data() + p.offset, p.numel);
      EXPECT_LT(e, 1e-5) << p.name;
      EXPECT_EQ(test::rel_error(g_recompute.data() + p.offset, g_packed.data() + p.offset, p.numel), 0)
          << p.name;
    }
    // The test can fail: without positions, attention crosses documents and the gradients move
    // far beyond the tolerance above. (The summed loss alone is no sure check: the per-document
    // changes have either sign and can nearly cancel.)
    packed_run(cfg, pk, params, g_plain, false, false);
    const double crossed = test::rel_error(g_plain, g_ref);
    std::printf("tied %d: gradient error without positions %.3e\n", tied, crossed);
    EXPECT_GT(crossed, 1e-2) << "attention without positions crosses documents";
  }
}

// A batch whose rows are single documents: positions 0..T-1 give the plain causal run.
TEST(PackedModel, OneDocumentPerRowIsThePlainRun) {
  std::mt19937_64 rng(test::test_seed() + 1);
  const ModelConfig cfg = small_config(false);
  const ParamLayout layout(cfg);
  const std::vector<float> params = test::random_model_params(layout, rng);
  const int B = 2, T = 11;
  std::uniform_int_distribution<int> tok(0, cfg.vocab_size - 1);
  Row inputs(B * T), targets(B * T), positions(B * T);
  for (int i = 0; i < B * T; ++i) {
    inputs[i] = tok(rng);
    targets[i] = tok(rng);
    positions[i] = i % T;
  }
  Qwen3Model a(cfg, B, T, false), b(cfg, B, T, false);
  std::vector<float> ga(params.size(), 0.0f), gb(params.size(), 0.0f);
  const double la = a.forward(params.data(), inputs.data(), targets.data(), positions.data());
  const double lb = b.forward(params.data(), inputs.data(), targets.data());
  a.backward(params.data(), ga.data(), 1.0f);
  b.backward(params.data(), gb.data(), 1.0f);
  EXPECT_NEAR(la, lb, 1e-6 * std::abs(lb));
  EXPECT_LT(test::rel_error(ga, gb), 1e-6);
}

}  // namespace
}  // namespace qt
