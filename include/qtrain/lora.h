// LoRA settings (the deck's [lora] section) as PEFT defines them: for a target Linear
// W [out, in], y = x W^T + scale * dropout(x) A^T B^T with A [r, in], B [out, r] and
// scale = alpha / r. Only A and B train; W stays frozen. docs/finetune.md, "LoRA".
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace qt {

struct LoraConfig {
  int r = 0;           // rank; 0 = LoRA off (the whole model trains)
  double alpha = 16;   // scale = alpha / r
  double dropout = 0;  // inverted dropout on the adapters' input, in [0, 1)
  // Comma list of kLoraTargets and (a Qwen3-MoE model's experts) kLoraExpertTargets.
  std::string targets = "q_proj,k_proj,v_proj,o_proj";
  bool enabled() const { return r > 0; }
  double scale() const { return alpha / r; }
};

// The projections LoRA can adapt, in the order of the adapter layout within a layer, with their
// module paths inside a decoder layer (transformers' names).
inline constexpr int kNumLoraTargets = 7;
inline constexpr std::array<const char*, kNumLoraTargets> kLoraTargets = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
inline constexpr std::array<const char*, kNumLoraTargets> kLoraModules = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};

// Adapters on every expert of a Qwen3-MoE model's sparse layers, as peft's target_parameters
// adapts transformers' fused expert tensors (lora.ParamWrapper): expert e of gate_up_proj
// [E, 2 Im, H] (W_e [2 Im, H]: one adapter over its gate and up rows) and of down_proj
// [E, H, Im] gets its own A_e [r, in] and B_e [out, r]; the router stays frozen.
// docs/finetune.md, "LoRA on Qwen3-MoE".
inline constexpr int kNumLoraExpertTargets = 2;
enum LoraExpertTarget : int { kLoraExpertsGateUp, kLoraExpertsDown };
inline constexpr std::array<const char*, kNumLoraExpertTargets> kLoraExpertTargets = {
    "experts.gate_up_proj", "experts.down_proj"};

// Indices into kLoraTargets of a comma list ("q_proj, v_proj"), ascending; the list's expert
// targets (kLoraExpertTargets) are left out here (parse_lora_expert_targets). Throws UserError
// "<what>: ..." on an empty item, an unknown name or a name given twice.
std::vector<int> parse_lora_targets(const std::string& list, const std::string& what);
// Indices into kLoraExpertTargets of the same list, ascending (empty: no expert adapters).
std::vector<int> parse_lora_expert_targets(const std::string& list, const std::string& what);

// The frozen base a LoRA run adapts, stored in its checkpoints: the model.init directory, or
// (when that is empty) the model initialised from train.seed.
struct LoraBase {
  std::string init;        // [model] init as written; "" = initialised from `seed`
  std::uint64_t seed = 0;  // train.seed (used only when init is "")
  // init made absolute (lexically normal) in the run's working directory; "" when init is, and
  // in checkpoints written before it was stored (then init is resolved from the reader's).
  std::string init_abs;
  // The base of a run started in this working directory: init_abs filled from init.
  static LoraBase of(const std::string& init, std::uint64_t seed);
  std::string describe() const;  // "model.init = DIR (/abs/DIR)" or "train.seed = N"
  // Same seed, or the same directory: the absolute paths, lexically normalised (an init_abs not
  // stored is made absolute from this working directory), so that a run resumed from another
  // working directory, with a path relative to that one, still matches its base.
  bool same_as(const LoraBase& o) const;
};

// What a LoRA run's checkpoint holds beside its adapters (root attributes lora_*).
struct LoraCheckpointInfo {
  LoraConfig config;
  LoraBase base;
};

}  // namespace qt
