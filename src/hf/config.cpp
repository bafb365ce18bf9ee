// config.json of a Hugging Face Qwen3 model <-> ModelConfig (see config.h, docs/finetune.md).
#include "hf/config.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <limits>

#include "io/json_file.h"
#include "qtrain/error.h"

namespace qt::hf {

using json = nlohmann::json;

bool present(const json& j, const char* key) { return j.contains(key) && !j[key].is_null(); }

bool get_bool(const json& j, const char* key, const std::string& where, bool dflt) {
  if (!present(j, key)) return dflt;
  if (!j[key].is_boolean())
    fail_user("{}: \"{}\" is {}, expected true or false", where, key, j[key].dump());
  return j[key].get<bool>();
}

int get_int(const json& j, const char* key, const std::string& where, std::optional<int> dflt) {
  if (!present(j, key)) {
    if (dflt) return *dflt;
    fail_user("{}: key \"{}\" is missing", where, key);
  }
  const json& v = j[key];
  if (!v.is_number_integer() || v.get<std::int64_t>() < 1 || v.get<std::int64_t>() > (1ll << 31) - 1)
    fail_user("{}: \"{}\" is {}, expected a positive integer", where, key, v.dump());
  return v.get<int>();
}

namespace {

// transformers' Qwen3Config defaults (5.x; the same in 4.51+) for keys a config.json may omit;
// Qwen3MoeConfig's are the same but for head_dim (below).
constexpr int kDefaultHeadDim = 128;
constexpr double kDefaultRopeTheta = 10000.0;
constexpr double kDefaultRmsNormEps = 1e-6;
constexpr int kDefaultMaxPositions = 32768;
constexpr double kDefaultInitializerRange = 0.02;

// Qwen3MoeConfig's defaults (transformers 5.17) for the Qwen3-MoE keys a config.json may omit.
constexpr int kMoeDefaultExperts = 128;
constexpr int kMoeDefaultPerTok = 8;
constexpr int kMoeDefaultIntermediate = 768;
constexpr int kMoeDefaultSparseStep = 1;
constexpr bool kMoeDefaultNormTopk = false;
constexpr double kMoeDefaultAuxCoef = 0.001;

double get_double(const json& v, const std::string& what, const std::string& where) {
  if (!v.is_number() || !(v.get<double>() > 0))
    fail_user("{}: \"{}\" is {}, expected a positive number", where, what, v.dump());
  return v.get<double>();
}

// A RoPE description (rope_scaling, or transformers 5's rope_parameters): plain RoPE or YaRN
// (qtrain's model.rope_* fields, into `c`, with original_max_position_embeddings defaulting to
// max_position_embeddings and factor to their ratio, as transformers); anything else is refused.
// Returns its rope_theta if it has one.
std::optional<double> read_rope(const json& r, const char* key, const std::string& where,
                                ModelConfig& c, std::array<int, 3>* mrope) {
  if (r.is_null()) return std::nullopt;
  if (!r.is_object()) fail_user("{}: \"{}\" is {}, expected an object or null", where, key, r.dump());
  std::string type = "default";
  for (const char* k : {"rope_type", "type"})
    if (present(r, k)) type = r[k].is_string() ? r[k].get<std::string>() : r[k].dump();
  if (type != "default" && type != "yarn")
    fail_user("{}: \"{}\" asks for RoPE scaling of type \"{}\"; qtrain implements plain RoPE "
              "(rope_type default) and yarn", where, key, type);
  const bool yarn = type == "yarn";
  std::optional<double> theta, factor;
  std::optional<int> original;
  auto number = [&](const json& v, const std::string& name) {
    return get_double(v, std::string(key) + "." + name, where);
  };
  for (auto it = r.begin(); it != r.end(); ++it) {
    const std::string& k = it.key();
    if (k == "rope_type" || k == "type") continue;
    if (mrope && k == "mrope_interleaved") continue;  // transformers 5.17 always interleaves
    if (mrope && k == "mrope_section") {
      const json& v = it.value();
      bool ok = v.is_array() && v.size() == 3;
      for (const json& x : v) ok = ok && x.is_number_integer() && x.get<std::int64_t>() >= 1;
      if (!ok)
        fail_user("{}: \"{}.mrope_section\" is {}, expected 3 positive integers (time, height, "
                  "width)", where, key, v.dump());
      for (int i = 0; i < 3; ++i) (*mrope)[i] = v[i].get<int>();
      continue;
    }
    if (k == "rope_theta") {
      theta = number(it.value(), k);
    } else if (yarn && k == "factor") {
      factor = number(it.value(), k);
    } else if (yarn && k == "original_max_position_embeddings") {
      original = static_cast<int>(number(it.value(), k));
    } else if (yarn && k == "attention_factor") {
      if (!it.value().is_null()) c.rope_attention_factor = number(it.value(), k);
    } else if (yarn && (k == "beta_fast" || k == "beta_slow")) {
      // transformers: `get(...) or default`, so 0 and null mean the default
      const double v = it.value().is_null() ? 0 : number(it.value(), k);
      if (v != 0) (k == "beta_fast" ? c.rope_beta_fast : c.rope_beta_slow) = v;
    } else if (yarn && k == "truncate" && it.value() == json(true)) {
      continue;
    } else {
      fail_user("{}: \"{}\" has \"{}\" = {}, which qtrain does not implement", where, key, k,
                it.value().dump());
    }
  }
  if (yarn) {
    c.rope_type = "yarn";
    c.rope_original_max_position_embeddings = original.value_or(c.max_position_embeddings);
    c.rope_factor = factor.value_or(static_cast<double>(c.max_position_embeddings) /
                                    c.rope_original_max_position_embeddings);
  }
  return theta;
}

// A Qwen3-MoE config.json's keys (qwen3-spec.md 1.1; Qwen3MoeConfig's defaults when absent).
void read_moe(const json& j, const std::string& where, ModelConfig& c) {
  // num_experts in the Hub's files and transformers 4.x's; transformers 5 writes its alias
  // num_local_experts.
  std::optional<int> experts;
  for (const char* key : {"num_experts", "num_local_experts"}) {
    if (!present(j, key)) continue;
    const int v = get_int(j, key, where, std::nullopt);
    if (experts && *experts != v)
      fail_user("{}: num_experts {} and num_local_experts {} disagree", where, *experts, v);
    experts = v;
  }
  c.num_experts = experts.value_or(kMoeDefaultExperts);
  c.num_experts_per_tok = get_int(j, "num_experts_per_tok", where, kMoeDefaultPerTok);
  c.moe_intermediate_size = get_int(j, "moe_intermediate_size", where, kMoeDefaultIntermediate);
  c.decoder_sparse_step = get_int(j, "decoder_sparse_step", where, kMoeDefaultSparseStep);
  c.norm_topk_prob = get_bool(j, "norm_topk_prob", where, kMoeDefaultNormTopk);
  get_bool(j, "output_router_logits", where, false);  // checked only: see config.h
  c.router_aux_loss_coef = kMoeDefaultAuxCoef;
  if (present(j, "router_aux_loss_coef")) {
    const json& v = j["router_aux_loss_coef"];
    if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>()))
      fail_user("{}: \"router_aux_loss_coef\" is {}, expected a number >= 0", where, v.dump());
    c.router_aux_loss_coef = v.get<double>();
  }
  // mlp_only_layers: a list of layer indices (null: none); transformers tests membership, so
  // order and repeats do not matter: kept sorted, each once.
  c.mlp_only_layers.clear();
  if (present(j, "mlp_only_layers")) {
    const json& v = j["mlp_only_layers"];
    bool ok = v.is_array();
    for (const json& x : v) ok = ok && x.is_number_integer();
    if (!ok) fail_user("{}: \"mlp_only_layers\" is {}, expected a list of layer indices", where, v.dump());
    for (const json& x : v) {
      const std::int64_t l = x.get<std::int64_t>();
      if (l < 0 || l >= c.num_layers)
        fail_user("{}: \"mlp_only_layers\" lists layer {}; the model's layers are 0 .. {}", where,
                  l, c.num_layers - 1);
      c.mlp_only_layers.push_back(static_cast<int>(l));
    }
    std::sort(c.mlp_only_layers.begin(), c.mlp_only_layers.end());
    c.mlp_only_layers.erase(std::unique(c.mlp_only_layers.begin(), c.mlp_only_layers.end()),
                            c.mlp_only_layers.end());
  }
}

}  // namespace

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = {
      {"model.vocab_size", "vocab_size"},
      {"model.hidden_size", "hidden_size"},
      {"model.intermediate_size", "intermediate_size"},
      {"model.num_layers", "num_hidden_layers"},
      {"model.num_heads", "num_attention_heads"},
      {"model.num_kv_heads", "num_key_value_heads"},
      {"model.head_dim", "head_dim"},
      {"model.rope_theta", "rope_theta"},
      {"model.rms_norm_eps", "rms_norm_eps"},
      {"model.tie_word_embeddings", "tie_word_embeddings"},
      {"model.max_position_embeddings", "max_position_embeddings"},
      {"model.num_experts", "num_experts"},
      {"model.num_experts_per_tok", "num_experts_per_tok", true},
      {"model.moe_intermediate_size", "moe_intermediate_size", true},
      {"model.norm_topk_prob", "norm_topk_prob", true},
      {"model.decoder_sparse_step", "decoder_sparse_step", true},
      {"model.mlp_only_layers", "mlp_only_layers", true},
      {"model.router_aux_loss_coef", "router_aux_loss_coef", true, true},
  };
  return keys;
}

ModelConfig parse_config(const std::string& text, const std::string& where, ConfigExtras* extras) {
  const json j = io::parse_json(text, where);
  if (!j.is_object()) fail_user("{}: not a JSON object", where);

  // Which model: model_type "qwen3" or "qwen3_moe" and, when listed, its architecture.
  const std::string kWant =
      "qtrain reads Qwen3 models: model_type \"qwen3\" (Qwen3ForCausalLM) or \"qwen3_moe\" "
      "(Qwen3MoeForCausalLM)";
  if (!present(j, "model_type")) fail_user("{}: key \"model_type\" is missing; {}", where, kWant);
  const json& type = j["model_type"];
  const bool moe = type == "qwen3_moe";
  if (type != "qwen3" && !moe) fail_user("{}: model_type is {}; {}", where, type.dump(), kWant);
  if (present(j, "architectures")) {
    const char* arch = moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM";
    const json& a = j["architectures"];
    bool ok = a.is_array() && !a.empty();
    for (const json& x : a) ok = ok && x == arch;
    if (!ok) fail_user("{}: architectures is {}; {}", where, a.dump(), kWant);
  }

  ModelConfig c = parse_text_config(j, where, {moe, false, nullptr});
  if (extras) {
    extras->bos_token_id = j.value("bos_token_id", json());
    extras->eos_token_id = j.value("eos_token_id", json());
    extras->pad_token_id = j.value("pad_token_id", json());
  }
  return c;
}

ModelConfig parse_text_config(const json& j, const std::string& where, const TextConfigRules& rules) {
  const bool moe = rules.moe;
  // A key the rules require, else transformers' default.
  auto dflt = [&](int v) { return rules.require_sizes ? std::optional<int>() : std::optional<int>(v); };
  // Features qtrain does not have: refuse them rather than train a different model.
  auto refuse_unless = [&](const char* key, const json& ok_value, const char* why) {
    if (present(j, key) && j[key] != ok_value)
      fail_user("{}: \"{}\" is {}; {}", where, key, j[key].dump(), why);
  };
  refuse_unless("hidden_act", "silu", "qtrain's MLP is SwiGLU with silu");
  refuse_unless("attention_bias", false, "qtrain's attention projections have no bias");
  refuse_unless("use_sliding_window", false, "qtrain has no sliding-window attention");
  refuse_unless("attention_dropout", 0.0, "qtrain has no attention dropout");
  if (present(j, "quantization_config"))
    fail_user("{}: \"quantization_config\" is set; qtrain loads unquantised BF16, F16 or F32 weights",
              where);
  if (present(j, "layer_types")) {
    const json& lt = j["layer_types"];
    bool ok = lt.is_array();
    for (const json& x : lt) ok = ok && x == "full_attention";
    if (!ok) fail_user("{}: \"layer_types\" is {}; qtrain has full attention in every layer", where, lt.dump());
  }

  ModelConfig c;
  c.preset = "";
  c.vocab_size = get_int(j, "vocab_size", where, std::nullopt);
  c.hidden_size = get_int(j, "hidden_size", where, std::nullopt);
  c.intermediate_size = get_int(j, "intermediate_size", where, std::nullopt);
  c.num_layers = get_int(j, "num_hidden_layers", where, std::nullopt);
  c.num_heads = get_int(j, "num_attention_heads", where, std::nullopt);
  c.num_kv_heads = get_int(j, "num_key_value_heads", where, dflt(c.num_heads));
  // Qwen3MoeConfig has no head_dim: transformers' MoE model takes config.json's, else
  // hidden_size // num_attention_heads (qwen3-spec.md 1.1 notes), and so does qtrain.
  c.head_dim = get_int(j, "head_dim", where,
                       dflt(moe ? c.hidden_size / c.num_heads : kDefaultHeadDim));
  c.max_position_embeddings =
      get_int(j, "max_position_embeddings", where, dflt(kDefaultMaxPositions));
  c.rms_norm_eps = present(j, "rms_norm_eps") ? get_double(j["rms_norm_eps"], "rms_norm_eps", where)
                                              : kDefaultRmsNormEps;
  c.initializer_range = present(j, "initializer_range")
                            ? get_double(j["initializer_range"], "initializer_range", where)
                            : kDefaultInitializerRange;
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", where, false);
  // RoPE: rope_theta at the top (transformers 4.x, the Hub's Qwen3 files) or inside
  // rope_parameters (transformers 5.x); rope_scaling, when set, must be plain RoPE too.
  std::optional<double> theta;
  if (present(j, "rope_theta")) theta = get_double(j["rope_theta"], "rope_theta", where);
  bool mrope_seen = false;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!j.contains(key)) continue;
    const std::array<int, 3> before = rules.mrope ? *rules.mrope : std::array<int, 3>{};
    auto t = read_rope(j[key], key, where, c, rules.mrope);
    if (rules.mrope && present(j[key], "mrope_section")) {
      if (mrope_seen && *rules.mrope != before)
        fail_user("{}: rope_parameters and rope_scaling give different mrope_section", where);
      mrope_seen = true;
    }
    if (t && theta && *t != *theta)
      fail_user("{}: rope_theta {} and {}.rope_theta {} disagree", where, *theta, key, *t);
    if (t) theta = t;
  }
  if (rules.mrope && !mrope_seen)
    fail_user("{}: no mrope_section in rope_parameters or rope_scaling (the language model's "
              "M-RoPE sections, e.g. [24, 20, 20])", where);
  if (!theta && rules.require_sizes)
    fail_user("{}: no rope_theta (at the top or in rope_parameters)", where);
  c.rope_theta = theta.value_or(kDefaultRopeTheta);
  if (moe) read_moe(j, where, c);

  validate_model(c, where);
  return c;
}

void validate_model(const ModelConfig& c, const std::string& where) {
  const std::pair<const char*, int> sizes[] = {
      {"vocab_size", c.vocab_size},         {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size}, {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads}, {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},             {"max_position_embeddings", c.max_position_embeddings}};
  for (const auto& [name, v] : sizes)
    if (v < 1) fail_user("{}: {} is {}, expected a positive integer", where, name, v);
  if (c.head_dim % 2 != 0)
    fail_user("{}: head_dim is {}; it must be even (RoPE rotates halves)", where, c.head_dim);
  if (c.num_heads % c.num_kv_heads != 0)
    fail_user("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", where,
              c.num_heads, c.num_kv_heads);
  // q_dim() and kv_dim() are ints: their products must not overflow (kv_dim <= q_dim).
  const std::int64_t q = std::int64_t{c.num_heads} * c.head_dim;
  if (q > std::numeric_limits<int>::max())
    fail_user("{}: num_attention_heads x head_dim = {} x {} = {} is beyond {} (absurd sizes)",
              where, c.num_heads, c.head_dim, q, std::numeric_limits<int>::max());
  for (const auto& [name, v] :
       {std::pair{"rope_theta", c.rope_theta}, std::pair{"rms_norm_eps", c.rms_norm_eps}})
    if (!(v > 0) || !std::isfinite(v))
      fail_user("{}: {} is {}, expected a positive number", where, name, v);
  if (c.is_yarn()) {  // rope_scaling / rope_parameters of type yarn
    for (const auto& [name, v] : {std::pair{"factor", c.rope_factor},
                                  std::pair{"beta_fast", c.rope_beta_fast},
                                  std::pair{"beta_slow", c.rope_beta_slow}})
      if (!(v > 0) || !std::isfinite(v))
        fail_user("{}: the yarn RoPE scaling's {} is {}, expected a positive number", where, name, v);
    if (c.rope_original_max_position_embeddings < 1)
      fail_user("{}: the yarn RoPE scaling's original_max_position_embeddings is {}, expected a "
                "positive integer", where, c.rope_original_max_position_embeddings);
    if (!(c.rope_attention_factor >= 0) || !std::isfinite(c.rope_attention_factor))
      fail_user("{}: the yarn RoPE scaling's attention_factor is {}, expected a positive number",
                where, c.rope_attention_factor);
  }
  if (c.num_experts == 0) return;
  // Qwen3-MoE: k of E experts, a sparse layer's width, which layers are dense.
  for (const auto& [name, v] : {std::pair{"num_experts", c.num_experts},
                                std::pair{"num_experts_per_tok", c.num_experts_per_tok},
                                std::pair{"moe_intermediate_size", c.moe_intermediate_size},
                                std::pair{"decoder_sparse_step", c.decoder_sparse_step}})
    if (v < 1) fail_user("{}: {} is {}, expected a positive integer", where, name, v);
  if (c.num_experts_per_tok > c.num_experts)
    fail_user("{}: num_experts_per_tok {} is more than num_experts {}", where,
              c.num_experts_per_tok, c.num_experts);
  for (std::size_t i = 0; i < c.mlp_only_layers.size(); ++i) {
    const int l = c.mlp_only_layers[i];
    if (l < 0 || l >= c.num_layers || (i > 0 && l <= c.mlp_only_layers[i - 1]))
      fail_user("{}: mlp_only_layers lists layer {}; expected ascending layers of 0 .. {}, each "
                "once", where, l, c.num_layers - 1);
  }
  if (!(c.router_aux_loss_coef >= 0) || !std::isfinite(c.router_aux_loss_coef))
    fail_user("{}: router_aux_loss_coef is {}, expected a number >= 0", where,
              c.router_aux_loss_coef);
}

ModelConfig read_config(const std::string& dir, ConfigExtras* extras) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  return parse_config(io::read_text_file(path), path, extras);
}

ConfigExtras default_extras(const ModelConfig& cfg) {
  ConfigExtras e;
  if (cfg.vocab_size >= 151646) {  // Qwen3's tokenizer: <|endoftext|> 151643, <|im_end|> 151645
    e.bos_token_id = 151643;
    e.eos_token_id = 151645;
  }
  return e;
}

nlohmann::ordered_json make_config_json(const ModelConfig& c, const ConfigExtras& extras) {
  // Keys in the order of Qwen's own files; a Qwen3-MoE model's as Qwen3-30B-A3B's config.json.
  const bool moe = c.is_moe();
  nlohmann::ordered_json j;
  j["architectures"] = {moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = extras.bos_token_id;
  if (moe) j["decoder_sparse_step"] = c.decoder_sparse_step;
  j["dtype"] = "bfloat16";
  j["eos_token_id"] = extras.eos_token_id;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.hidden_size;
  j["initializer_range"] = c.initializer_range;
  j["intermediate_size"] = c.intermediate_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["max_window_layers"] = c.num_layers;
  if (moe) j["mlp_only_layers"] = c.mlp_only_layers;
  j["model_type"] = moe ? "qwen3_moe" : "qwen3";
  if (moe) {
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
  }
  j["num_attention_heads"] = c.num_heads;
  if (moe) {
    j["num_experts"] = c.num_experts;  // transformers 5 reads it as num_local_experts too
    j["num_experts_per_tok"] = c.num_experts_per_tok;
  }
  j["num_hidden_layers"] = c.num_layers;
  j["num_key_value_heads"] = c.num_kv_heads;
  // As the official configs: transformers then trains without the load-balancing loss.
  if (moe) j["output_router_logits"] = false;
  if (!extras.pad_token_id.is_null()) j["pad_token_id"] = extras.pad_token_id;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_scaling"] = nullptr;
  if (c.is_yarn()) {
    json y = {{"rope_type", "yarn"},
              {"factor", c.rope_factor},
              {"original_max_position_embeddings", c.rope_original_max_position_embeddings},
              {"beta_fast", c.rope_beta_fast},
              {"beta_slow", c.rope_beta_slow}};
    if (c.rope_attention_factor > 0) y["attention_factor"] = c.rope_attention_factor;
    j["rope_scaling"] = y;
  }
  j["rope_theta"] = c.rope_theta;
  if (moe) j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  j["sliding_window"] = nullptr;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = "bfloat16";  // transformers 4.x's name of dtype
  j["use_cache"] = true;
  j["use_sliding_window"] = false;
  j["vocab_size"] = c.vocab_size;
  return j;
}

}  // namespace qt::hf
