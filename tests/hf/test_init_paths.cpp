// model.init given as a path relative to the run's working directory, and the run's checkpoints
// used from another one (issue 15, case 14): generate and export --merge find the base through the
// absolute path stored at training time, adapter_config.json names it absolutely, a resumed run
// from elsewhere matches its base, a moved base is found with --base, and a checkpoint without the
// absolute path (written before it was stored) still resolves the path as given. One rank: the
// run, generate and export are all single-process here (their MPI paths have their own tests).
#include <gtest/gtest.h>
#include <hdf5.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "hf/export.h"
#include "io/hdf5_util.h"
#include "support/generate_cli.h"
#include "support/random.h"
#include "train/training_harness.h"

namespace qt::hf {
namespace {

namespace fs = std::filesystem;

// The working directory of the process, changed for the guard's lifetime.
class InDir {
 public:
  explicit InDir(const fs::path& d) : old_(fs::current_path()) { fs::current_path(d); }
  ~InDir() { fs::current_path(old_); }
  InDir(const InDir&) = delete;
  InDir& operator=(const InDir&) = delete;

 private:
  fs::path old_;
};

int export_cli(std::vector<std::string> args) {
  args.insert(args.begin(), "export");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return export_main(static_cast<int>(argv.size()), argv.data(), test::world_comm());
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A LoRA (or, with lora false, whole-model) run of 2 steps on the HF model in `init`.
std::string deck(const std::string& init, bool lora = true) {
  return "[model]\ninit = " + init +
         "\n[train]\nseq_len = 16\nmicro_batch = 1\nglobal_batch = 1\nsteps = 2\nseed = 5\n"
         "[optim]\nlr = 5e-2\nwarmup_steps = 0\n" +
         (lora ? "[lora]\nr = 4\nalpha = 8\ntargets = q_proj,v_proj,down_proj\n" : "") +
         "[checkpoint]\ndir = ck\nevery = 0\nresume = none\n[log]\nevery = 1\n";
}

class InitPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(test::world_size(), 1) << "one rank: generate is single-process";
    top_ = test::shared_temp_dir("init-paths");
    fs::create_directories(top_ / "run");
    fs::create_directories(top_ / "elsewhere");
    // The base: the tiny preset as an HF model with Qwen3's tokenizer (vocabulary 256: the
    // prompt "a" is byte token 64).
    ModelConfig c = *model_preset("tiny");
    c.preset = "";
    std::mt19937_64 rng(test::test_seed());
    std::vector<float> params = test::generation_weights(c, rng);
    test::write_hf_model(top_ / "run" / "base", c, params, QT_TOKENIZER_DIR,
                         {"tokenizer.json", "tokenizer_config.json"});
  }
  void TearDown() override { fs::remove_all(top_); }

  // Trains from top_/run with model.init = base (relative); returns the last checkpoint.
  fs::path train(bool lora = true) {
    InDir in(top_ / "run");
    const auto r = test::run(1, deck("base", lora), {}, (top_ / "m.jsonl").string());
    EXPECT_EQ(r.exit_code, 0) << r.error;
    return top_ / "run" / "ck" / "step_00000002.h5";
  }
  test::CliRun generate_from(const fs::path& cwd, std::vector<std::string> args) {
    InDir in(cwd);
    for (const char* a : {"--prompt", "a", "-n", "6"}) args.push_back(a);
    return test::run_generate(args);
  }

  fs::path top_;
};

TEST_F(InitPaths, LoraCheckpointUsedFromAnotherDirectory) {
  const fs::path ck = train();
  const test::CliRun here = generate_from(top_ / "run", {ck.string()});
  ASSERT_EQ(here.rc, 0) << here.err;
  // From another working directory: the stored absolute path finds the base and its tokenizer.
  const test::CliRun there = generate_from(top_ / "elsewhere", {ck.string()});
  EXPECT_EQ(there.rc, 0) << there.err;
  EXPECT_EQ(there.out, here.out);
  {
    InDir in(top_ / "elsewhere");
    EXPECT_EQ(export_cli({ck.string(), "merged", "--merge"}), 0);
    EXPECT_EQ(export_cli({ck.string(), "adapters"}), 0);
  }
  const fs::path base_abs = top_ / "run" / "base";
  EXPECT_TRUE(read_file(top_ / "elsewhere/merged/tokenizer.json") ==
              read_file(base_abs / "tokenizer.json"));
  const auto cfg = nlohmann::json::parse(read_file(top_ / "elsewhere/adapters/adapter_config.json"));
  EXPECT_EQ(cfg["base_model_name_or_path"], base_abs.string());
  // The resolved deck stored in the checkpoint has the absolute path, the given one as a comment.
  {
    h5::Handle f(H5Fopen(ck.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), h5::close_file);
    const std::string stored = h5::try_read_attr_string(f, "deck").value_or("");
    EXPECT_NE(stored.find("init = " + base_abs.string() + "  # given as base\n"), std::string::npos)
        << stored;
    EXPECT_EQ(h5::try_read_attr_string(f, "lora_base_init_abs").value_or(""), base_abs.string());
  }

  // Resumed from another working directory with model.init relative to that one: the same base.
  {
    InDir in(top_ / "elsewhere");
    const auto r = test::run(1, deck("../run/base"),
                             {"--checkpoint.resume=" + ck.string(), "--train.steps=3"},
                             (top_ / "m2.jsonl").string());
    EXPECT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 1u);
    EXPECT_EQ(r.steps[0].step, 3);
    // Another directory of the same name is another base.
    fs::create_directories("other");
    fs::copy(top_ / "run" / "base", "other/base");
    const auto bad = test::run(1, deck("other/base"), {"--checkpoint.resume=" + ck.string()},
                               (top_ / "m3.jsonl").string());
    EXPECT_EQ(bad.exit_code, 2);
    EXPECT_NE(bad.error.find("trained on the base model.init = base (" + base_abs.string() + ")"),
              std::string::npos)
        << bad.error;
  }

  {  // --force never replaces the base (nor a directory holding it).
    InDir in(top_ / "elsewhere");
    EXPECT_EQ(export_cli({ck.string(), base_abs.string(), "--force"}), 2);
    EXPECT_EQ(export_cli({ck.string(), (top_ / "run").string(), "--force"}), 2);
    EXPECT_TRUE(fs::exists(base_abs / "model.safetensors"));
  }

  // The base moved: what was tried is named, and --base points at it.
  fs::rename(base_abs, top_ / "moved");
  const test::CliRun lost = generate_from(top_ / "elsewhere", {ck.string()});
  EXPECT_EQ(lost.rc, 2);
  EXPECT_NE(lost.err.find("tried " + base_abs.string() + " (no such directory)"), std::string::npos)
      << lost.err;
  EXPECT_NE(lost.err.find("--base DIR"), std::string::npos) << lost.err;
  const test::CliRun found =
      generate_from(top_ / "elsewhere", {ck.string(), "--base", (top_ / "moved").string()});
  EXPECT_EQ(found.rc, 0) << found.err;
  EXPECT_EQ(found.out, here.out);
  InDir in(top_ / "elsewhere");
  EXPECT_EQ(export_cli({ck.string(), "merged2", "--merge"}), 2);
  EXPECT_EQ(export_cli({ck.string(), "merged2", "--merge", "--base", "../moved"}), 0);
  EXPECT_TRUE(read_file("merged2/model.safetensors") == read_file("merged/model.safetensors"));
  EXPECT_EQ(export_cli({ck.string(), "merged3", "--merge", "--base", "../nowhere"}), 2);
}

TEST_F(InitPaths, CheckpointWithoutTheAbsolutePathResolvesThePathAsGiven) {
  const fs::path ck = train();
  {  // as a checkpoint written before the absolute path was stored: no lora_base_init_abs, and
     // the resolved deck with model.init as given
    h5::Handle f(H5Fopen(ck.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), h5::close_file);
    ASSERT_GE(H5Adelete(f, "lora_base_init_abs"), 0);
    std::string stored = h5::try_read_attr_string(f, "deck").value_or("");
    const std::size_t at = stored.find("init = /"), end = stored.find('\n', at);
    ASSERT_NE(at, std::string::npos) << stored;
    stored.replace(at, end - at, "init = base");
    ASSERT_GE(H5Adelete(f, "deck"), 0);
    h5::write_attr_string(f, "deck", stored);
  }
  const test::CliRun here = generate_from(top_ / "run", {ck.string()});
  EXPECT_EQ(here.rc, 0) << here.err;
  const test::CliRun there = generate_from(top_ / "elsewhere", {ck.string()});
  EXPECT_EQ(there.rc, 2);
  EXPECT_NE(there.err.find("base (no such directory)"), std::string::npos) << there.err;
  const test::CliRun with_base = generate_from(
      top_ / "elsewhere", {ck.string(), "--base", (top_ / "run" / "base").string()});
  EXPECT_EQ(with_base.rc, 0) << with_base.err;
  EXPECT_EQ(with_base.out, here.out);
}

TEST_F(InitPaths, WholeModelCheckpointFindsItsTokenizerFromAnotherDirectory) {
  const fs::path ck = train(false);
  const test::CliRun here = generate_from(top_ / "run", {ck.string()});
  ASSERT_EQ(here.rc, 0) << here.err;
  const test::CliRun there = generate_from(top_ / "elsewhere", {ck.string()});
  EXPECT_EQ(there.rc, 0) << there.err;
  EXPECT_EQ(there.out, here.out);
  // --base names where model.init is now; a checkpoint of a run without one has no use for it.
  const test::CliRun hf_dir =
      generate_from(top_ / "elsewhere", {(top_ / "run" / "base").string(), "--base", "x"});
  EXPECT_EQ(hf_dir.rc, 2);
  EXPECT_NE(hf_dir.err.find("--base is for checkpoints"), std::string::npos) << hf_dir.err;
}

}  // namespace
}  // namespace qt::hf
