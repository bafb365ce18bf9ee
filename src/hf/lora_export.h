// A LoRA run's checkpoint outside qtrain (docs/finetune.md, "LoRA"):
//   qtrain export ckpt.h5 DIR          -> DIR/adapter_model.safetensors (fp32, PEFT's names) and
//                                         DIR/adapter_config.json, what peft's
//                                         PeftModel.from_pretrained(base, DIR) loads;
//   qtrain export ckpt.h5 DIR --merge  -> a model directory with W + scale * B A (export.h).
// The base is the one the checkpoint names: its run's model.init directory (where
// find_init_dir finds it now: --base, the absolute path, the path as given), or the model that
// init_params builds from its seed.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hf/export.h"
#include "qtrain/comm.h"
#include "qtrain/lora.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"

namespace qt::hf {

// Collective: the adapters of LoRA checkpoint `path` (cm.lora set), validated and checksummed,
// as a flat buffer of lora_layout(cm.cfg, cm.lora->config).
std::vector<float> read_lora_adapters(const std::string& path, const CheckpointModel& cm,
                                      std::shared_ptr<MpiComm> world);

// Collective: the frozen base of the LoRA checkpoint into `params` (ParamLayout(cm.cfg)): the
// model of its seed, or the weights in cm.init_found.dir. UserError when that directory was not
// found (naming the paths tried) or does not fit.
void load_lora_base(const std::string& path, const CheckpointModel& cm, const ParamLayout& layout,
                    float* params, Comm& world);

// Collective: base + scale * B A, the merged model's weights, into `params`.
void lora_merged_params(const std::string& path, const CheckpointModel& cm,
                        const ParamLayout& layout, float* params, std::shared_ptr<MpiComm> world);

// The base as adapter_config.json names it: the absolute path of its directory (where it was
// found, else where the run had it), "" for a base initialised from a seed.
std::string lora_base_path(const CheckpointModel& cm);

// adapter_config.json as peft writes it for a LoraConfig with these settings, base_model_name_or_path
// `base_path` (null when "").
nlohmann::json adapter_config_json(const LoraCheckpointInfo& lora, const std::string& base_path);

// PEFT's adapter_model.safetensors tensors of adapters in lora_layout(cfg, lora) (a global model:
// every expert): the dense adapters as they are; the experts' stacked A [E, r, in] and
// B [E, out, r] as peft's lora.ParamWrapper keeps a 3-D parameter of E experts (peft
// src/peft/tuners/lora/layer.py, update_layer and get_delta_weight): lora_A [E r, in] (row
// e r + j: A_e's row j, the same bytes) and lora_B [out, r E] (column j E + e: B_e's column j),
// under the name of the (nested) wrapper of mlp.experts: with both targets the gate_up_proj
// wrapper is the inner one, "...mlp.experts.base_layer.lora_A.weight", and down_proj's
// "...mlp.experts.lora_A.weight"; a lone target is "...mlp.experts.lora_A.weight".
struct PeftTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> values;
};
std::vector<PeftTensor> peft_adapter_tensors(const ModelConfig& cfg, const LoraConfig& lora,
                                             const float* adapters);

// The adapter directory (rank 0 writes it atomically, as export_checkpoint does). Returns the
// summary line.
std::string export_lora_adapters(const ExportOptions& o, const CheckpointModel& cm,
                                 std::shared_ptr<MpiComm> world);

}  // namespace qt::hf
