// `qtrain generate --device cuda` end to end (generate_main in process, stdout captured), on a
// tiny model with a tiny byte-level tokenizer written here (256 byte tokens and three special
// ones; no fetched tokenizer needed): a Hugging Face directory and a directory of qtrain
// checkpoints. What the command prints equals the decoding of KvDecoderCuda + Sampler on the
// same weights (the GPU forward is deterministic), greedy and sampled (twice the same with one
// seed), plain and with the chat template; a model the GPU path cannot run exits 2.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "generate/generate.h"
#include "generate/kv_decoder_cuda.h"
#include "generate/sampler.h"
#include "gpu_test.h"
#include "hf/config.h"
#include "qtrain/comm.h"
#include "qtrain/tokenizer.h"
#include "support/generate_cli.h"
#include "support/random.h"
#include "tokenizer/text.h"

namespace qt {
namespace {

namespace fs = std::filesystem;

using test::CliRun;
using test::run_generate;

// A byte-level BPE tokenizer without merges: ids 0..255 are the bytes, then <|endoftext|>,
// <|im_start|>, <|im_end|> (special).
void write_byte_tokenizer(const fs::path& dir) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    tok::append_utf8(s, tok::byte_char(static_cast<std::uint8_t>(b)));
    vocab[s] = b;
  }
  nlohmann::json added = nlohmann::json::array();
  int id = 256;
  for (const char* t : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"})
    added.push_back({{"id", id++}, {"content", t}, {"special", true}});
  const nlohmann::json j = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
      {"added_tokens", added},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}}};
  std::ofstream(dir / "tokenizer.json") << j.dump();
}

ModelConfig tiny_model(int head_dim = 64) {
  ModelConfig c;
  c.preset = "";
  c.vocab_size = 272;  // the tokenizer's 259 ids and 13 rows never drawn
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = head_dim;
  c.tie_word_embeddings = false;
  c.max_position_embeddings = 512;
  return c;
}

class GenerateCudaCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!test::gpu_available()) GTEST_SKIP() << "no CUDA GPU present";
    dir_ = fs::temp_directory_path() / ("qtrain_test_generate_cuda_" + std::to_string(::getpid()) +
                                        "_" + std::to_string(test::test_seed() % 100000));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "tok");
    write_byte_tokenizer(dir_ / "tok");
    cfg_ = tiny_model();
    std::mt19937_64 rng(test::test_seed());
    params_ = test::generation_weights(cfg_, rng);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // A Hugging Face directory of the weights (bf16) with the tokenizer; params_ becomes what it
  // holds.
  std::string write_hf_dir(const ModelConfig& c) {
    test::write_hf_model(dir_ / "hf", c, params_, dir_ / "tok", {"tokenizer.json"});
    return (dir_ / "hf").string();
  }

  // What the command must print for params_ (KvDecoderCuda + Sampler, bf16).
  std::string expected_output(const std::string& prompt_text, double temperature, double top_p,
                              std::uint64_t seed, int max_new) const {
    const Tokenizer tok = Tokenizer::from_dir((dir_ / "tok").string());
    gen::KvDecoderCuda dec(cfg_, params_.data(),
                           static_cast<int>(tok.encode(prompt_text).size()) + max_new);
    return test::expected_generation(dec, tok, prompt_text, temperature, top_p, seed, max_new);
  }

  fs::path dir_;
  ModelConfig cfg_;
  std::vector<float> params_;
};

TEST_F(GenerateCudaCli, GreedyFromHfDirectory) {
  const std::string d = write_hf_dir(cfg_);
  const std::string prompt = "The quick brown fox";
  const CliRun r = run_generate({d, "--device", "cuda", "--prompt", prompt, "-n", "24"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, expected_output(prompt, 0.0, 1.0, 0, 24));
  EXPECT_NE(r.err.find(" on GPU "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("decode "), std::string::npos) << r.err;  // the speed line
  std::printf("%s", r.err.c_str());
}

TEST_F(GenerateCudaCli, SampledChatIsSeeded) {
  const std::string d = write_hf_dir(cfg_);
  const std::vector<std::string> args = {d,         "--device", "gpu", "--chat", "--no-think",
                                         "--system", "Be brief.", "--prompt", "Hi there",
                                         "--temperature", "0.8", "--top-p", "0.9", "--seed",
                                         "11", "-n", "20"};
  const CliRun r1 = run_generate(args), r2 = run_generate(args);
  EXPECT_EQ(r1.rc, 0) << r1.err;
  EXPECT_EQ(r2.rc, 0) << r2.err;
  EXPECT_EQ(r1.out, r2.out);
  const std::string rendered =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
      "<|im_start|>assistant\n<think>\n\n</think>\n\n";
  EXPECT_EQ(r1.out, expected_output(rendered, 0.8, 0.9, 11, 20));
}

TEST_F(GenerateCudaCli, FromCheckpointDirectory) {
  // A qtrain checkpoint (fp32) written as training writes it, in a directory of checkpoints.
  test::write_model_checkpoint(dir_ / "ckpt", cfg_, params_, 5);
  const std::string prompt = "Once upon a time";
  const CliRun r = run_generate({(dir_ / "ckpt").string(), "--device", "cuda", "--prompt", prompt,
                              "--tokenizer", (dir_ / "tok").string(), "-n", "16"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, expected_output(prompt, 0.0, 1.0, 0, 16));
}

TEST_F(GenerateCudaCli, UnsupportedHeadDimExits2) {
  cfg_ = tiny_model(32);
  params_.assign(ParamLayout(cfg_).numel(), 0.01f);
  const std::string d = write_hf_dir(cfg_);
  const CliRun r = run_generate({d, "--device", "cuda", "--prompt", "hi"});
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("qtrain generate: error: --device cuda supports head_dim 64 and 128"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace qt
