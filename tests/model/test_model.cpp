// The engine's Qwen3 forward and backward (fp32) against an independent fp64 evaluation
// (reference_model.h): loss and logits directly, gradients through central finite differences
// of the fp64 loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "model/qwen3.h"
#include "model/reference_model.h"
#include "runtime/rng.h"
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
};

ModelConfig tiny_config(const Case& k) {
  ModelConfig c;
  c.vocab_size = 24;
  c.hidden_size = 16;
  c.intermediate_size = 20;
  c.num_layers = 2;
  c.num_heads = k.heads;
  c.num_kv_heads = k.kv_heads;
  c.head_dim = k.head_dim;
  c.tie_word_embeddings = k.tied;
  c.rope_theta = 10000.0;
  return c;
}

struct Problem {
  ModelConfig cfg;
  ParamLayout layout;
  std::vector<float> params;
  std::vector<std::int32_t> inputs, targets;
  int B = 2, T = 7;
  long counted = 0;

  explicit Problem(const ModelConfig& c) : cfg(c), layout(c) {
    std::mt19937_64 rng(test::test_seed());
    params = test::random_model_params(layout, rng);
    std::uniform_int_distribution<int> tok(0, c.vocab_size - 1);
    for (int i = 0; i < B * T; ++i) {
      inputs.push_back(tok(rng));
      targets.push_back(i % 5 == 3 ? -100 : tok(rng));  // some ignored targets
      counted += targets.back() != -100;
    }
  }
  std::vector<double> params64() const { return {params.begin(), params.end()}; }
};

class ModelVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(ModelVsReference, ForwardMatchesFp64) {
  Problem pb(tiny_config(GetParam()));
  Qwen3Model model(pb.cfg, pb.B, pb.T, false);
  const double loss = model.forward(pb.params.data(), pb.inputs.data(), pb.targets.data()) / pb.counted;
  test::ReferenceModel ref(pb.cfg, pb.layout);
  std::vector<double> ref_logits;
  const double ref_loss = ref.loss(pb.params64(), pb.inputs, pb.targets, pb.B, pb.T, &ref_logits);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_LT(std::abs(loss - ref_loss) / std::abs(ref_loss), 1e-5) << loss << " vs " << ref_loss;
  std::vector<double> logits(model.logits(), model.logits() + ref_logits.size());
  EXPECT_LT(rel_error(logits, ref_logits), 1e-5);
}

TEST_P(ModelVsReference, BackwardMatchesFiniteDifferencesOfFp64) {
  Problem pb(tiny_config(GetParam()));
  Qwen3Model model(pb.cfg, pb.B, pb.T, false);
  std::vector<float> grads(pb.layout.numel(), 0.0f);
  model.forward(pb.params.data(), pb.inputs.data(), pb.targets.data());
  model.backward(pb.params.data(), grads.data(), 1.0f / pb.counted);

  test::ReferenceModel ref(pb.cfg, pb.layout);
  std::vector<double> p = pb.params64(), fd(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double h = 1e-6 * std::max(1.0, std::abs(p[i])), keep = p[i];
    p[i] = keep + h;
    const double up = ref.loss(p, pb.inputs, pb.targets, pb.B, pb.T);
    p[i] = keep - h;
    const double down = ref.loss(p, pb.inputs, pb.targets, pb.B, pb.T);
    p[i] = keep;
    fd[i] = (up - down) / (2 * h);
  }
  std::vector<double> g(grads.begin(), grads.end());
  for (double x : g) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LT(rel_error(g, fd), 2e-5);
  // Per tensor too, so a wrong small tensor (a norm weight) cannot hide in the total.
  for (const ParamInfo& info : pb.layout.params()) {
    std::vector<double> a(g.begin() + info.offset, g.begin() + info.offset + info.numel);
    std::vector<double> b(fd.begin() + info.offset, fd.begin() + info.offset + info.numel);
    EXPECT_LT(rel_error(a, b), 1e-4) << info.name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ModelVsReference,
    ::testing::Values(Case{"tied_gqa2_hd8", 4, 2, 8, true}, Case{"untied_gqa2_hd8", 4, 2, 8, false},
                      Case{"tied_gqa4_hd4", 4, 1, 4, true}, Case{"untied_mha_hd8", 2, 2, 8, false}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Model, RecomputeGivesIdenticalGradients) {
  Problem pb(tiny_config({"x", 4, 2, 8, false}));
  std::vector<float> g0(pb.layout.numel(), 0.0f), g1(pb.layout.numel(), 0.0f);
  Qwen3Model plain(pb.cfg, pb.B, pb.T, false), recompute(pb.cfg, pb.B, pb.T, true);
  const double l0 = plain.forward(pb.params.data(), pb.inputs.data(), pb.targets.data());
  plain.backward(pb.params.data(), g0.data(), 0.5f);
  const double l1 = recompute.forward(pb.params.data(), pb.inputs.data(), pb.targets.data());
  recompute.backward(pb.params.data(), g1.data(), 0.5f);
  EXPECT_EQ(l0, l1);
  EXPECT_EQ(g0, g1);
}

TEST(Model, BackwardAccumulatesIntoGradients) {
  Problem pb(tiny_config({"x", 4, 2, 8, true}));
  Qwen3Model model(pb.cfg, pb.B, pb.T, false);
  std::vector<float> once(pb.layout.numel(), 0.0f), twice(pb.layout.numel(), 0.0f);
  model.forward(pb.params.data(), pb.inputs.data(), pb.targets.data());
  model.backward(pb.params.data(), once.data(), 1.0f);
  for (int r = 0; r < 2; ++r) {
    model.forward(pb.params.data(), pb.inputs.data(), pb.targets.data());
    model.backward(pb.params.data(), twice.data(), 1.0f);
  }
  for (std::size_t i = 0; i < once.size(); ++i)
    ASSERT_NEAR(twice[i], 2 * once[i], 1e-5 * (1 + std::abs(once[i]))) << i;
}

TEST(Init, DeterministicMeshIndependentAndAsTransformers) {
  ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 128;
  ParamLayout layout(c);
  std::vector<float> a(layout.numel()), b(layout.numel()), other(layout.numel());
  init_params(c, layout, 7, a.data());
  init_params(c, layout, 7, b.data());
  init_params(c, layout, 8, other.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
  const ParamInfo& e = layout.find("model.embed_tokens.weight");
  double sum = 0, sumsq = 0;
  for (std::size_t i = 0; i < e.numel; ++i) {
    sum += a[e.offset + i];
    sumsq += double(a[e.offset + i]) * a[e.offset + i];
  }
  const double mean = sum / e.numel, sd = std::sqrt(sumsq / e.numel - mean * mean);
  EXPECT_LT(std::abs(mean), 0.001);
  EXPECT_NEAR(sd, c.initializer_range, 0.001);
  const ParamInfo& n = layout.find("model.layers.1.post_attention_layernorm.weight");
  for (std::size_t i = 0; i < n.numel; ++i) EXPECT_EQ(a[n.offset + i], 1.0f);
}

// A model large enough for the threaded path (many 1M-element slices): every element is the
// counter-based value of (seed, tensor name, index), computed here one by one.
TEST(Init, ThreadedFillMatchesElementFormula) {
  ModelConfig c;
  c.vocab_size = 8192;
  c.hidden_size = 512;
  c.intermediate_size = 1024;
  c.num_layers = 3;
  c.tie_word_embeddings = false;
  ParamLayout layout(c);
  ASSERT_GT(layout.numel(), std::size_t{10} << 20);
  std::vector<float> w(layout.numel(), std::nanf(""));
  init_params(c, layout, 11, w.data());
  std::size_t bad = 0;
  for (const ParamInfo& p : layout.params()) {
    const std::uint64_t stream = rng::hash_combine(11, rng::hash_string(p.name));
    for (std::size_t i = 0; i < p.numel; ++i) {
      const float want = p.shape.size() == 1
                             ? 1.0f
                             : static_cast<float>(c.initializer_range * rng::normal(stream, i));
      bad += w[p.offset + i] != want;
    }
  }
  EXPECT_EQ(bad, 0u) << "of " << layout.numel() << " elements";
}

// init_params over flat pieces (a sharded state's) gives the full init's bits: pieces that
// start and end mid-tensor and span several tensors, empty, single and overlapping ones; the
// large model's partition is enough work for several threads.
TEST(Init, PiecesMatchTheFullInit) {
  ModelConfig small;
  small.vocab_size = 40;
  small.hidden_size = 16;
  small.intermediate_size = 24;
  small.num_layers = 2;
  small.num_heads = 2;
  small.num_kv_heads = 1;
  small.head_dim = 8;
  ModelConfig large = small;  // about 10M parameters: more than 8 slices of 1M elements
  large.vocab_size = 8192;
  large.hidden_size = 512;
  large.intermediate_size = 1024;
  large.num_layers = 1;
  large.tie_word_embeddings = false;
  for (const ModelConfig* cp : {&small, &large}) {
    const ModelConfig& c = *cp;
    const ParamLayout layout(c);
    const std::size_t n = layout.numel();
    std::vector<float> full(n);
    init_params(c, layout, 5, full.data());
    const int trials = cp == &small ? 12 : 1;
    for (int trial = 0; trial < trials; ++trial) {
      const std::uint64_t seed = test::test_seed() + trial;
      std::mt19937_64 rng(seed);
      // A partition of [0, n) at random cuts, then random extra ranges (overlapping the rest).
      std::vector<std::size_t> cut{0, n};
      for (int i = 0; i < 24; ++i) cut.push_back(rng() % (n + 1));
      std::sort(cut.begin(), cut.end());
      std::vector<Range> ranges;
      for (std::size_t i = 0; i + 1 < cut.size(); ++i) ranges.push_back({cut[i], cut[i + 1]});
      for (int i = 0; i < 6; ++i) {
        const std::size_t a = rng() % n, len = rng() % 3 == 0 ? 1 : rng() % (n - a + 1);
        ranges.push_back({a, a + len});
      }
      std::shuffle(ranges.begin(), ranges.end(), rng);
      std::vector<std::vector<float>> bufs;  // each [size + 2]: a guard on either side
      for (const Range& r : ranges) bufs.emplace_back(r.size() + 2, -3.0f);
      std::vector<FlatPiece> pieces;
      for (std::size_t i = 0; i < ranges.size(); ++i)
        pieces.push_back({ranges[i], bufs[i].data() + 1});
      init_params(c, layout, 5, pieces);
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        const Range r = ranges[i];
        EXPECT_EQ(0,
                  std::memcmp(bufs[i].data() + 1, full.data() + r.begin, r.size() * sizeof(float)))
            << "piece [" << r.begin << ", " << r.end << ") of " << n << ", seed " << seed;
        EXPECT_EQ(bufs[i].front(), -3.0f)
            << "written before piece [" << r.begin << ", " << r.end << ")";
        EXPECT_EQ(bufs[i].back(), -3.0f)
            << "written after piece [" << r.begin << ", " << r.end << ")";
      }
    }
  }
}

TEST(Layout, TransformersNamesAndShapes) {
  ModelConfig c = *model_preset("qwen3-0.6b");
  ParamLayout layout(c);
  EXPECT_EQ(layout.numel(), static_cast<std::size_t>(c.num_params()));
  EXPECT_EQ(layout.find("model.layers.3.self_attn.q_proj.weight").shape,
            (std::vector<std::int64_t>{2048, 1024}));
  EXPECT_EQ(layout.find("model.layers.3.self_attn.o_proj.weight").shape,
            (std::vector<std::int64_t>{1024, 2048}));
  EXPECT_EQ(layout.find("model.layers.27.mlp.down_proj.weight").shape,
            (std::vector<std::int64_t>{1024, 3072}));
  EXPECT_FALSE(layout.find("model.layers.0.self_attn.k_norm.weight").weight_decay);
  c.tie_word_embeddings = false;
  EXPECT_EQ(ParamLayout(c).find("lm_head.weight").shape, (std::vector<std::int64_t>{151936, 1024}));
}

TEST(Layout, SplitRangeCoversEverythingOnce) {
  for (std::size_t n : {0ul, 1ul, 7ul, 100ul, 101ul})
    for (int parts : {1, 2, 3, 4, 7}) {
      std::size_t next = 0;
      for (int i = 0; i < parts; ++i) {
        Range r = split_range(n, parts, i);
        EXPECT_EQ(r.begin, next);
        EXPECT_LE(r.end, n);
        next = r.end;
      }
      EXPECT_EQ(next, n);
    }
}

}  // namespace
}  // namespace qt
