// qtrain checkpoint -> Hugging Face model directory (see export.h, docs/finetune.md).
#include "hf/export.h"

#include <hdf5.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "config/field_text.h"
#include "config/ini_lines.h"
#include "hf/export_dir.h"
#include "hf/lora_export.h"
#include "hf/moe_weights.h"
#include "hf/safetensors.h"
#include "hf/weights.h"
#include "io/hdf5_util.h"
#include "io/json_file.h"
#include "model/lora.h"
#include "qtrain/checkpoint.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"

namespace qt {

namespace fs = std::filesystem;

namespace hf {

namespace {

constexpr const char* kUsage =
    "usage: qtrain export <checkpoint.h5> <dir> [--merge] [--base DIR] [--tokenizer DIR]\n"
    "                     [--max-shard-size SIZE] [--force]\n"
    "  Writes <dir> as a Hugging Face model directory (config.json, generation_config.json,\n"
    "  bf16 safetensors shards with model.safetensors.index.json, tokenizer files).\n"
    "  --tokenizer DIR        copy tokenizer.json, tokenizer_config.json, vocab.json, merges.txt\n"
    "                         ... from DIR (default: the checkpoint's model.init directory)\n"
    "  --base DIR             where the run's model.init directory (a LoRA run's base) is now,\n"
    "                         if it moved (default: its absolute path, then the path as given)\n"
    "  --max-shard-size SIZE  largest safetensors shard, e.g. 5GB (default), 500MB, 2GiB\n"
    "  --force                replace <dir> when it exists and is not empty (never a directory\n"
    "                         that holds the checkpoint, model.init, the tokenizer, an HDF5 file,\n"
    "                         the working or home directory)\n"
    "  A LoRA run's checkpoint exports as PEFT's adapter_model.safetensors + adapter_config.json;\n"
    "  --merge                instead, the base model with the adapters merged (W + scale * B A)\n";

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) fail_user("cannot write {}", p.string());
}

}  // namespace

CheckpointModel read_checkpoint_model(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail_user("checkpoint {}: no such file", path);
  h5::QuietErrors quiet;
  h5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), h5::close_file);
  if (!file.valid())
    fail_user("checkpoint {}: cannot open it as HDF5 ({})", path, h5::last_error());
  auto format = h5::try_read_attr_string(file, "format");
  if (!format || *format != "qtrain-checkpoint")
    fail_user("{} is not a qtrain checkpoint (no root attribute format = \"qtrain-checkpoint\")", path);
  CheckpointModel m;
  auto i64 = [&](const char* name) {
    auto v = h5::try_read_attr_i64(file, name);
    if (!v) fail_user("checkpoint {}: root attribute {} is missing", path, name);
    // Sizes become ints: 1 .. 2^31 - 1 (the flags tie_word_embeddings and norm_topk_prob 0 too).
    const bool flag =
        std::strcmp(name, "tie_word_embeddings") == 0 || std::strcmp(name, "norm_topk_prob") == 0;
    const std::int64_t lo = flag ? 0 : 1;
    if (std::strcmp(name, "step") != 0 && (*v < lo || *v > std::numeric_limits<int>::max()))
      fail_user("checkpoint {}: root attribute {} = {} is out of range (corrupt checkpoint?)", path,
                name, *v);
    return *v;
  };
  auto f64 = [&](const char* name) {
    auto v = h5::try_read_attr_f64(file, name);
    if (!v) fail_user("checkpoint {}: root attribute {} is missing", path, name);
    return *v;
  };
  ModelConfig& c = m.cfg;
  c.preset = h5::try_read_attr_string(file, "preset").value_or("");
  c.vocab_size = static_cast<int>(i64("vocab_size"));
  c.hidden_size = static_cast<int>(i64("hidden_size"));
  c.intermediate_size = static_cast<int>(i64("intermediate_size"));
  c.num_layers = static_cast<int>(i64("num_layers"));
  c.num_heads = static_cast<int>(i64("num_heads"));
  c.num_kv_heads = static_cast<int>(i64("num_kv_heads"));
  c.head_dim = static_cast<int>(i64("head_dim"));
  c.tie_word_embeddings = i64("tie_word_embeddings") != 0;
  c.rope_theta = f64("rope_theta");
  c.rms_norm_eps = f64("rms_norm_eps");
  m.step = i64("step");
  // A Qwen3-MoE model's architecture (io/checkpoint.cpp); a dense checkpoint has no num_experts.
  if (h5::try_read_attr_i64(file, "num_experts")) {
    c.num_experts = static_cast<int>(i64("num_experts"));
    c.num_experts_per_tok = static_cast<int>(i64("num_experts_per_tok"));
    c.moe_intermediate_size = static_cast<int>(i64("moe_intermediate_size"));
    c.norm_topk_prob = i64("norm_topk_prob") != 0;
    c.decoder_sparse_step = static_cast<int>(i64("decoder_sparse_step"));
    const std::string layers = h5::try_read_attr_string(file, "mlp_only_layers").value_or("");
    c.mlp_only_layers = parse_comma_list(
        layers, fmt::format("checkpoint {}: root attribute mlp_only_layers = '{}'", path, layers));
  }
  // YaRN RoPE scaling (io/checkpoint.cpp); a checkpoint of plain RoPE has no rope_type.
  c.rope_type = h5::try_read_attr_string(file, "rope_type").value_or("default");
  if (c.is_yarn()) {
    c.rope_factor = f64("rope_factor");
    c.rope_original_max_position_embeddings =
        static_cast<int>(i64("rope_original_max_position_embeddings"));
    c.rope_attention_factor = f64("rope_attention_factor");
    c.rope_beta_fast = f64("rope_beta_fast");
    c.rope_beta_slow = f64("rope_beta_slow");
  }
  validate_model(c, fmt::format("checkpoint {}", path));
  if (h5::try_read_attr_i64(file, "lora_r")) {  // a LoRA run's checkpoint
    LoraCheckpointInfo l;
    l.config.r = static_cast<int>(i64("lora_r"));
    l.config.alpha = f64("lora_alpha");
    l.config.dropout = f64("lora_dropout");
    l.config.targets = h5::try_read_attr_string(file, "lora_targets").value_or("");
    l.base.init = h5::try_read_attr_string(file, "lora_base_init").value_or("");
    l.base.seed = h5::try_read_attr_u64(file, "lora_base_seed").value_or(0);
    l.base.init_abs = h5::try_read_attr_string(file, "lora_base_init_abs").value_or("");
    if (!(l.config.alpha > 0) || !std::isfinite(l.config.alpha))
      fail_user("checkpoint {}: lora_alpha = {} is out of range", path, l.config.alpha);
    parse_lora_targets(l.config.targets, fmt::format("checkpoint {}: lora_targets", path));
    m.lora = l;
  }
  // max_position_embeddings, initializer_range, router_aux_loss_coef and init are not root
  // attributes: the stored resolved deck has them (the struct defaults stand in when a key is
  // absent).
  const std::string deck = h5::try_read_attr_string(file, "deck").value_or("");
  ini::Scan scan;
  try {
    scan = ini::scan(deck, path + " (stored deck)");
  } catch (const UserError&) {
    return m;  // an unreadable record: keep the defaults
  }
  for (const ini::Entry& e : scan.entries) {
    if (e.key == "model.init") m.init_dir = e.value;
    int iv = 0;
    double dv = 0;
    const char* b = e.value.data();
    const char* end = b + e.value.size();
    if (e.key == "model.max_position_embeddings" && std::from_chars(b, end, iv).ec == std::errc() && iv > 0)
      c.max_position_embeddings = iv;
    if (e.key == "model.initializer_range" && std::from_chars(b, end, dv).ec == std::errc() && dv > 0)
      c.initializer_range = dv;
    if (e.key == "model.router_aux_loss_coef" && std::from_chars(b, end, dv).ec == std::errc() &&
        dv >= 0 && std::isfinite(dv))
      c.router_aux_loss_coef = dv;
  }
  return m;
}

namespace {

bool has_tokenizer(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / "tokenizer.json", ec) ||
         (fs::is_regular_file(dir / "vocab.json", ec) && fs::is_regular_file(dir / "merges.txt", ec));
}

}  // namespace

InitDirSearch find_init_dir(const CheckpointModel& cm, const std::string& base) {
  const LoraBase* lb = cm.lora ? &cm.lora->base : nullptr;
  const bool had_init = lb ? !lb->init.empty() : !cm.init_dir.empty();
  std::error_code ec;
  auto why_not = [&](const std::string& d) -> std::string {
    if (!fs::exists(d, ec)) return "no such directory";
    if (!fs::is_regular_file(fs::path(d) / "config.json", ec)) return "no config.json";
    return "";
  };
  if (!base.empty()) {
    if (!had_init)
      fail_user("--base {}: the checkpoint's run had no model.init directory ({}), so there is no "
                "base directory to replace{}",
                base, lb ? lb->describe() : "its model came from its seed or preset",
                lb ? "" : "; --tokenizer DIR names the tokenizer");
    if (const std::string why = why_not(base); !why.empty())
      fail_user("--base {}: {} (a Hugging Face model directory, where the run's model.init is now)",
                base, why);
    return {base, {}};
  }
  InitDirSearch s;
  if (!had_init) return s;
  std::vector<std::string> candidates;  // the absolute path first, then the path as given
  if (lb) candidates.push_back(lb->init_abs);
  candidates.push_back(cm.init_dir);
  if (lb) candidates.push_back(lb->init);
  std::vector<std::string> seen;
  for (const std::string& c : candidates) {
    if (c.empty() || std::find(seen.begin(), seen.end(), c) != seen.end()) continue;
    seen.push_back(c);
    const std::string why = why_not(c);
    if (why.empty()) {
      s.dir = c;
      return s;
    }
    s.tried.push_back(fmt::format("{} ({})", c, why));
  }
  return s;
}

std::string tried_text(const InitDirSearch& s) { return fmt::format("{}", fmt::join(s.tried, ", ")); }

double param_count(const ModelConfig& c) { return c.num_params_f64(); }  // dense or MoE

HostMemoryNeed weights_memory_need(const CheckpointModel& cm, bool model) {
  const double P = model ? param_count(cm.cfg) : 0;
  double adapters = 0;
  if (cm.lora) adapters = static_cast<double>(lora_layout(cm.cfg, cm.lora->config).numel());
  HostMemoryNeed need;
  need.bytes = 4 * (P + adapters);
  need.what = model ? fmt::format("fp32 weights of {:.3g} parameters{}", P,
                                  adapters > 0 ? " and their LoRA adapters" : "")
                     : fmt::format("fp32 LoRA adapters of {:.3g} parameters", adapters);
  need.keys = "the ranks per node (each holds the whole model; export needs one)";
  return need;
}

const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {
      "tokenizer.json", "tokenizer_config.json", "vocab.json",          "merges.txt",
      "special_tokens_map.json", "added_tokens.json", "chat_template.jinja"};
  return names;
}

std::uint64_t parse_size(const std::string& text) {
  std::string s;
  for (char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch))) s += ch;
  std::size_t digits = 0;
  while (digits < s.size() && (std::isdigit(static_cast<unsigned char>(s[digits])) || s[digits] == '.'))
    ++digits;
  double v = 0;
  if (digits == 0 || std::from_chars(s.data(), s.data() + digits, v).ec != std::errc())
    fail_user("--max-shard-size {}: not a size (e.g. 5GB, 500MB, 2GiB, 1048576)", text);
  std::string unit = s.substr(digits);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char ch) { return std::toupper(ch); });
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
      {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  for (const auto& [name, factor] : kUnits) {
    if (unit != name) continue;
    const double bytes = v * factor;
    if (!(bytes >= 1) || bytes > 1e18)
      fail_user("--max-shard-size {}: must be at least 1 byte", text);
    return static_cast<std::uint64_t>(bytes);
  }
  fail_user("--max-shard-size {}: unknown unit \"{}\" (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)", text,
            s.substr(digits));
}

std::vector<std::string> write_model_dir(const std::string& dir, const ModelConfig& cfg,
                                         const ParamLayout& layout, const float* params,
                                         std::uint64_t max_shard_bytes, const ConfigExtras& extras,
                                         const std::string& generation_config) {
  const fs::path d(dir);
  write_text(d / "config.json", make_config_json(cfg, extras).dump(2) + "\n");
  if (!generation_config.empty()) write_text(d / "generation_config.json", generation_config);

  // The file tensors in model order: a parameter under its own name, a Qwen3-MoE layer's fused
  // experts as the per-expert tensors that checkpoints hold (moe_weights.h), each a slice of
  // its expert's row.
  std::vector<StTensorOut> tensors;
  for (const ParamInfo& p : layout.params()) {
    const auto per_expert = expert_file_tensors(p);
    if (per_expert.empty()) {
      tensors.push_back({p.name, StDType::kBF16, p.shape, nullptr, params + p.offset});
      continue;
    }
    const float* at = params + p.offset;
    for (const auto& row : per_expert)
      for (const FileTensor& t : row) {
        tensors.push_back({t.name, StDType::kBF16, t.shape, nullptr, at});
        at += t.numel();
      }
  }
  // Shards as transformers cuts them: tensors in model order, a new shard when the next tensor
  // would push the current one past the limit (a tensor larger than the limit gets its own).
  std::vector<std::vector<const StTensorOut*>> shards(1);
  std::uint64_t cur = 0, total = 0;
  for (const StTensorOut& t : tensors) {
    const std::uint64_t b = t.bytes();
    if (!shards.back().empty() && cur + b > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(&t);
    cur += b;
    total += b;
  }
  const std::size_t n = shards.size();
  std::vector<std::string> files;
  nlohmann::json weight_map = nlohmann::json::object();
  for (std::size_t i = 0; i < n; ++i) {
    const std::string name =
        n == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
    std::vector<StTensorOut> out;
    for (const StTensorOut* t : shards[i]) {
      out.push_back(*t);
      weight_map[t->name] = name;
    }
    write_safetensors((d / name).string(), out, {{"format", "pt"}});
    files.push_back(name);
  }
  if (n > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;  // sorted by name
    write_text(d / "model.safetensors.index.json", index.dump(2) + "\n");
  }
  return files;
}

namespace {

// What an export must never delete or write into: the checkpoint, the tokenizer and base
// directories named, and every place the run's model.init may be (export_target_problem).
std::vector<std::string> export_keep_paths(const ExportOptions& o, const CheckpointModel& cm) {
  std::vector<std::string> keep = {o.checkpoint, o.tokenizer_dir, o.base_dir, cm.init_dir,
                                   cm.init_found.dir};
  if (cm.lora) keep.insert(keep.end(), {cm.lora->base.init, cm.lora->base.init_abs});
  return keep;
}

}  // namespace

std::string export_checkpoint(const ExportOptions& o, std::shared_ptr<MpiComm> world) {
  const bool root = world->rank() == 0;
  // 1. The checkpoint's model, where its model.init directory is now, and whether the target
  //    may be written: all refused before a weight is read or a file written.
  std::string err;
  CheckpointModel cm;
  try {
    cm = read_checkpoint_model(o.checkpoint);
  } catch (const UserError& e) {
    err = e.what();
  }
  agree(*world, err);
  if (root) {
    try {
      cm.init_found = find_init_dir(cm, o.base_dir);
      err = export_target_problem(o.out_dir, o.force, export_keep_paths(o, cm));
      if (err.empty() && !o.tokenizer_dir.empty() && !has_tokenizer(o.tokenizer_dir))
        err = fmt::format("--tokenizer {}: no tokenizer.json (or vocab.json and merges.txt) there",
                          o.tokenizer_dir);
    } catch (const UserError& e) {
      err = e.what();
    }
  }
  agree(*world, err);
  broadcast_string(*world, cm.init_found.dir, 0);
  if (!cm.lora && o.merge)
    fail_user("--merge: checkpoint {} is not a LoRA run's (it holds the whole model); export it "
              "without --merge",
              o.checkpoint);
  check_host_memory(*world, weights_memory_need(cm, !cm.lora || o.merge), "qtrain export");

  // 2. The weights (validated, checksummed) on every rank.
  if (cm.lora && !o.merge) return export_lora_adapters(o, cm, world);  // hf/lora_export.cpp
  ParamLayout layout(cm.cfg);
  std::vector<float> params(layout.numel());
  if (cm.lora) {
    lora_merged_params(o.checkpoint, cm, layout, params.data(), world);  // base + scale * B A
  } else {
    MeshShape shape;
    shape.dp = world->size();
    Mesh mesh(shape, world);
    float dummy = 0;
    const TrainState st = checkpoint_read(o.checkpoint, mesh, layout, params.data(),
                                          MomentShard{{0, 0}, &dummy, &dummy}, cm.cfg);
    // transformers' Qwen3-MoE routers have no bias: the export drops it (docs/moe.md).
    const bool biased = std::any_of(st.router_bias.begin(), st.router_bias.end(),
                                    [](float b) { return b != 0.0f; });
    if (root && biased)
      std::fprintf(stderr,
                   "qtrain export: warning: the checkpoint's router bias (auxiliary-loss-free "
                   "balancing) is not exported: transformers' routers choose experts by their "
                   "probabilities alone\n");
  }

  // 3. Rank 0 writes the directory under a temporary name, then renames it.
  std::string summary;
  const fs::path tmp = export_staging_dir(o.out_dir);
  if (root) {
    try {
      std::error_code ec;
      fs::remove_all(tmp, ec);  // a stale one from an interrupted export
      fs::create_directories(tmp, ec);
      if (ec) fail_user("cannot create {}: {}", tmp.string(), ec.message());
      // Where the token ids, generation config and tokenizer come from: the model.init
      // directory the run started from (where it is now) and --tokenizer.
      const fs::path init = cm.init_found.dir;
      ConfigExtras extras = default_extras(cm.cfg);
      if (!cm.init_found.tried.empty() && init.empty())
        std::fprintf(stderr,
                     "qtrain export: warning: the run's model.init directory was not found (tried "
                     "%s; --base DIR says where it is now): token ids, generation_config.json and "
                     "tokenizer files not taken from it\n",
                     tried_text(cm.init_found).c_str());
      if (!init.empty()) {
        try {
          ConfigExtras from_init;
          read_config(init.string(), &from_init);
          extras = from_init;
        } catch (const UserError& e) {
          std::fprintf(stderr, "qtrain export: warning: token ids not taken from %s: %s\n",
                       init.c_str(), e.what());
        }
      }
      std::string gen;
      for (const fs::path& src : {init, fs::path(o.tokenizer_dir)}) {
        if (gen.empty() && !src.empty() && fs::is_regular_file(src / "generation_config.json", ec))
          gen = io::read_text_file((src / "generation_config.json").string());
      }
      if (gen.empty()) {
        nlohmann::ordered_json g;
        g["_from_model_config"] = true;
        if (!extras.bos_token_id.is_null()) g["bos_token_id"] = extras.bos_token_id;
        if (!extras.eos_token_id.is_null()) g["eos_token_id"] = extras.eos_token_id;
        if (!extras.pad_token_id.is_null()) g["pad_token_id"] = extras.pad_token_id;
        gen = g.dump(2) + "\n";
      }
      const auto files = write_model_dir(tmp.string(), cm.cfg, layout, params.data(),
                                         o.max_shard_bytes, extras, gen);
      const fs::path tok = !o.tokenizer_dir.empty() ? fs::path(o.tokenizer_dir) : init;
      std::vector<std::string> copied;
      if (!tok.empty() && has_tokenizer(tok)) {
        for (const std::string& f : tokenizer_file_names()) {
          if (!fs::is_regular_file(tok / f, ec)) continue;
          fs::copy_file(tok / f, tmp / f, fs::copy_options::overwrite_existing, ec);
          if (ec) fail_user("cannot copy {} to {}: {}", (tok / f).string(), tmp.string(), ec.message());
          copied.push_back(f);
        }
      } else {
        std::fprintf(stderr, "qtrain export: warning: no tokenizer files written (pass --tokenizer "
                             "DIR, or train with model.init = an HF directory that has them)\n");
      }
      install_export_dir(tmp, o.out_dir);
      summary = fmt::format(
          "exported {} (step {}{}) to {}: {} weight file{} (bf16), tokenizer files: {}",
          o.checkpoint, cm.step, cm.lora ? ", LoRA adapters merged into the base" : "", o.out_dir,
          files.size(), files.size() == 1 ? "" : "s",
          copied.empty() ? std::string("none") : fmt::format("{}", fmt::join(copied, ", ")));
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

}  // namespace hf

int export_main(int argc, char** argv, std::shared_ptr<MpiComm> world) {
  const bool root = world->rank() == 0;
  try {
    hf::ExportOptions o;
    std::vector<std::string> positional;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        if (root) std::printf("%s", hf::kUsage);
        return 0;
      }
      if (a == "--force" || a == "--merge") {
        (a == "--force" ? o.force : o.merge) = true;
        continue;
      }
      if (a.rfind("--", 0) != 0) {
        positional.push_back(a);
        continue;
      }
      std::string key = a, value;
      if (auto eq = a.find('='); eq != std::string::npos) {
        key = a.substr(0, eq);
        value = a.substr(eq + 1);
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        fail_user("(command line): {} needs a value", a);
      }
      if (key == "--tokenizer")
        o.tokenizer_dir = value;
      else if (key == "--base")
        o.base_dir = value;
      else if (key == "--max-shard-size")
        o.max_shard_bytes = hf::parse_size(value);
      else
        fail_user("(command line): unknown option {}\n{}", key, hf::kUsage);
    }
    if (positional.size() != 2)
      fail_user("(command line): expected <checkpoint.h5> <dir>, got {} argument{}\n{}",
                positional.size(), positional.size() == 1 ? "" : "s", hf::kUsage);
    o.checkpoint = positional[0];
    o.out_dir = positional[1];
    while (o.out_dir.size() > 1 && o.out_dir.back() == '/') o.out_dir.pop_back();
    const std::string summary = hf::export_checkpoint(o, world);
    if (root) std::printf("%s\n", summary.c_str());
    return 0;
  } catch (const UserError& e) {
    if (root) std::fprintf(stderr, "qtrain export: error: %s\n", e.what());
    return kExitBadInput;
  }
}

}  // namespace qt
