// The CPU engine against golden fixtures written by transformers (make_fixtures.py: fp32, eager
// attention): logits, loss and every gradient for the same weights and tokens.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "model/qwen3.h"
#include "qtrain/params.h"
#include "reference/fixture.h"
#include "support/compare.h"

namespace qt {
namespace {

using test::rel_error;

namespace fs = std::filesystem;

using test::Fixture;

class TransformersFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformersFixture, LogitsLossAndGradientsMatch) {
  Fixture fx(GetParam());
  ASSERT_GE(fx.file, 0) << "cannot open " << GetParam();
  const ModelConfig c = fx.config();
  ParamLayout layout(c);
  std::vector<float> params = fx.params(layout);
  ASSERT_EQ(params.size(), layout.numel()) << "a parameter is missing or misshapen";
  const auto ids_shape = fx.shape("input_ids");
  ASSERT_EQ(ids_shape.size(), 2u);
  const int B = static_cast<int>(ids_shape[0]), T = static_cast<int>(ids_shape[1]);
  auto ids = fx.read<std::int32_t>("input_ids", H5T_NATIVE_INT32);
  std::vector<std::int32_t> targets;
  const long counted = fx.targets(B, T, targets);
  ASSERT_GT(counted, 0);
  Qwen3Model model(c, B, T, false);
  const double loss = model.forward(params.data(), ids.data(), targets.data()) / counted;
  const auto ref_loss = fx.read<float>("loss", H5T_NATIVE_FLOAT);
  ASSERT_EQ(ref_loss.size(), 1u);
  EXPECT_LT(std::abs(loss - ref_loss[0]) / std::abs(ref_loss[0]), 1e-5) << loss << " vs " << ref_loss[0];
  const auto ref_logits = fx.read<float>("logits", H5T_NATIVE_FLOAT);
  ASSERT_EQ(ref_logits.size(), static_cast<std::size_t>(B) * T * c.vocab_size);
  const double logits_err = rel_error(model.logits(), ref_logits.data(), ref_logits.size());
  EXPECT_LT(logits_err, 1e-5);

  std::vector<float> grads(layout.numel(), 0.0f);
  model.backward(params.data(), grads.data(), 1.0f / counted);
  double worst = 0;
  for (const ParamInfo& p : layout.params()) {
    const auto ref = fx.read<float>("grads/" + p.name, H5T_NATIVE_FLOAT);
    ASSERT_EQ(ref.size(), p.numel) << p.name;
    const double err = rel_error(grads.data() + p.offset, ref.data(), p.numel);
    EXPECT_LT(err, 1e-4) << p.name;
    worst = std::max(worst, err);
  }
  std::printf("loss %.7f (transformers %.7f), logits rel err %.2e, worst gradient rel err %.2e\n",
              loss, ref_loss[0], logits_err, worst);
}

const test::FixtureSearch& fixtures() {
  static const test::FixtureSearch s = test::find_fixtures(QT_FIXTURE_DIR);
  return s;
}

// A program that finds no fixture checks nothing: that is a failure naming where it looked.
TEST(TransformersFixtureFiles, AreFound) {
  ASSERT_FALSE(fixtures().files.empty()) << fixtures().missing();
}

INSTANTIATE_TEST_SUITE_P(Golden, TransformersFixture, ::testing::ValuesIn(fixtures().files),
                         [](const auto& info) { return fs::path(info.param).stem().string(); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TransformersFixture);  // AreFound fails instead

}  // namespace
}  // namespace qt
