// Qwen3-VL config.json -> VlConfig (hf/vl_config.h): the official files' values
// (../shared/docs/qwen3-spec.md 1.1-1.2, written here by hand) and every refusal.
#include <gtest/gtest.h>

#include <string>

#include "hf/vl_config.h"
#include "qtrain/error.h"

namespace qt::hf {
namespace {

// Qwen/Qwen3-VL-2B-Instruct's config.json keys (transformers 4.57 style), the spec's values.
const std::string kVl2B = R"({
  "architectures": ["Qwen3VLForConditionalGeneration"],
  "image_token_id": 151655, "model_type": "qwen3_vl",
  "text_config": {
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
    "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": true, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000, "tie_word_embeddings": true, "use_cache": true, "vocab_size": 151936
  },
  "tie_word_embeddings": true, "transformers_version": "4.57.0.dev0",
  "video_token_id": 151656,
  "vision_config": {
    "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
    "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
    "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2
  },
  "vision_end_token_id": 151653, "vision_start_token_id": 151652
})";

// Qwen3-VL-30B-A3B as transformers 5.x writes it: rope_parameters, no vision defaults spelled out.
const std::string kVl30B = R"({
  "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
  "text_config": {
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_vl_moe_text",
    "moe_intermediate_size": 768, "norm_topk_prob": false, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [24, 20, 20],
                        "rope_theta": 5000000.0, "rope_type": "default"},
    "vocab_size": 151936
  },
  "tie_word_embeddings": false,
  "vision_config": {
    "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_size": 1152,
    "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048
  }
})";

TEST(VlConfig, ReadsQwen3Vl2B) {
  const VlConfig c = parse_vl_config(kVl2B, "config.json");
  EXPECT_EQ(c.text.hidden_size, 2048);
  EXPECT_EQ(c.text.intermediate_size, 6144);
  EXPECT_EQ(c.text.num_layers, 28);
  EXPECT_EQ(c.text.num_heads, 16);
  EXPECT_EQ(c.text.num_kv_heads, 8);
  EXPECT_EQ(c.text.head_dim, 128);
  EXPECT_EQ(c.text.max_position_embeddings, 262144);
  EXPECT_EQ(c.text.rope_theta, 5e6);
  EXPECT_TRUE(c.text.tie_word_embeddings);
  EXPECT_EQ(c.text.num_experts, 0);
  EXPECT_EQ(c.mrope_section, (std::array<int, 3>{24, 20, 20}));
  EXPECT_EQ(c.vision.depth, 24);
  EXPECT_EQ(c.vision.hidden_size, 1024);
  EXPECT_EQ(c.vision.intermediate_size, 4096);
  EXPECT_EQ(c.vision.num_heads, 16);
  EXPECT_EQ(c.vision.head_dim(), 64);
  EXPECT_EQ(c.vision.out_hidden_size, 2048);
  EXPECT_EQ(c.vision.deepstack_visual_indexes, (std::vector<int>{5, 11, 17}));
  EXPECT_EQ(c.image_token_id, 151655);
  EXPECT_EQ(c.video_token_id, 151656);
  EXPECT_EQ(c.vision_start_token_id, 151652);
  EXPECT_EQ(c.vision_end_token_id, 151653);
  // The spec's count: vision 407.0M of the 2B model.
  EXPECT_NEAR(static_cast<double>(vision_param_layout(c.vision).numel()), 407.0e6, 0.05e6);
}

TEST(VlConfig, ReadsQwen3VlMoeWithDefaultsAndAlwaysRenormalises) {
  const VlConfig c = parse_vl_config(kVl30B, "config.json");
  EXPECT_EQ(c.text.num_experts, 128);
  EXPECT_EQ(c.text.num_experts_per_tok, 8);
  EXPECT_EQ(c.text.moe_intermediate_size, 768);
  EXPECT_EQ(c.text.num_kv_heads, 4);
  EXPECT_TRUE(c.text.norm_topk_prob);  // norm_topk_prob false in the file: ignored, as transformers
  EXPECT_FALSE(c.text.tie_word_embeddings);
  EXPECT_EQ(c.text.rope_theta, 5e6);
  EXPECT_EQ(c.vision.patch_size, 16);
  EXPECT_EQ(c.vision.temporal_patch_size, 2);
  EXPECT_EQ(c.vision.spatial_merge_size, 2);
  EXPECT_EQ(c.vision.num_position_embeddings, 2304);
  EXPECT_EQ(c.vision.head_dim(), 72);
  // The spec: 538,631,408 vision parameters in Qwen3-VL-30B-A3B.
  EXPECT_EQ(vision_param_layout(c.vision).numel(), 538631408u);
}

// `edit` applied to kVl2B's text (one find-and-replace) must be refused naming `want`.
void expect_refused(const std::string& find, const std::string& replace, const std::string& want) {
  std::string text = kVl2B;
  const auto at = text.find(find);
  ASSERT_NE(at, std::string::npos) << find;
  text.replace(at, find.size(), replace);
  try {
    parse_vl_config(text, "dir/config.json");
    ADD_FAILURE() << "accepted: " << replace;
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("dir/config.json", 0), 0u) << msg;
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
}

TEST(VlConfig, RefusesWhatItCannotRun) {
  expect_refused(R"("model_type": "qwen3_vl",)", R"("model_type": "qwen2_5_vl",)",
                 "model_type is \"qwen2_5_vl\"");
  expect_refused("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                 "architectures");
  expect_refused(R"("mrope_section": [24, 20, 20])", R"("mrope_section": [24, 20, 21])",
                 "does not add up to head_dim / 2 = 64");
  expect_refused(R"("mrope_section": [24, 20, 20], )", "", "no mrope_section");
  expect_refused(R"("mrope_section": [24, 20, 20])", R"("mrope_section": [24, 40])",
                 "expected 3 positive integers");
  expect_refused(R"("rope_theta": 5000000, )", "", "no rope_theta");
  expect_refused(R"("head_dim": 128, )", "", "key \"head_dim\" is missing");
  expect_refused(R"("hidden_act": "gelu_pytorch_tanh")", R"("hidden_act": "quick_gelu")",
                 "gelu_pytorch_tanh");
  expect_refused(R"("out_hidden_size": 2048)", R"("out_hidden_size": 4096)",
                 "the language model's hidden_size is 2048");
  expect_refused("[5, 11, 17]", "[5, 17, 11]", "expected ascending block indices of 0 .. 23");
  expect_refused("[5, 11, 17]", "[5, 11, 24]", "expected ascending block indices of 0 .. 23");
  expect_refused(R"("depth": 24, )", "", "key \"depth\" is missing");
  expect_refused(R"("num_position_embeddings": 2304)", R"("num_position_embeddings": 2300)",
                 "expected a square");
  expect_refused(R"("num_heads": 16, "num_position)", R"("num_heads": 5, "num_position)",
                 "num_heads 5");
  expect_refused(R"("tie_word_embeddings": true, "transformers)",
                 R"("tie_word_embeddings": false, "transformers)", "at the top but true in text_config");
  expect_refused(R"("image_token_id": 151655)", R"("image_token_id": 151936)",
                 "outside the vocabulary");
  expect_refused(R"("use_cache": true, "vocab)", R"("attention_bias": true, "vocab)",
                 "attention_bias");  // parse_text_config's refusals apply in text_config
  expect_refused(R"("text_config": {)", R"("text_config": 3, "x": {)", "\"text_config\" is 3");
}

TEST(VlConfig, TellsAVlConfigFromAPlainOne) {
  EXPECT_TRUE(is_vl_config_text(kVl2B, "a"));
  EXPECT_TRUE(is_vl_config_text(kVl30B, "b"));
  EXPECT_FALSE(is_vl_config_text(R"({"model_type": "qwen3"})", "c"));
}

}  // namespace
}  // namespace qt::hf
