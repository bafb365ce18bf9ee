// What the Hugging Face import/export tests (dense and Qwen3-MoE, under MPI) share: the world
// communicator, one seed for all ranks, bf16 rounding, an error expected on every rank, and the
// fixture of the import error tests (a model directory written as BF16 after an edit).
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hf/config.h"
#include "hf/safetensors.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "support/random.h"
#include "train/training_harness.h"

namespace qt::hf::test_util {

inline std::shared_ptr<MpiComm> world_comm() {
  return std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
}

inline void barrier() { MPI_Barrier(MPI_COMM_WORLD); }

// One seed for all ranks: the tests need identical data everywhere.
inline std::uint64_t shared_seed() {
  std::uint64_t s = test::test_seed();
  MPI_Bcast(&s, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return s;
}

inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// The dense model of the import/export tests: V 96, H 32, I 48, 2 layers, 4 q / 2 kv heads of 8.
inline ModelConfig small_model(bool tied) {
  ModelConfig c;
  c.preset = "";
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.tie_word_embeddings = tied;
  c.max_position_embeddings = 512;
  return c;
}

// Runs `f` on every rank, expecting a UserError whose text holds every part, on every rank.
inline void expect_error_everywhere(const std::function<void()>& f,
                                    const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    const std::string m = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' not in: " << m;
  }
  barrier();
}

// A model's tensors as BF16 in one model.safetensors under dir_/name, edited first: set up
// dir_, cfg_, layout_ and src_ (the values) in SetUp; file_tensors says how the layout's
// tensors are stored (as they are, or a MoE model's experts one by one).
class ImportErrorFixture : public ::testing::Test {
 protected:
  void TearDown() override {
    barrier();
    if (test::world_rank() == 0) std::filesystem::remove_all(dir_);
  }
  virtual std::vector<StTensorOut> file_tensors() const {
    std::vector<StTensorOut> ts;
    for (const ParamInfo& p : layout_->params())
      ts.push_back({p.name, StDType::kBF16, p.shape, nullptr, src_.data() + p.offset});
    return ts;
  }
  std::string model_dir(const std::string& name,
                        const std::function<void(std::vector<StTensorOut>&)>& edit) {
    const std::string d = dir_ + "/" + name;
    if (test::world_rank() == 0) {
      std::filesystem::create_directories(d);
      std::ofstream(d + "/config.json") << make_config_json(cfg_, {}).dump();
      std::vector<StTensorOut> ts = file_tensors();
      edit(ts);
      write_safetensors(d + "/model.safetensors", ts, {{"format", "pt"}});
    }
    barrier();
    return d;
  }
  static void erase(std::vector<StTensorOut>& ts, const std::string& name) {
    std::erase_if(ts, [&](const StTensorOut& t) { return t.name == name; });
  }
  static StTensorOut& find(std::vector<StTensorOut>& ts, const std::string& name) {
    return *std::find_if(ts.begin(), ts.end(),
                         [&](const StTensorOut& t) { return t.name == name; });
  }
  std::string dir_;
  ModelConfig cfg_;
  std::unique_ptr<ParamLayout> layout_;
  std::vector<float> src_;
};

}  // namespace qt::hf::test_util
