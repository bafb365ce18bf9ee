// The vision program (fp32, VisionCpuOps) against the independent fp64 reference
// (reference_vision.h): the forward by relative error, the backward by central finite
// differences of the reference's objective sum(merged * R) + sum_j sum(deepstack_j * R_j).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "support/compare.h"
#include "support/random.h"
#include "vision/reference_vision.h"
#include "vision/vision_cpu_ops.h"
#include "vision/vision_program.h"

namespace qt {
namespace {

VisionConfig tiny_config() {
  VisionConfig c;
  c.hidden_size = 32;
  c.num_heads = 2;
  c.intermediate_size = 48;
  c.depth = 2;
  c.out_hidden_size = 24;
  c.deepstack_visual_indexes = {0};
  return c;
}

// Weights of a sensible scale: Linear ~ N(0, 1/in), biases and norms near their init, the
// position table O(1), so every block's activations stay O(1).
std::vector<float> random_params(const ParamLayout& layout, std::mt19937_64& rng) {
  std::vector<float> p(layout.numel());
  std::normal_distribution<double> nd(0.0, 1.0);
  for (const auto& t : layout.params()) {
    const bool norm = t.name.find("norm") != std::string::npos;
    const bool bias = t.name.find("bias") != std::string::npos;
    double scale = 0.5, mean = 0.0;
    if (t.shape.size() >= 2 && t.name.find("pos_embed") == std::string::npos) {
      std::int64_t in = 1;
      for (std::size_t d = 1; d < t.shape.size(); ++d) in *= t.shape[d];
      scale = 1.0 / std::sqrt(double(in));
    } else if (norm && !bias) {
      mean = 1.0, scale = 0.2;
    } else if (bias) {
      scale = 0.2;
    }
    for (std::size_t i = 0; i < t.numel; ++i) p[t.offset + i] = static_cast<float>(mean + scale * nd(rng));
  }
  return p;
}

struct Case {
  VisionConfig cfg;
  std::vector<ImageGrid> grids;
  ParamLayout layout;
  std::vector<float> params, pixels;
  std::vector<double> params64, pixels64;
  test::ReferenceVision ref;
  Case(const VisionConfig& c, std::vector<ImageGrid> g, std::mt19937_64& rng)
      : cfg(c), grids(g), layout(vision_param_layout(c)), ref(c, g) {
    params = random_params(layout, rng);
    pixels = test::random_vector<float>(static_cast<std::size_t>(ref.patches()) * c.patch_dim(), rng, 0.5);
    params64.assign(params.begin(), params.end());
    pixels64.assign(pixels.begin(), pixels.end());
  }
  test::ReferenceVision::Outputs reference() const {
    return ref.forward(pixels64, [&](const std::string& n) { return &params64[layout.find(n).offset]; });
  }
};

TEST(VisionProgram, ForwardMatchesFp64Reference) {
  std::mt19937_64 rng(test::test_seed());
  VisionConfig c = tiny_config();
  c.hidden_size = 64;
  c.num_heads = 4;
  c.depth = 3;
  c.deepstack_visual_indexes = {0, 2};
  // a tall image, a 2-frame video (attention stays in each frame), a single merge block
  Case k(c, {{1, 6, 4}, {2, 4, 4}, {1, 2, 2}}, rng);
  VisionCpuOps ops;
  VisionProgram<VisionCpuOps> prog(c, ops);
  const VisionBatch batch = make_vision_batch(c, k.grids);
  ASSERT_EQ(batch.patches, k.ref.patches());
  prog.forward(k.pixels.data(), batch, k.params.data());
  const auto want = k.reference();
  ASSERT_EQ(static_cast<std::size_t>(prog.merged_rows()) * c.out_hidden_size, want.merged.size());
  const double e = test::rel_error(prog.merged(), want.merged.data(), want.merged.size());
  std::printf("merged rel error %.3g\n", e);
  EXPECT_LT(e, 1e-5);
  ASSERT_EQ(prog.num_deepstack(), want.deepstack.size());
  for (std::size_t j = 0; j < want.deepstack.size(); ++j) {
    const double ej = test::rel_error(prog.deepstack(j), want.deepstack[j].data(), want.deepstack[j].size());
    std::printf("deepstack %zu rel error %.3g\n", j, ej);
    EXPECT_LT(ej, 1e-5) << "deepstack " << j;
  }
}

// Every tensor's gradient at sampled elements against central differences of the fp64
// reference; the position table at rows the images read.
TEST(VisionProgram, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(test::test_seed() + 1);
  const VisionConfig c = tiny_config();
  Case k(c, {{1, 4, 6}, {1, 2, 4}}, rng);
  VisionCpuOps ops;
  VisionProgram<VisionCpuOps> prog(c, ops);
  const VisionBatch batch = make_vision_batch(c, k.grids);
  prog.forward(k.pixels.data(), batch, k.params.data());
  const std::size_t out_n = static_cast<std::size_t>(prog.merged_rows()) * c.out_hidden_size;
  const auto R0 = test::random_vector<double>(out_n, rng);
  const auto R1 = test::random_vector<double>(out_n, rng);
  const std::vector<float> r0(R0.begin(), R0.end()), r1(R1.begin(), R1.end());
  std::vector<float> grads(k.layout.numel(), 0.0f);
  prog.backward(r0.data(), {r1.data()}, grads.data());

  auto objective = [&]() {
    const auto o = k.reference();
    double s = 0;
    for (std::size_t i = 0; i < out_n; ++i) s += o.merged[i] * R0[i] + o.deepstack[0][i] * R1[i];
    return s;
  };
  const std::set<int> rows = k.ref.used_table_rows();
  const std::vector<int> pos_rows(rows.begin(), rows.end());
  const double h = 1e-5;
  double worst = 0;
  std::string worst_name;
  for (const auto& t : k.layout.params()) {
    std::vector<double> got, want;
    double all = 0;  // the whole tensor's gradient norm, a floor for the comparison's scale
    for (std::size_t i = 0; i < t.numel; ++i) all += double(grads[t.offset + i]) * grads[t.offset + i];
    for (int s = 0; s < 4; ++s) {
      std::size_t i;
      if (t.name.find("pos_embed") != std::string::npos) {
        const int row = pos_rows[rng() % pos_rows.size()];
        i = static_cast<std::size_t>(row) * c.hidden_size + rng() % c.hidden_size;
      } else {
        i = rng() % t.numel;
      }
      double& p = k.params64[t.offset + i];
      const double p0 = p;
      p = p0 + h;
      const double fp = objective();
      p = p0 - h;
      const double fm = objective();
      p = p0;
      want.push_back((fp - fm) / (2 * h));
      got.push_back(grads[t.offset + i]);
    }
    double num = 0, den = 0;
    for (std::size_t s = 0; s < got.size(); ++s) {
      num += (got[s] - want[s]) * (got[s] - want[s]);
      den += want[s] * want[s];
    }
    const double floor = 1e-2 * std::sqrt(all * got.size() / t.numel);
    const double err = std::sqrt(num) / std::max(std::sqrt(den), floor);
    EXPECT_LT(err, 1e-4) << t.name << ": program " << got[0] << " vs fd " << want[0];
    if (err > worst) worst = err, worst_name = t.name;
  }
  std::printf("worst gradient rel error %.3g (%s) over %zu tensors\n", worst, worst_name.c_str(),
              k.layout.params().size());
}


// The backward adds (+=) into the gradient buffer, a null deepstack gradient contributes nothing,
// and the gradients are linear in the output gradients: from prefilled G0,
// backward(R0, {R1}) - G0 == backward(R0, {null}) + backward(0, {R1}); backward keeps the forward's
// activations (it may run again).
TEST(VisionProgram, BackwardAccumulatesAndIsLinear) {
  std::mt19937_64 rng(test::test_seed() + 2);
  const VisionConfig c = tiny_config();
  Case k(c, {{1, 2, 4}, {1, 4, 2}}, rng);
  VisionCpuOps ops;
  VisionProgram<VisionCpuOps> prog(c, ops);
  const VisionBatch batch = make_vision_batch(c, k.grids);
  prog.forward(k.pixels.data(), batch, k.params.data());
  const std::size_t out_n = static_cast<std::size_t>(prog.merged_rows()) * c.out_hidden_size;
  const auto r0 = test::random_vector<float>(out_n, rng), r1 = test::random_vector<float>(out_n, rng);
  const std::vector<float> zero(out_n, 0.0f);
  const auto g0 = test::random_vector<float>(k.layout.numel(), rng);
  std::vector<float> both = g0, only_merged(k.layout.numel(), 0.0f), only_ds(k.layout.numel(), 0.0f);
  prog.backward(r0.data(), {r1.data()}, both.data());
  prog.backward(r0.data(), {nullptr}, only_merged.data());
  prog.backward(zero.data(), {r1.data()}, only_ds.data());
  std::vector<double> got(both.size()), want(both.size());
  for (std::size_t i = 0; i < both.size(); ++i) {
    got[i] = double(both[i]) - g0[i];
    want[i] = double(only_merged[i]) + only_ds[i];
  }
  EXPECT_LT(test::rel_error(got, want), 1e-5);
  // the deepstack merger of block 0 gets nothing from the merged output alone
  const auto& ds_fc2 = k.layout.find("model.visual.deepstack_merger_list.0.linear_fc2.weight");
  double s = 0;
  for (std::size_t i = 0; i < ds_fc2.numel; ++i) s += std::abs(only_merged[ds_fc2.offset + i]);
  EXPECT_EQ(s, 0.0);
  double t = 0;
  for (std::size_t i = 0; i < ds_fc2.numel; ++i) t += std::abs(only_ds[ds_fc2.offset + i]);
  EXPECT_GT(t, 0.0);
}

}  // namespace
}  // namespace qt
