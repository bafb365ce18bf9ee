// The CPU engine's Qwen3-MoE against golden fixtures written by transformers
// (make_moe_fixtures.py: fp32, eager attention and experts, output_router_logits): logits, the
// cross-entropy, the load-balancing loss and every gradient of ce + coef x aux, for the same
// weights and tokens. Two variants: norm_topk_prob true with a dense layer among the sparse ones
// (mlp_only_layers), and false with decoder_sparse_step 2 and tied embeddings.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "model/qwen3.h"
#include "qtrain/params.h"
#include "reference/fixture.h"
#include "support/compare.h"

namespace qt {
namespace {

using test::Fixture;
using test::rel_error;

class MoeFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeFixture, LogitsLossesAndGradientsMatch) {
  const std::string path = std::string(QT_MOE_FIXTURE_DIR) + "/" + GetParam() + ".h5";
  Fixture fx(path);
  ASSERT_GE(fx.file, 0) << "cannot open " << path;
  const ModelConfig c = fx.config();
  ASSERT_TRUE(c.is_moe()) << path << " has no num_experts attribute";
  ASSERT_GT(c.num_moe_layers(), 0);
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

  Qwen3Model model(c, B, T, /*recompute=*/GetParam().find("tied") != std::string::npos);
  model.set_moe_aux_scale(static_cast<float>(c.router_aux_loss_coef));  // one micro-batch
  const double ce = model.forward(params.data(), ids.data(), targets.data()) / counted;
  const double aux = model.moe_aux_loss();
  const float ref_ce = fx.read<float>("ce_loss", H5T_NATIVE_FLOAT).at(0);
  const float ref_aux = fx.read<float>("aux_loss", H5T_NATIVE_FLOAT).at(0);
  EXPECT_LT(std::abs(ce - ref_ce) / std::abs(ref_ce), 1e-5) << ce << " vs " << ref_ce;
  EXPECT_LT(std::abs(aux - ref_aux) / std::abs(ref_aux), 1e-5) << aux << " vs " << ref_aux;
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
  std::printf("ce %.7f (transformers %.7f), aux %.7f (%.7f), logits rel err %.2e, worst "
              "gradient rel err %.2e\n",
              ce, ref_ce, aux, ref_aux, logits_err, worst);
}

INSTANTIATE_TEST_SUITE_P(Golden, MoeFixture,
                         ::testing::Values("moe_norm_topk", "moe_no_norm_topk_tied"));

}  // namespace
}  // namespace qt
