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

nlohmann::json adapter_config_json(const LoraCheckpointInfo& lora, const std::string& base_path) {
  const LoraConfig& c = lora.config;
  nlohmann::json j;  // keys sorted, as peft's save_pretrained writes them
  std::vector<std::string> targets;
  for (int t : parse_lora_targets(c.targets, "lora.targets")) targets.push_back(kLoraTargets[t]);
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
      std::vector<StTensorOut> tensors;
      for (const ParamInfo& p : layout.params())
        tensors.push_back({p.name, StDType::kF32, p.shape, nullptr, adapters.data() + p.offset});
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
