// `qtrain generate` end to end (generate_main in process, stdout captured), with Qwen3's
// tokenizer (the qwen3_tokenizer CTest fixture): a Hugging Face directory and a qtrain checkpoint
// of a small model with Qwen3's 151936-token vocabulary and random weights; what the command
// prints equals the decoding of KvDecoder + Sampler on the same weights, greedy and sampled,
// plain and with the chat template. Also the generation-prompt form of the chat renderer.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "generate/generate.h"
#include "generate/kv_decoder.h"
#include "generate/sampler.h"
#include "hf/config.h"
#include "io/hdf5_util.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "prep/chat.h"
#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/mesh.h"
#include "support/generate_cli.h"
#include "support/random.h"
#include "tokenizer/qwen3_tokenizer.h"

namespace qt {
namespace {

namespace fs = std::filesystem;

using test::CliRun;
using test::run_generate;
using test::world_comm;

ModelConfig small_qwen3_vocab() {
  ModelConfig c;
  c.preset = "";
  c.vocab_size = 151936;  // Qwen3's embedding rows (the tokenizer has 151669 ids)
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.tie_word_embeddings = false;
  c.max_position_embeddings = 4096;
  return c;
}

// What the command must print for these weights (KvDecoder + Sampler, fp32).
std::string expected_output(const ModelConfig& c, const std::vector<float>& params,
                            const std::string& prompt_text, double temperature, double top_p,
                            std::uint64_t seed, int max_new) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  gen::KvDecoder dec(c, params.data(),
                     static_cast<int>(tok.encode(prompt_text).size()) + max_new);
  return test::expected_generation(dec, tok, prompt_text, temperature, top_p, seed, max_new);
}

class GenerateCli : public ::testing::Test {
 protected:
  void SetUp() override {
    tok_dir_ = test::qwen3_tokenizer_dir();
    ASSERT_FALSE(tok_dir_.empty());
    dir_ = fs::temp_directory_path() / ("qtrain_test_generate_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(test::test_seed() % 100000));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    cfg_ = small_qwen3_vocab();
    std::mt19937_64 rng(test::test_seed());
    params_ = test::generation_weights(cfg_, rng);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // An HF directory of the weights (bf16) with the tokenizer; params_ becomes what it holds.
  std::string write_hf_dir() {
    test::write_hf_model(dir_ / "hf", cfg_, params_, tok_dir_,
                         {"tokenizer.json", "tokenizer_config.json"});
    return (dir_ / "hf").string();
  }

  fs::path dir_;
  std::string tok_dir_;
  ModelConfig cfg_;
  std::vector<float> params_;
};

TEST_F(GenerateCli, GreedyFromHfDirectoryEqualsKvDecoder) {
  const std::string d = write_hf_dir();
  const std::string prompt = "The quick brown fox";
  const CliRun r = run_generate({d, "--prompt", prompt, "--max-new-tokens", "12"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, expected_output(cfg_, params_, prompt, 0.0, 1.0, 0, 12));
}

TEST_F(GenerateCli, SampledChatNoThinkIsSeededAndEqualsKvDecoder) {
  const std::string d = write_hf_dir();
  const std::vector<std::string> args = {d,           "--chat",   "--no-think", "--system",
                                         "Be brief.", "--prompt", "Hi there",   "--temperature",
                                         "0.8",       "--top-p",  "0.9",        "--seed",
                                         "11",        "-n",       "10"};
  const CliRun r1 = run_generate(args), r2 = run_generate(args);
  EXPECT_EQ(r1.rc, 0) << r1.err;
  EXPECT_EQ(r2.rc, 0) << r2.err;
  EXPECT_EQ(r1.out, r2.out);
  const std::string rendered =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
      "<|im_start|>assistant\n<think>\n\n</think>\n\n";
  EXPECT_EQ(r1.out, expected_output(cfg_, params_, rendered, 0.8, 0.9, 11, 10));
}

TEST_F(GenerateCli, FromCheckpointDirectoryWithTokenizerOption) {
  // A qtrain checkpoint (fp32) written as training writes it, in a directory of checkpoints.
  test::write_model_checkpoint(dir_ / "ckpt", cfg_, params_, 5);
  const std::string prompt = "Once upon a time";
  // No model.init in the checkpoint: the tokenizer must be named.
  const CliRun r0 = run_generate({(dir_ / "ckpt").string(), "--prompt", prompt});
  EXPECT_EQ(r0.rc, 2);
  EXPECT_EQ(r0.out, "");
  EXPECT_NE(r0.err.find("--tokenizer"), std::string::npos) << r0.err;
  const CliRun r = run_generate(
      {(dir_ / "ckpt").string(), "--prompt", prompt, "--tokenizer", tok_dir_, "-n", "9"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, expected_output(cfg_, params_, prompt, 0.0, 1.0, 0, 9));
}

TEST_F(GenerateCli, FromLoraCheckpointMergesTheAdapters) {
  // A LoRA run's checkpoint (adapters only) whose base is the model initialised from a seed:
  // generate uses the base with W + scale * B A, as `qtrain export --merge` does.
  auto world = world_comm();
  LoraCheckpointInfo info;
  info.config.r = 4;
  info.config.alpha = 8;
  info.config.targets = "q_proj,v_proj,down_proj";
  info.base.seed = 77;
  const ParamLayout adapters_layout = lora_layout(cfg_, info.config);
  std::mt19937_64 rng(test::test_seed() + 9);
  const std::vector<float> adapters = test::random_vector<float>(adapters_layout.numel(), rng, 0.5);
  std::vector<float> zeros(adapters_layout.numel(), 0.0f);
  {
    Mesh mesh(MeshShape{}, world);
    TrainState st;
    st.step = 3;
    st.seed = 77;
    checkpoint_write((dir_ / "lora.h5").string(), mesh, adapters_layout, adapters.data(),
                     MomentShard{{0, adapters_layout.numel()}, zeros.data(), zeros.data()}, st,
                     cfg_, "", &info);
  }
  const ParamLayout layout(cfg_);
  std::vector<float> merged(layout.numel());
  init_params(cfg_, layout, 77, merged.data());
  lora_merge(cfg_, info.config, adapters.data(), layout, merged.data());
  const std::string prompt = "A day for";
  const CliRun r = run_generate(
      {(dir_ / "lora.h5").string(), "--prompt", prompt, "--tokenizer", tok_dir_, "-n", "8"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, expected_output(cfg_, merged, prompt, 0.0, 1.0, 0, 8));
}

TEST_F(GenerateCli, MaxNewTokensBeyondAnyCacheStopsAtTheModelsPositions) {
  // A cache of 12 positions whatever --max-new-tokens says (prompt + n used to wrap around).
  cfg_.max_position_embeddings = 12;
  const std::string d = write_hf_dir();
  const CliRun r = run_generate({d, "--prompt", "a", "-n", "9223372036854775807"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, expected_output(cfg_, params_, "a", 0.0, 1.0, 0, 12));
  if (r.out.size() > 1) {  // no stop token drawn: the cache's end stopped it
    EXPECT_NE(r.err.find("stopped at the model's 12 positions"), std::string::npos) << r.err;
  }
}

// A root attribute of `path` replaced by `value` (a damaged or hand-edited checkpoint).
template <class T>
void set_root_attr(const fs::path& path, const char* name, T value) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  ASSERT_GE(H5Adelete(f, name), 0) << name;
  if constexpr (std::is_floating_point_v<T>)
    h5::write_attr_f64(f, name, value);
  else
    h5::write_attr_i64(f, name, value);
  H5Fclose(f);
}

TEST_F(GenerateCli, CorruptCheckpointAttributesAreRefusedWithExit2) {
  struct Case {
    const char* attr;
    double value;
    const char* says;  // in the error message
  };
  const Case cases[] = {
      {"num_kv_heads", 0, "num_kv_heads = 0 is out of range"},
      {"hidden_size", 2147483648.0, "hidden_size = 2147483648 is out of range"},
      {"vocab_size", -5, "vocab_size = -5 is out of range"},
      {"num_heads", 3, "num_attention_heads 3 is not a multiple of num_key_value_heads 2"},
      {"head_dim", 15, "head_dim is 15"},
      {"num_layers", 2000000000, "needs about"},
      {"rms_norm_eps", std::nan(""), "rms_norm_eps is nan"},
      {"rope_theta", -1, "rope_theta is -1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.attr);
    const fs::path ckpt_dir = dir_ / (std::string("bad_") + c.attr);
    test::write_model_checkpoint(ckpt_dir, cfg_, params_, 5);
    const fs::path ckpt = checkpoint_path(ckpt_dir.string(), 5);
    if (std::string(c.attr) == "rms_norm_eps" || std::string(c.attr) == "rope_theta")
      set_root_attr(ckpt, c.attr, c.value);
    else
      set_root_attr(ckpt, c.attr, static_cast<std::int64_t>(c.value));
    const CliRun r = run_generate({ckpt.string(), "--prompt", "a", "--tokenizer", tok_dir_});
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
  }
}

TEST(ChatGenerationPrompt, AsTheTemplateRendersIt) {
  // Qwen3's template with add_generation_prompt=True (and enable_thinking=False).
  const std::vector<prep::ChatMessage> m = {{"user", "2+2?", std::nullopt}};
  EXPECT_EQ(prep::render_qwen3_generation_prompt(m),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(prep::render_qwen3_generation_prompt(m, false),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // Earlier turns render as without the generation prompt (the last query is the final user).
  const std::vector<prep::ChatMessage> multi = {{"system", "S", std::nullopt},
                                                {"user", "a", std::nullopt},
                                                {"assistant", "<think>r</think>b", std::nullopt},
                                                {"user", "c", std::nullopt}};
  EXPECT_EQ(prep::render_qwen3_generation_prompt(multi),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
            "<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
            "<|im_start|>assistant\n");
}

}  // namespace
}  // namespace qt
