// config.json <-> ModelConfig, and the deck key model.init with its precedence rules.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
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

// Qwen/Qwen3-30B-A3B's config.json: the keys of Qwen's MoE files (transformers 4.51 style), the
// values of qwen3-spec.md's table.
const char* kQwen3_30B_A3B = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
})";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

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

// YaRN as the Qwen3 model cards describe it (rope_scaling, transformers 4.x files) and as
// transformers 5 writes it (rope_parameters with rope_theta inside); the defaults of the keys left
// out are transformers 5.17's: beta_fast 32, beta_slow 1, original_max_position_embeddings =
// max_position_embeddings, factor = their ratio.
TEST(HfConfig, ReadsYarnRopeScaling) {
  const std::string base = kQwen3_06B;
  const std::string card = R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 32768})";
  std::string text = base;
  text.replace(text.find(R"("rope_scaling": null)"), 20, card);
  ModelConfig c = parse_config(text, "config.json");
  EXPECT_TRUE(c.is_yarn());
  EXPECT_EQ(c.rope_factor, 4.0);
  EXPECT_EQ(c.rope_original_max_position_embeddings, 32768);
  EXPECT_EQ(c.rope_beta_fast, 32.0);
  EXPECT_EQ(c.rope_beta_slow, 1.0);
  EXPECT_EQ(c.rope_attention_factor, 0.0);
  EXPECT_NEAR(c.rope_cos_sin_scale(), 0.1 * std::log(4.0) + 1.0, 1e-15);
  text = base;
  text.replace(text.find(R"("rope_scaling": null)"), 20,
               R"("rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000,
                   "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.5})");
  c = parse_config(text, "config.json");
  EXPECT_TRUE(c.is_yarn());
  EXPECT_EQ(c.rope_original_max_position_embeddings, 40960);  // max_position_embeddings
  EXPECT_EQ(c.rope_factor, 1.0);                               // 40960 / 40960
  EXPECT_EQ(c.rope_beta_fast, 16.0);
  EXPECT_EQ(c.rope_beta_slow, 2.0);
  EXPECT_EQ(c.rope_cos_sin_scale(), 1.5);
  // Written back as rope_scaling and read again: the same fields.
  c.rope_factor = 3;
  c.rope_original_max_position_embeddings = 8192;
  const ModelConfig d = parse_config(make_config_json(c, default_extras(c)).dump(2), "back.json");
  EXPECT_EQ(d.rope_type, "yarn");
  EXPECT_EQ(d.rope_factor, 3.0);
  EXPECT_EQ(d.rope_original_max_position_embeddings, 8192);
  EXPECT_EQ(d.rope_attention_factor, 1.5);
  EXPECT_EQ(d.rope_beta_fast, 16.0);
  EXPECT_EQ(d.rope_beta_slow, 2.0);
  EXPECT_FALSE(parse_config(kQwen3_06B, "config.json").is_yarn());
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
  bad(with(R"("model_type": "qwen3")", R"("model_type": "qwen3_moe")"),
      {"architectures is [\"Qwen3ForCausalLM\"]", "\"qwen3_moe\" (Qwen3MoeForCausalLM)"});
  bad(with(R"("model_type": "qwen3")", R"("model_type": "mixtral")",
           with(R"(["Qwen3ForCausalLM"])", R"(["MixtralForCausalLM"])")),
      {"model_type is \"mixtral\"", "qtrain reads Qwen3 models"});
  bad(with(R"(["Qwen3ForCausalLM"])", R"(["Qwen3ForSequenceClassification"])"), {"architectures"});
  bad(with(R"("rope_scaling": null)", R"("rope_scaling": {"rope_type": "longrope", "factor": 4.0})"),
      {"rope_scaling", "longrope", "plain RoPE", "yarn"});
  bad(with(R"("rope_scaling": null)",
           R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7})"),
      {"rope_scaling", "\"mscale\" = 0.7", "does not implement"});
  bad(with(R"("rope_scaling": null)",
           R"("rope_scaling": {"rope_type": "yarn", "factor": -2, "original_max_position_embeddings": 8})"),
      {"rope_scaling.factor\" is -2"});
  bad(with(R"("rope_scaling": null)",
           R"("rope_scaling": {"rope_type": "yarn", "factor": 2, "truncate": false})"),
      {"\"truncate\" = false"});
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

// ---- Qwen3-MoE -------------------------------------------------------------------------------

TEST(HfConfigMoe, ReadsQwen3MoeHubConfig) {
  ConfigExtras x;
  const ModelConfig c = parse_config(kQwen3_30B_A3B, "config.json", &x);
  const ModelConfig want = *model_preset("qwen3-30b-a3b");
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_EQ(c.head_dim, 128);  // not 2048 / 32
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.num_moe_layers(), 48);
  EXPECT_EQ(c.num_params(), want.num_params());
  EXPECT_EQ(c.num_params(), 30'532'122'624);  // qwen3-spec.md's table
  EXPECT_EQ(x.eos_token_id, 151645);
}

// transformers 5.17's save_pretrained: num_local_experts, rope_parameters (make_moe_fixtures.py).
TEST(HfConfigMoe, ReadsTransformers5MoeConfigs) {
  const ModelConfig a =
      read_config(std::string(QT_MOE_FIXTURE_DIR) + "/moe_norm_topk_hf");
  EXPECT_EQ(a.num_experts, 6);
  EXPECT_EQ(a.num_experts_per_tok, 2);
  EXPECT_EQ(a.moe_intermediate_size, 16);
  EXPECT_TRUE(a.norm_topk_prob);
  EXPECT_EQ(a.mlp_only_layers, std::vector<int>{1});
  EXPECT_EQ(a.router_aux_loss_coef, 0.05);
  EXPECT_EQ(a.head_dim, 16);
  EXPECT_EQ(a.rope_theta, 10000.0);
  EXPECT_FALSE(a.tie_word_embeddings);
  const ModelConfig b =
      read_config(std::string(QT_MOE_FIXTURE_DIR) + "/moe_no_norm_topk_tied_hf");
  EXPECT_FALSE(b.norm_topk_prob);
  EXPECT_EQ(b.decoder_sparse_step, 2);
  EXPECT_TRUE(b.mlp_only_layers.empty());
  EXPECT_TRUE(b.tie_word_embeddings);
  EXPECT_EQ(b.num_moe_layers(), 1);  // layer 1 of 0 .. 2
}

const char* kMinimalMoe = R"({"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4})";

// Keys a file omits take Qwen3MoeConfig's defaults; head_dim hidden / heads, as transformers'
// MoE model (a dense config's default is 128).
TEST(HfConfigMoe, DefaultsFollowTransformers) {
  const ModelConfig c = parse_config(kMinimalMoe, "c.json");
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_FALSE(c.norm_topk_prob);  // Qwen3MoeConfig's default (Qwen's files set true)
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_kv_heads, 4);
  // mlp_only_layers in any order and with repeats is the same model; null is none.
  std::string t = kMinimalMoe;
  t.insert(t.size() - 1, R"(, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1, 0, 1])");
  EXPECT_EQ(parse_config(t, "c.json").mlp_only_layers, (std::vector<int>{0, 1}));
  t = kMinimalMoe;
  t.insert(t.size() - 1, R"(, "num_local_experts": 4, "num_experts": 4, "mlp_only_layers": null, "num_experts_per_tok": 4)");
  const ModelConfig d = parse_config(t, "c.json");
  EXPECT_EQ(d.num_experts, 4);
  EXPECT_TRUE(d.mlp_only_layers.empty());
}

TEST(HfConfigMoe, RoundTripsThroughConfigJson) {
  std::mt19937_64 rng(test::test_seed());
  for (int rep = 0; rep < 50; ++rep) {
    ModelConfig c = *model_preset("qwen3-30b-a3b");
    c.preset = "";
    c.num_layers = 1 + static_cast<int>(rng() % 12);
    c.num_experts = 1 + static_cast<int>(rng() % 160);
    c.num_experts_per_tok = 1 + static_cast<int>(rng() % c.num_experts);
    c.moe_intermediate_size = 1 + static_cast<int>(rng() % 2000);
    c.norm_topk_prob = rng() & 1;
    c.decoder_sparse_step = 1 + static_cast<int>(rng() % 3);
    c.mlp_only_layers.clear();
    for (int l = 0; l < c.num_layers; ++l)
      if (rng() % 4 == 0) c.mlp_only_layers.push_back(l);
    c.router_aux_loss_coef = rep == 0 ? 0.0 : std::uniform_real_distribution<double>(0, 0.1)(rng);
    c.tie_word_embeddings = rng() & 1;
    const nlohmann::ordered_json j = make_config_json(c, default_extras(c));
    EXPECT_EQ(j["architectures"][0], "Qwen3MoeForCausalLM");
    EXPECT_EQ(j["model_type"], "qwen3_moe");
    EXPECT_EQ(j["output_router_logits"], false);
    EXPECT_EQ(j["num_experts"], c.num_experts);
    EXPECT_EQ(j["head_dim"], 128);
    const ModelConfig d = parse_config(j.dump(2), "round.json");
    EXPECT_EQ(d.num_layers, c.num_layers);
    EXPECT_EQ(d.num_experts, c.num_experts);
    EXPECT_EQ(d.num_experts_per_tok, c.num_experts_per_tok);
    EXPECT_EQ(d.moe_intermediate_size, c.moe_intermediate_size);
    EXPECT_EQ(d.norm_topk_prob, c.norm_topk_prob);
    EXPECT_EQ(d.decoder_sparse_step, c.decoder_sparse_step);
    EXPECT_EQ(d.mlp_only_layers, c.mlp_only_layers);
    EXPECT_EQ(d.router_aux_loss_coef, c.router_aux_loss_coef);
    EXPECT_EQ(d.tie_word_embeddings, c.tie_word_embeddings);
    EXPECT_EQ(d.num_params(), c.num_params());
  }
  // A dense model's config.json has no MoE key.
  const nlohmann::ordered_json dense = make_config_json(ModelConfig{}, {});
  for (const char* k : {"num_experts", "mlp_only_layers", "output_router_logits", "norm_topk_prob"})
    EXPECT_FALSE(dense.contains(k)) << k;
}

TEST(HfConfigMoe, Errors) {
  const std::string base = kQwen3_30B_A3B;
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = base;
    const auto at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  auto bad = [&](const std::string& text, const std::vector<std::string>& parts) {
    expect_user_error([&] { parse_config(text, "m/config.json"); }, parts);
  };
  bad(with(R"(["Qwen3MoeForCausalLM"])", R"(["Qwen3ForCausalLM"])"),
      {"m/config.json", "architectures is [\"Qwen3ForCausalLM\"]", "\"qwen3\" (Qwen3ForCausalLM)"});
  bad(with(R"("num_experts_per_tok": 8)", R"("num_experts_per_tok": 129)"),
      {"num_experts_per_tok 129 is more than num_experts 128"});
  bad(with(R"("num_experts": 128)", R"("num_experts": 128, "num_local_experts": 64)"),
      {"num_experts 128 and num_local_experts 64 disagree"});
  bad(with(R"("num_experts": 128)", R"("num_experts": 0)"), {"\"num_experts\" is 0", "positive integer"});
  bad(with(R"("mlp_only_layers": [])", R"("mlp_only_layers": [3, 48])"),
      {"\"mlp_only_layers\" lists layer 48", "0 .. 47"});
  bad(with(R"("mlp_only_layers": [])", R"("mlp_only_layers": "1")"), {"mlp_only_layers", "list of layer"});
  bad(with(R"("norm_topk_prob": true)", R"("norm_topk_prob": 1)"), {"norm_topk_prob", "true or false"});
  bad(with(R"("router_aux_loss_coef": 0.001)", R"("router_aux_loss_coef": -1)"),
      {"router_aux_loss_coef", ">= 0"});
  bad(with(R"("moe_intermediate_size": 768)", R"("moe_intermediate_size": 0)"),
      {"moe_intermediate_size", "positive integer"});
  bad(with(R"("use_sliding_window": false)", R"("use_sliding_window": true)"), {"use_sliding_window"});
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
                    {"model.init", dir_ + "/config.json", "no such file"});
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

// A Qwen3-MoE model.init: its MoE keys define the deck's model and are compared like the others;
// router_aux_loss_coef, the objective's weight, may be set; a dense config.json ignores MoE keys.
TEST_F(HfDeck, Qwen3MoeConfigJsonDefinesTheModel) {
  const std::string moe = std::string(QT_MOE_FIXTURE_DIR) + "/moe_norm_topk_hf";
  Deck d = parse("[model]\ninit = " + moe + "\n[train]\nseq_len = 16\n");
  EXPECT_EQ(d.model.num_experts, 6);
  EXPECT_EQ(d.model.num_experts_per_tok, 2);
  EXPECT_EQ(d.model.moe_intermediate_size, 16);
  EXPECT_TRUE(d.model.norm_topk_prob);
  EXPECT_EQ(d.model.mlp_only_layers, std::vector<int>{1});
  EXPECT_EQ(d.model.router_aux_loss_coef, 0.05);
  Deck e = parse("[model]\ninit = " + moe + "\nnum_experts = 6\nmlp_only_layers = 1\n"
                 "router_aux_loss_coef = 0\n[train]\nseq_len = 16\n");
  EXPECT_EQ(e.model.router_aux_loss_coef, 0.0);
  expect_user_error([&] { parse("[model]\ninit = " + moe + "\nnum_experts = 8\n"); },
                    {"deck.ini:3:", "model.num_experts = 8", "contradicts", "num_experts = 6"});
  expect_user_error([&] { parse("[model]\ninit = " + moe + "\nmlp_only_layers = 0, 1\n"); },
                    {"model.mlp_only_layers = 0, 1", "contradicts", "mlp_only_layers = 1"});
  expect_user_error([&] { parse("[model]\ninit = " + moe + "\nnorm_topk_prob = false\n"); },
                    {"model.norm_topk_prob = false", "norm_topk_prob = true"});
  // A MoE deck against a dense directory: num_experts says so.
  expect_user_error([&] { parse("[model]\ninit = " + model_ + "\nnum_experts = 4\n"); },
                    {"model.num_experts = 4", "contradicts", "num_experts = 0"});
  // A dense directory: a MoE key of the deck means nothing, as without model.init.
  Deck f = parse("[model]\ninit = " + model_ + "\nnum_experts_per_tok = 4\n[train]\nseq_len = 16\n");
  EXPECT_FALSE(f.model.is_moe());
}

}  // namespace
}  // namespace qt::hf
