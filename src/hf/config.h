// Hugging Face config.json <-> ModelConfig for Qwen3 models: dense (model_type "qwen3",
// Qwen3ForCausalLM) and Qwen3-MoE ("qwen3_moe", Qwen3MoeForCausalLM). docs/finetune.md lists the
// keys read, their defaults and what is refused.
#pragma once

#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "qtrain/model_config.h"

namespace qt::hf {

// A config.json key's value (config.cpp's and vl_config.cpp's readers): present = there and not
// null; get_bool / get_int: the value, `dflt` when absent (get_int: none given, absent is an
// error), else UserError "<where>: ..." for another type or, for get_int, a value outside
// [1, 2^31).
bool present(const nlohmann::json& j, const char* key);
bool get_bool(const nlohmann::json& j, const char* key, const std::string& where, bool dflt);
int get_int(const nlohmann::json& j, const char* key, const std::string& where,
            std::optional<int> dflt);

// A deck [model] key and the config.json key holding the same value.
struct ConfigKey {
  const char* deck;         // "model.num_layers"
  const char* hf;           // "num_hidden_layers"
  bool moe = false;         // a Qwen3-MoE key: it means nothing when num_experts is 0
  bool objective = false;   // router_aux_loss_coef: the objective's, not the architecture's
};
// Every model key of the deck (all [model] keys but preset, init and initializer_range).
const std::vector<ConfigKey>& config_keys();

// What config.json says beyond the architecture, kept for export.
struct ConfigExtras {
  nlohmann::json bos_token_id;  // null when absent; eos may be a list
  nlohmann::json eos_token_id;
  nlohmann::json pad_token_id;
};

// Reads <dir>/config.json. Throws UserError "<dir>/config.json: ..." for a missing or invalid
// file, another model type, or a feature qtrain does not have (rope scaling, sliding window,
// attention bias, quantisation, an activation other than silu). The returned preset is "".
// Keys a file omits take transformers' defaults (Qwen3Config's, Qwen3MoeConfig's). For
// qwen3_moe, as transformers does:
//   head_dim absent: hidden_size / num_attention_heads (Qwen3MoeConfig has no head_dim; Qwen3's
//     own MoE files set it, 128, which differs from 2048 / 32 for Qwen3-30B-A3B);
//   num_experts or its transformers 5 alias num_local_experts (both: they must agree);
//   mlp_only_layers in any order (kept sorted, each once); an index outside the model's layers
//     is refused (transformers would ignore it);
//   output_router_logits is not used: router_aux_loss_coef weighs the load-balancing loss as
//     in every qtrain run (docs/moe.md; 0 trains transformers' default objective).
ModelConfig read_config(const std::string& dir, ConfigExtras* extras = nullptr);

// Parses config.json text; `where` names the file in errors.
ModelConfig parse_config(const std::string& text, const std::string& where,
                         ConfigExtras* extras = nullptr);

// The language model's fields of a config object: a Qwen3 config.json's top level, or a
// Qwen3-VL config's text_config (hf/vl_config.h). moe: Qwen3-MoE's keys too. require_sizes:
// num_key_value_heads, head_dim, max_position_embeddings and rope_theta must be given (the
// Qwen3-VL configs' defaults differ from Qwen3's and the official files spell them out).
// mrope: M-RoPE's sections [time, height, width] are read into it from rope_parameters or
// rope_scaling and must be there (mrope_interleaved is accepted: transformers 5.17 always
// interleaves). Checks as parse_config, validate_model included; no model_type check.
struct TextConfigRules {
  bool moe = false;
  bool require_sizes = false;
  std::array<int, 3>* mrope = nullptr;
};
ModelConfig parse_text_config(const nlohmann::json& j, const std::string& where,
                              const TextConfigRules& rules);

// Refuses, as UserError "<where>: ...", sizes the engine cannot hold: a size below 1, an odd
// head_dim, query heads not a multiple of the kv heads, num_heads x head_dim beyond an int, a
// rope_theta or rms_norm_eps that is not a positive finite number; for Qwen3-MoE
// (num_experts > 0) also num_experts_per_tok above num_experts, mlp_only_layers not ascending
// layers of the model, a negative router_aux_loss_coef. Memory is checked later, against the
// machine (runtime/memory.h).
void validate_model(const ModelConfig& c, const std::string& where);

// config.json for transformers (4.51+ and 5.x) and other Qwen3 loaders: bf16 weights, the
// architecture of `cfg`, and the token ids of `extras` (omitted when null). A Qwen3-MoE model
// (cfg.num_experts > 0) gets Qwen3MoeForCausalLM, its MoE keys (num_experts by that name, as
// Qwen's files) and output_router_logits false, as the official configs.
nlohmann::ordered_json make_config_json(const ModelConfig& cfg, const ConfigExtras& extras);

// The token ids that Qwen3's own config.json uses, for a model with Qwen3's vocabulary
// (vocab_size >= 151646); null ids otherwise.
ConfigExtras default_extras(const ModelConfig& cfg);

}  // namespace qt::hf
