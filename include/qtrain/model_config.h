// Architecture of a Qwen3 model, dense or Qwen3-MoE (../shared/docs/qwen3-spec.md, section 1.1;
// the MoE fields keep transformers' Qwen3MoeConfig names).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace qt {

struct ModelConfig {
  std::string preset = "tiny";
  int vocab_size = 256;
  int hidden_size = 64;           // H
  int intermediate_size = 192;    // I (SwiGLU width)
  int num_layers = 2;             // L
  int num_heads = 4;              // nh (query heads)
  int num_kv_heads = 2;           // nkv (GQA)
  int head_dim = 16;              // hd
  double rope_theta = 1e6;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = true;
  double initializer_range = 0.02;
  int max_position_embeddings = 40960;
  // RoPE scaling (config.json's rope_scaling or rope_parameters; docs/decks.md "model.rope_type"):
  // "default" (none) or "yarn", transformers 5.17's YaRN: each frequency blended between its
  // plain value and value / rope_factor by a ramp over the dimensions whose rotations within the
  // pretrained context rope_original_max_position_embeddings lie between rope_beta_slow and
  // rope_beta_fast, and cos/sin scaled by rope_attention_factor (0: 0.1 ln(factor) + 1).
  std::string rope_type = "default";
  double rope_factor = 1;
  int rope_original_max_position_embeddings = 0;
  double rope_attention_factor = 0;
  double rope_beta_fast = 32, rope_beta_slow = 1;
  bool is_yarn() const { return rope_type == "yarn"; }
  // The factor cos and sin are multiplied by: 1 for plain RoPE.
  double rope_cos_sin_scale() const;
  // Qwen3-MoE (num_experts > 0): layer l is a sparse block of num_experts experts of width
  // moe_intermediate_size, num_experts_per_tok a token, unless l is in mlp_only_layers or
  // (l + 1) % decoder_sparse_step != 0 (then a dense MLP of intermediate_size).
  int num_experts = 0;                 // E; 0: a dense model
  int num_experts_per_tok = 8;         // k
  int moe_intermediate_size = 768;     // Im
  bool norm_topk_prob = true;          // renormalise the k routing weights to sum 1
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;    // ascending layer indices
  double router_aux_loss_coef = 0.001; // weight of the load-balancing loss in the objective
  // Auxiliary-loss-free balancing (docs/moe.md): the step of each sparse layer's router bias
  // after every optimizer step, in units of the router's probabilities; 0: no bias. A training
  // setting like router_aux_loss_coef, not architecture: neither checkpoints nor config.json
  // compare it.
  double router_bias_update_rate = 0;
  // Expert capacity (docs/moe.md "Capacity factor"): each expert of a sparse layer takes at most
  // expert_capacity(N, k, E, factor) (ops/moe_capacity.h) of the token-slots of one router call
  // (N tokens: a rank's micro-batch), the overflow dropped and counted; 0: dropless. A training
  // setting like router_bias_update_rate: neither checkpoints nor config.json hold it.
  double moe_capacity_factor = 0;
  // Not an architecture key: the local model of an expert-parallel rank (ep_local_config,
  // parallel/expert_parallel.h) stores E / expert_shards experts of each sparse layer, placed
  // after the head in its ParamLayout (one unit each in the plan). 1 for every model a deck, a
  // checkpoint or a Hugging Face directory describes.
  int expert_shards = 1;

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
  bool is_moe() const { return num_experts > 0; }
  int local_experts() const { return num_experts / expert_shards; }  // experts stored here
  // Layer l is a sparse (MoE) block (transformers' rule, qwen3-spec.md 1.1 notes).
  bool is_moe_layer(int l) const;
  // Sparse layers among layers [0, l): layer l's place among them when it is one.
  int moe_layers_before(int l) const;
  int num_moe_layers() const { return moe_layers_before(num_layers); }
  // Total parameter count, by the spec's formula (section 1.3).
  std::int64_t num_params() const;
  // The same in double, which cannot overflow: for checks of sizes before they are allocated.
  double num_params_f64() const;
  // Parameters a token runs through: the MoE layers' experts counted k of E (the router whole).
  double active_params_f64() const;
};

// The named presets; nullopt for an unknown name.
std::optional<ModelConfig> model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

}  // namespace qt
