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
#include "support/compare.h"

namespace qt {
namespace {

using test::rel_error;

namespace fs = std::filesystem;

// Minimal readers for the fixture files (written by h5py); any failure fails the test.
struct Fixture {
  hid_t file;
  explicit Fixture(const std::string& path) : file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)) {}
  ~Fixture() {
    if (file >= 0) H5Fclose(file);
  }
  double attr(const char* name) const {
    double v = NAN;
    hid_t a = H5Aopen(file, name, H5P_DEFAULT);
    if (a >= 0) {
      H5Aread(a, H5T_NATIVE_DOUBLE, &v);
      H5Aclose(a);
    }
    return v;
  }
  std::vector<std::int64_t> shape(const std::string& name) const {
    hid_t d = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
    if (d < 0) return {};
    hid_t s = H5Dget_space(d);
    std::vector<hsize_t> dims(H5Sget_simple_extent_ndims(s));
    H5Sget_simple_extent_dims(s, dims.data(), nullptr);
    H5Sclose(s);
    H5Dclose(d);
    return {dims.begin(), dims.end()};
  }
  template <typename T>
  std::vector<T> read(const std::string& name, hid_t mem_type) const {
    std::int64_t n = 1;
    for (auto d : shape(name)) n *= d;
    std::vector<T> out(static_cast<std::size_t>(n));
    hid_t d = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
    if (d < 0 || H5Dread(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0) out.clear();
    if (d >= 0) H5Dclose(d);
    return out;
  }
};

std::vector<std::string> fixture_files() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(QT_FIXTURE_DIR))
    if (e.path().extension() == ".h5") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

class TransformersFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformersFixture, LogitsLossAndGradientsMatch) {
  Fixture fx(GetParam());
  ASSERT_GE(fx.file, 0) << "cannot open " << GetParam();
  ModelConfig c;
  c.vocab_size = static_cast<int>(fx.attr("vocab_size"));
  c.hidden_size = static_cast<int>(fx.attr("hidden_size"));
  c.intermediate_size = static_cast<int>(fx.attr("intermediate_size"));
  c.num_layers = static_cast<int>(fx.attr("num_layers"));
  c.num_heads = static_cast<int>(fx.attr("num_heads"));
  c.num_kv_heads = static_cast<int>(fx.attr("num_kv_heads"));
  c.head_dim = static_cast<int>(fx.attr("head_dim"));
  c.rope_theta = fx.attr("rope_theta");
  c.rms_norm_eps = fx.attr("rms_norm_eps");
  c.tie_word_embeddings = fx.attr("tie_word_embeddings") != 0;
  ParamLayout layout(c);
  std::vector<float> params(layout.numel());
  for (const ParamInfo& p : layout.params()) {
    ASSERT_EQ(fx.shape("params/" + p.name), p.shape) << p.name;
    auto v = fx.read<float>("params/" + p.name, H5T_NATIVE_FLOAT);
    std::copy(v.begin(), v.end(), params.begin() + p.offset);
  }
  const auto ids_shape = fx.shape("input_ids");
  ASSERT_EQ(ids_shape.size(), 2u);
  const int B = static_cast<int>(ids_shape[0]), T = static_cast<int>(ids_shape[1]);
  auto ids = fx.read<std::int32_t>("input_ids", H5T_NATIVE_INT32);
  auto labels = fx.read<std::int32_t>("labels", H5T_NATIVE_INT32);
  // transformers shifts inside its loss: position t predicts labels[t + 1]; the last predicts nothing.
  std::vector<std::int32_t> targets(ids.size(), -100);
  long counted = 0;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t + 1 < T; ++t) {
      targets[b * T + t] = labels[b * T + t + 1];
      counted += targets[b * T + t] != -100;
    }
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

INSTANTIATE_TEST_SUITE_P(Golden, TransformersFixture, ::testing::ValuesIn(fixture_files()),
                         [](const auto& info) { return fs::path(info.param).stem().string(); });

}  // namespace
}  // namespace qt
