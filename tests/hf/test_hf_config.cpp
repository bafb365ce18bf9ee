// config.json <-> ModelConfig, and the deck key model.init with its precedence rules.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "hf/config.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "support/random.h"

namespace qt::hf {
namespace {

namespace fs = std::filesystem;

// Qwen/Qwen3-0.6B's config.json as published (transformers 4.51 style).
const char* kQwen3_06B = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645,
  "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
  "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
  "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
  "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936
})";

// What transformers 5.x's save_pretrained writes: dtype, rope_parameters, layer_types.
const char* kTransformers5 = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": null, "dtype": "float32", "eos_token_id": null, "head_dim": 64,
  "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
  "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 4096,
  "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 4,
  "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": null, "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "sliding_window": null,
  "tie_word_embeddings": false, "transformers_version": "5.17.0", "use_cache": false,
  "use_sliding_window": false, "vocab_size": 128
})";

void expect_user_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    FAIL() << "no error";
  } catch (const UserError& e) {
    const std::string m = e.what();
    for (const std::string& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' not in: " << m;
  }
}

TEST(HfConfig, ReadsQwen3HubConfig) {
  ConfigExtras x;
  ModelConfig c = parse_config(kQwen3_06B, "config.json", &x);
  ModelConfig want = *model_preset("qwen3-0.6b");
  EXPECT_EQ(c.vocab_size, want.vocab_size);
  EXPECT_EQ(c.hidden_size, want.hidden_size);
  EXPECT_EQ(c.intermediate_size, want.intermediate_size);
  EXPECT_EQ(c.num_layers, want.num_layers);
  EXPECT_EQ(c.num_heads, want.num_heads);
  EXPECT_EQ(c.num_kv_heads, want.num_kv_heads);
  EXPECT_EQ(c.head_dim, want.head_dim);
  EXPECT_EQ(c.rope_theta, want.rope_theta);
  EXPECT_EQ(c.rms_norm_eps, want.rms_norm_eps);
  EXPECT_EQ(c.tie_word_embeddings, want.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, want.max_position_embeddings);
  EXPECT_EQ(c.num_params(), want.num_params());
  EXPECT_EQ(x.bos_token_id, 151643);
  EXPECT_EQ(x.eos_token_id, 151645);
}

TEST(HfConfig, ReadsTransformers5Config) {
  ModelConfig c = parse_config(kTransformers5, "config.json");
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 4096);
}

TEST(HfConfig, DefaultsFollowTransformers) {
  ModelConfig c = parse_config(R"({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64,
      "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4})", "c.json");
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 32768);
}

TEST(HfConfig, RoundTripsThroughConfigJson) {
  std::mt19937_64 rng(test::test_seed());
  for (int rep = 0; rep < 50; ++rep) {
    ModelConfig c;
    c.preset = "";
    c.vocab_size = 1 + static_cast<int>(rng() % 200000);
    c.hidden_size = 1 + static_cast<int>(rng() % 8192);
    c.intermediate_size = 1 + static_cast<int>(rng() % 30000);
    c.num_layers = 1 + static_cast<int>(rng() % 80);
    c.num_kv_heads = 1 + static_cast<int>(rng() % 8);
    c.num_heads = c.num_kv_heads * (1 + static_cast<int>(rng() % 8));
    c.head_dim = 2 * (1 + static_cast<int>(rng() % 128));
    c.rope_theta = std::uniform_real_distribution<double>(1e3, 1e7)(rng);
    c.rms_norm_eps = std::uniform_real_distribution<double>(1e-7, 1e-4)(rng);
    c.initializer_range = std::uniform_real_distribution<double>(1e-3, 1e-1)(rng);
    c.tie_word_embeddings = rng() & 1;
    c.max_position_embeddings = 1 + static_cast<int>(rng() % 300000);
    ConfigExtras x = default_extras(c), back;
    ModelConfig d = parse_config(make_config_json(c, x).dump(2), "round.json", &back);
    EXPECT_EQ(d.vocab_size, c.vocab_size);
    EXPECT_EQ(d.hidden_size, c.hidden_size);
    EXPECT_EQ(d.intermediate_size, c.intermediate_size);
    EXPECT_EQ(d.num_layers, c.num_layers);
    EXPECT_EQ(d.num_heads, c.num_heads);
    EXPECT_EQ(d.num_kv_heads, c.num_kv_heads);
    EXPECT_EQ(d.head_dim, c.head_dim);
    EXPECT_EQ(d.rope_theta, c.rope_theta);  // doubles are written to round-trip exactly
    EXPECT_EQ(d.rms_norm_eps, c.rms_norm_eps);
    EXPECT_EQ(d.initializer_range, c.initializer_range);
    EXPECT_EQ(d.tie_word_embeddings, c.tie_word_embeddings);
    EXPECT_EQ(d.max_position_embeddings, c.max_position_embeddings);
    EXPECT_EQ(back.bos_token_id, x.bos_token_id);
    EXPECT_EQ(back.eos_token_id, x.eos_token_id);
  }
  ModelConfig tiny;
  EXPECT_TRUE(default_extras(tiny).eos_token_id.is_null());  // a test vocabulary has no Qwen ids
  nlohmann::ordered_json j = make_config_json(tiny, default_extras(tiny));
  EXPECT_EQ(j["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(j["dtype"], "bfloat16");
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
}

TEST(HfConfigErrors, OtherModelsAndFeatures) {
  const std::string base = kQwen3_06B;
  auto with = [&](const std::string& from, const std::string& to, std::string s = "") {
    if (s.empty()) s = base;
    const auto at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  auto bad = [&](const std::string& text, const std::vector<std::string>& parts) {
    expect_user_error([&] { parse_config(text, "m/config.json"); }, parts);
  };
  bad(with(R"("model_type": "qwen3")", R"("model_type": "llama")"), {"m/config.json", "model_type", "\"llama\"", "Qwen3"});
  bad(with(R"("model_type": "qwen3")", R"("model_type": "qwen3_moe")"), {"qwen3_moe"});
  bad(with(R"(["Qwen3ForCausalLM"])", R"(["Qwen3ForSequenceClassification"])"), {"architectures"});
  bad(with(R"("rope_scaling": null)", R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0})"),
      {"rope_scaling", "yarn", "plain RoPE"});
  bad(with(R"("rope_scaling": null)", R"("rope_parameters": {"rope_type": "default", "rope_theta": 10})"),
      {"rope_theta", "disagree"});
  bad(with(R"("use_sliding_window": false)", R"("use_sliding_window": true)"), {"use_sliding_window", "sliding-window"});
  bad(with(R"("attention_bias": false)", R"("attention_bias": true)"), {"attention_bias"});
  bad(with(R"("hidden_act": "silu")", R"("hidden_act": "gelu")"), {"hidden_act", "\"gelu\""});
  bad(with(R"("vocab_size": 151936)", R"("vocab_size": "many")"), {"vocab_size", "positive integer"});
  bad(with(R"("vocab_size": 151936)", R"("quantization_config": {})"), {"quantization_config"});
  bad(with(R"("num_key_value_heads": 8)", R"("num_key_value_heads": 3)"), {"not a multiple"});
  bad(with(R"("tie_word_embeddings": true)", R"("tie_word_embeddings": 1)"), {"tie_word_embeddings"});
  // Absurd sizes whose products would overflow the engine's ints; parities RoPE needs.
  bad(with(R"("head_dim": 128)", R"("head_dim": 4096)",
           with(R"("num_attention_heads": 16)", R"("num_attention_heads": 1048576)")),
      {"num_attention_heads x head_dim = 1048576 x 4096 = 4294967296 is beyond 2147483647"});
  bad(with(R"("head_dim": 128)", R"("head_dim": 127)"), {"head_dim is 127", "even"});
  bad(with(R"("hidden_size": 1024)", R"("hidden_size": 2147483648)"),
      {"hidden_size", "positive integer"});
  bad(base.substr(0, 40), {"m/config.json", "not valid JSON"});
  std::string no_vocab = with(R"("vocab_size": 151936)", R"("other": 1)");
  bad(no_vocab, {"\"vocab_size\" is missing"});
}

// ---- the deck: model.init -------------------------------------------------------------------

class HfDeck : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string t = (fs::temp_directory_path() / "qtrain-hfdeck-XXXXXX").string();
    dir_ = mkdtemp(t.data());
    model_ = dir_ + "/model";
    fs::create_directories(model_);
    std::ofstream(model_ + "/config.json") << kTransformers5;
  }
  void TearDown() override { fs::remove_all(dir_); }
  Deck parse(const std::string& text, std::vector<std::string> ov = {}) {
    return parse_deck_text(text, "deck.ini", ov, 1);
  }
  std::string dir_, model_;
};

TEST_F(HfDeck, ConfigJsonDefinesTheModel) {
  Deck d = parse("[model]\ninit = " + model_ + "\n[train]\nseq_len = 16\n");
  EXPECT_EQ(d.model_init, model_);
  EXPECT_EQ(d.model.hidden_size, 32);
  EXPECT_EQ(d.model.head_dim, 64);
  EXPECT_EQ(d.model.vocab_size, 128);
  EXPECT_EQ(d.model.rope_theta, 10000.0);
  EXPECT_FALSE(d.model.tie_word_embeddings);
  EXPECT_EQ(d.model.preset, "");
  // Keys that agree with config.json are fine; initializer_range may differ.
  Deck e = parse("[model]\ninit = " + model_ + "\nhidden_size = 32\ninitializer_range = 0.5\n"
                 "tie_word_embeddings = false\n[train]\nseq_len = 16\n");
  EXPECT_EQ(e.model.initializer_range, 0.5);
  // The resolved deck parses again to the same model (preset = "" means none with init).
  Deck f = parse_deck_text(d.resolved, "resolved.ini", {}, 1);
  EXPECT_EQ(f.model_init, model_);
  EXPECT_EQ(f.model.hidden_size, 32);
  EXPECT_EQ(f.resolved.substr(f.resolved.find('\n')), d.resolved.substr(d.resolved.find('\n')));
}

TEST_F(HfDeck, ContradictionsNameBothSides) {
  expect_user_error([&] { parse("[model]\ninit = " + model_ + "\nhidden_size = 64\n"); },
                    {"deck.ini:3:", "model.hidden_size = 64", "contradicts", model_ + "/config.json",
                     "hidden_size = 32"});
  expect_user_error([&] { parse("[model]\ninit = " + model_ + "\n", {"--model.num_layers=3"}); },
                    {"(command line)", "model.num_layers = 3", "num_hidden_layers = 2"});
  // A preset states what the directory must hold: every preset key is compared.
  expect_user_error([&] { parse("[model]\npreset = tiny\ninit = " + model_ + "\n"); },
                    {"(from preset tiny)", "contradicts", "config.json"});
  // An empty preset without init is still an error.
  expect_user_error([&] { parse("[model]\npreset =\n"); }, {"model.preset", "not a preset"});
}

TEST_F(HfDeck, MissingDirectoryOrAnotherModel) {
  expect_user_error([&] { parse("[model]\ninit = " + dir_ + "/nothing\n"); },
                    {"deck.ini:2:", "model.init = " + dir_ + "/nothing", "no such directory"});
  expect_user_error([&] { parse("[model]\ninit = " + dir_ + "\n"); },
                    {"model.init", dir_ + "/config.json", "cannot open"});
  std::ofstream(model_ + "/config.json") << R"({"model_type": "llama", "vocab_size": 10})";
  expect_user_error([&] { parse("[model]\ninit = " + model_ + "\n"); },
                    {"deck.ini:2:", "model.init", "model_type is \"llama\""});
  // Sizes the engine cannot hold are refused as config.json's (hf::validate_model).
  std::ofstream(model_ + "/config.json") << R"({"model_type": "qwen3", "vocab_size": 10,
      "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "head_dim": 3})";
  expect_user_error([&] { parse("[model]\ninit = " + model_ + "\n"); },
                    {"deck.ini:2:", "model.init", "config.json: head_dim is 3", "even"});
}

}  // namespace
}  // namespace qt::hf
