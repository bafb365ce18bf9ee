// LoRA checkpoints to PEFT's adapter directory, or merged into the base (see lora_export.h).
#include "hf/lora_export.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "hf/export_dir.h"
#include "hf/safetensors.h"
#include "hf/weights.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "qtrain/checkpoint.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"

namespace qt::hf {

namespace fs = std::filesystem;

std::vector<float> read_lora_adapters(const std::string& path, const CheckpointModel& cm,
                                      std::shared_ptr<MpiComm> world) {
  QT_CHECK(cm.lora.has_value(), "read_lora_adapters on a checkpoint without LoRA");
  const ParamLayout layout = lora_layout(cm.cfg, cm.lora->config);
  std::vector<float> adapters(layout.numel());
  MeshShape shape;
  shape.dp = world->size();
  Mesh mesh(shape, world);
  float dummy = 0;
  checkpoint_read(path, mesh, layout, adapters.data(), MomentShard{{0, 0}, &dummy, &dummy}, cm.cfg,
                  &*cm.lora);
  return adapters;
}

void load_lora_base(const std::string& path, const CheckpointModel& cm, const ParamLayout& layout,
                    float* params, Comm& world) {
  const LoraBase& base = cm.lora->base;
  if (base.init.empty()) {
    init_params(cm.cfg, layout, base.seed, params);
    return;
  }
  const std::string& dir = cm.init_found.dir;  // the same on every rank
  if (dir.empty())
    fail_user("checkpoint {}: its LoRA base, {}, is not found (tried {}); pass --base DIR where "
              "that Hugging Face directory is now (the adapters only make sense on the base they "
              "were trained on)",
              path, base.describe(), tried_text(cm.init_found));
  try {
    load_params(dir, layout, all_rows(layout, params), cm.cfg.tie_word_embeddings, world);
  } catch (const UserError& e) {  // thrown on every rank alike
    throw UserError(fmt::format(
        "checkpoint {}: its LoRA base, {}, cannot be loaded from {} (the adapters only make sense "
        "on the base they were trained on): {}",
        path, base.describe(), dir, e.what()));
  }
}

std::string lora_base_path(const CheckpointModel& cm) {
  const LoraBase& b = cm.lora->base;
  if (b.init.empty()) return "";
  if (!cm.init_found.dir.empty()) return LoraBase::of(cm.init_found.dir, b.seed).init_abs;
  return b.init_abs.empty() ? b.init : b.init_abs;
}

void lora_merged_params(const std::string& path, const CheckpointModel& cm,
                        const ParamLayout& layout, float* params, std::shared_ptr<MpiComm> world) {
  const std::vector<float> adapters = read_lora_adapters(path, cm, world);
  load_lora_base(path, cm, layout, params, *world);
  lora_merge(cm.cfg, cm.lora->config, adapters.data(), layout, params);
}

namespace {
// PEFT's name of expert adapter `name` of lora_layout ("...layers.{l}.mlp.experts.{gate_up_proj,
// down_proj}.lora_{A,B}.weight", lora_expert_param_name): the target's part becomes its
// wrapper's, "experts.base_layer." for gate_up_proj beside down_proj, else "experts.".
std::string peft_expert_name(std::string name, bool both) {
  for (int et = 0; et < kNumLoraExpertTargets; ++et) {
    const std::string ours = fmt::format(".mlp.{}.", kLoraExpertTargets[et]);
    const std::size_t at = name.find(ours);
    if (at == std::string::npos) continue;
    return name.replace(
        at, ours.size(),
        both && et == kLoraExpertsGateUp ? ".mlp.experts.base_layer." : ".mlp.experts.");
  }
  QT_CHECK(false, "adapter {} is neither dense nor an expert's", name);
  return name;
}
}  // namespace

std::vector<PeftTensor> peft_adapter_tensors(const ModelConfig& cfg, const LoraConfig& lora,
                                             const float* adapters) {
  const ParamLayout layout = lora_layout(cfg, lora);
  QT_CHECK(cfg.local_experts() == cfg.num_experts, "PEFT's tensors of an ep rank's experts");
  const bool both = parse_lora_expert_targets(lora.targets, "lora.targets").size() == 2;
  std::vector<PeftTensor> out;
  for (const ParamInfo& p : layout.params()) {
    const float* v = adapters + p.offset;
    if (p.shape.size() == 2) {  // a dense adapter
      out.push_back({p.name, p.shape, std::vector<float>(v, v + p.numel)});
      continue;
    }
    const std::string name = peft_expert_name(p.name, both);
    const std::int64_t E = p.shape[0], d1 = p.shape[1], d2 = p.shape[2];
    if (p.name.ends_with(".lora_A.weight")) {  // [E, r, in] -> [E r, in]
      out.push_back({name, {E * d1, d2}, std::vector<float>(v, v + p.numel)});
      continue;
    }
    // [E, out, r] -> [out, r E], element (o, j E + e) = B_e(o, j)
    const std::int64_t outd = d1, r = d2;
    std::vector<float> b(p.numel);
    for (std::int64_t e = 0; e < E; ++e)
      for (std::int64_t o = 0; o < outd; ++o)
        for (std::int64_t j = 0; j < r; ++j) b[(o * r + j) * E + e] = v[(e * outd + o) * r + j];
    out.push_back({name, {outd, r * E}, std::move(b)});
  }
  return out;
}

nlohmann::json adapter_config_json(const LoraCheckpointInfo& lora, const std::string& base_path) {
  const LoraConfig& c = lora.config;
  nlohmann::json j;  // keys sorted, as peft's save_pretrained writes them
  std::vector<std::string> targets;
  for (int t : parse_lora_targets(c.targets, "lora.targets")) targets.push_back(kLoraTargets[t]);
  std::vector<std::string> parameters;  // peft's target_parameters: the experts' fused tensors
  for (int et : parse_lora_expert_targets(c.targets, "lora.targets"))
    parameters.push_back(std::string("mlp.") + kLoraExpertTargets[et]);
  j["alpha_pattern"] = nlohmann::json::object();
  j["auto_mapping"] = nullptr;
  j["base_model_name_or_path"] =
      base_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(base_path);
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  if (c.alpha == std::floor(c.alpha) && std::abs(c.alpha) < 1e15)
    j["lora_alpha"] = static_cast<std::int64_t>(c.alpha);  // peft's type is int
  else
    j["lora_alpha"] = c.alpha;
  j["lora_dropout"] = c.dropout;
  j["modules_to_save"] = nullptr;
  j["peft_type"] = "LORA";
  j["r"] = c.r;
  j["rank_pattern"] = nlohmann::json::object();
  j["revision"] = nullptr;
  j["target_modules"] = targets;
  if (!parameters.empty()) j["target_parameters"] = parameters;
  j["task_type"] = "CAUSAL_LM";
  j["use_dora"] = false;
  j["use_rslora"] = false;
  return j;
}

std::string export_lora_adapters(const ExportOptions& o, const CheckpointModel& cm,
                                 std::shared_ptr<MpiComm> world) {
  const std::vector<float> adapters = read_lora_adapters(o.checkpoint, cm, world);
  const ParamLayout layout = lora_layout(cm.cfg, cm.lora->config);
  std::string err, summary;
  if (world->rank() == 0) {
    const fs::path tmp = export_staging_dir(o.out_dir);
    try {
      std::error_code ec;
      fs::remove_all(tmp, ec);  // a stale one from an interrupted export
      fs::create_directories(tmp, ec);
      if (ec) fail_user("cannot create {}: {}", tmp.string(), ec.message());
      const std::vector<PeftTensor> peft = peft_adapter_tensors(cm.cfg, cm.lora->config,
                                                                adapters.data());
      std::vector<StTensorOut> tensors;
      for (const PeftTensor& p : peft)
        tensors.push_back({p.name, StDType::kF32, p.shape, nullptr, p.values.data()});
      write_safetensors((tmp / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
      {
        std::ofstream f(tmp / "adapter_config.json", std::ios::binary | std::ios::trunc);
        f << adapter_config_json(*cm.lora, lora_base_path(cm)).dump(2) << "\n";
        f.close();
        if (!f) fail_user("cannot write {}", (tmp / "adapter_config.json").string());
      }
      install_export_dir(tmp, o.out_dir);
      summary = fmt::format(
          "exported {} (step {}) to {}: LoRA adapters for peft (adapter_model.safetensors, {} fp32 "
          "tensors; adapter_config.json: r {}, lora_alpha {}, targets {}); base {}",
          o.checkpoint, cm.step, o.out_dir, layout.params().size(), cm.lora->config.r,
          cm.lora->config.alpha, cm.lora->config.targets, cm.lora->base.describe());
    } catch (const UserError& e) {
      err = e.what();
    } catch (const fs::filesystem_error& e) {
      err = fmt::format("export to {}: {}", o.out_dir, e.what());
    }
    if (!err.empty()) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
  }
  agree(*world, err);
  return summary;
}

}  // namespace qt::hf
