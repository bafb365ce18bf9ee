// Reader for the golden fixture files written by make_fixtures.py (h5py): the model config as
// attributes, params/<name> and grads/<name> datasets, input_ids, labels, logits and loss. Any
// failure to read yields an empty result, which the tests turn into a failure.
#pragma once

#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "qtrain/model_config.h"
#include "qtrain/params.h"

namespace qt::test {

struct Fixture {
  hid_t file;
  explicit Fixture(const std::string& path)
      : file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)) {}
  ~Fixture() {
    if (file >= 0) H5Fclose(file);
  }
  Fixture(const Fixture&) = delete;
  Fixture& operator=(const Fixture&) = delete;

  double attr(const char* name) const {
    double v = NAN;
    hid_t a = H5Aopen(file, name, H5P_DEFAULT);
    if (a >= 0) {
      H5Aread(a, H5T_NATIVE_DOUBLE, &v);
      H5Aclose(a);
    }
    return v;
  }
  // An integer array attribute (empty when absent).
  std::vector<std::int64_t> attr_list(const char* name) const {
    std::vector<std::int64_t> v;
    hid_t a = H5Aopen(file, name, H5P_DEFAULT);
    if (a < 0) return v;
    hid_t s = H5Aget_space(a);
    v.resize(static_cast<std::size_t>(H5Sget_simple_extent_npoints(s)));
    H5Sclose(s);
    if (H5Aread(a, H5T_NATIVE_INT64, v.data()) < 0) v.clear();
    H5Aclose(a);
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

  ModelConfig config() const {
    ModelConfig c;
    c.vocab_size = static_cast<int>(attr("vocab_size"));
    c.hidden_size = static_cast<int>(attr("hidden_size"));
    c.intermediate_size = static_cast<int>(attr("intermediate_size"));
    c.num_layers = static_cast<int>(attr("num_layers"));
    c.num_heads = static_cast<int>(attr("num_heads"));
    c.num_kv_heads = static_cast<int>(attr("num_kv_heads"));
    c.head_dim = static_cast<int>(attr("head_dim"));
    c.rope_theta = attr("rope_theta");
    c.rms_norm_eps = attr("rms_norm_eps");
    c.tie_word_embeddings = attr("tie_word_embeddings") != 0;
    if (!std::isnan(attr("rope_factor"))) {  // make_fixtures.py --yarn
      c.rope_type = "yarn";
      c.rope_factor = attr("rope_factor");
      c.rope_original_max_position_embeddings =
          static_cast<int>(attr("rope_original_max_positions"));
      c.max_position_embeddings = static_cast<int>(attr("max_position_embeddings"));
    }
    if (!std::isnan(attr("num_experts"))) {  // Qwen3-MoE (make_moe_fixtures.py)
      c.num_experts = static_cast<int>(attr("num_experts"));
      c.num_experts_per_tok = static_cast<int>(attr("num_experts_per_tok"));
      c.moe_intermediate_size = static_cast<int>(attr("moe_intermediate_size"));
      c.norm_topk_prob = attr("norm_topk_prob") != 0;
      c.decoder_sparse_step = static_cast<int>(attr("decoder_sparse_step"));
      c.router_aux_loss_coef = attr("router_aux_loss_coef");
      for (std::int64_t l : attr_list("mlp_only_layers"))  // [-1]: none (h5py has no empty list)
        if (l >= 0) c.mlp_only_layers.push_back(static_cast<int>(l));
    }
    return c;
  }

  // The flat parameter buffer in `layout` order; empty if a tensor is missing or misshapen.
  std::vector<float> params(const ParamLayout& layout) const {
    std::vector<float> flat(layout.numel());
    for (const ParamInfo& p : layout.params()) {
      if (shape("params/" + p.name) != p.shape) return {};
      const auto v = read<float>("params/" + p.name, H5T_NATIVE_FLOAT);
      if (v.size() != p.numel) return {};
      std::copy(v.begin(), v.end(), flat.begin() + p.offset);
    }
    return flat;
  }

  // Our targets from transformers' labels: it shifts inside its loss, so position t predicts
  // labels[t + 1] and the last position predicts nothing (-100). Returns the counted targets.
  long targets(int B, int T, std::vector<std::int32_t>& out) const {
    const auto labels = read<std::int32_t>("labels", H5T_NATIVE_INT32);
    out.assign(static_cast<std::size_t>(B) * T, -100);
    if (labels.size() != out.size()) return 0;
    long counted = 0;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t + 1 < T; ++t) {
        out[b * T + t] = labels[b * T + t + 1];
        counted += out[b * T + t] != -100;
      }
    return counted;
  }
};

// The fixture files (*.h5) of `dir`, sorted; none when it is missing.
inline std::vector<std::string> fixture_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(dir, ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    if (it->path().extension() == ".h5") out.push_back(it->path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Where the fixture tests find the fixtures: $QTRAIN_FIXTURE_DIR alone when it is set, else
// `compiled_in` (the source tree's absolute tests/reference/fixtures), else
// tests/reference/fixtures below the working directory (a copy of the repository root, as on
// the GPU machine). Finding none is a failure of the test program (FixtureSearch::missing), never
// a pass with nothing checked.
struct FixtureSearch {
  std::vector<std::string> files;     // of the first directory with any; empty when none has
  std::vector<std::string> searched;  // the directories looked in, absolute, in order
  // The failure message when files is empty.
  std::string missing() const {
    std::string dirs;
    for (const std::string& d : searched) dirs += (dirs.empty() ? "" : ", ") + d;
    return "no golden fixture (*.h5) found: searched " + dirs +
           "; set QTRAIN_FIXTURE_DIR to the repository's tests/reference/fixtures";
  }
};

inline FixtureSearch find_fixtures(const std::string& compiled_in) {
  namespace fs = std::filesystem;
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("QTRAIN_FIXTURE_DIR"))
    dirs = {env};
  else
    dirs = {compiled_in, "tests/reference/fixtures"};
  FixtureSearch s;
  for (const std::string& d : dirs) {
    std::error_code ec;
    s.searched.push_back(fs::absolute(d, ec).lexically_normal().string());
    s.files = fixture_files(d);
    if (!s.files.empty()) break;
  }
  return s;
}

}  // namespace qt::test
