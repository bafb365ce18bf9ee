// The input deck: an INI file plus `--section.key=value` overrides, read into a validated Deck.
//
// Boost.Program_options reads both sources into one variables_map, the command line stored
// first so that it wins. Program_options reports no line numbers, so ini::scan maps every file
// key to its line and every error can say file:line (or "(command line)"). Every key lives in
// ONE table (config/key_table.cpp) that drives parsing, --help, the resolved deck and the docs test.
#include "qtrain/deck.h"

#include "parallel/pipeline_schedule.h"

#include <boost/program_options.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <variant>

#include "config/deck_builder.h"
#include "config/deck_keys.h"
#include "config/field_text.h"
#include "config/ini_lines.h"
#include "config/key_table.h"
#include "config/suggest.h"
#include "hf/config.h"
#include "parallel/context_parallel.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/error.h"

namespace qt {

namespace deck_build {

namespace po = boost::program_options;
using namespace config;  // the key table and the value lists

// model.init: the directory's config.json defines the model. Every architecture key that the
// deck sets, itself or through model.preset, must agree with it (a contradiction names both);
// model.initializer_range, unused when weights are loaded, and model.router_aux_loss_coef, the
// objective's (docs/moe.md: 0 is transformers' default objective), may differ when given. The
// other Qwen3-MoE keys are compared only for a Qwen3-MoE config.json (a dense one has none).
void Builder::resolve_init(bool preset_given) {
  const std::string dir = deck_.model_init;
  if (dir.empty()) return;
  std::error_code ec;
  need(std::filesystem::exists(dir, ec), "model.init", ": no such directory");
  need(std::filesystem::is_directory(dir, ec), "model.init",
       ": not a directory (expected a Hugging Face model directory)");
  ModelConfig hf;
  try {
    hf = hf::read_config(dir);
  } catch (const UserError& e) {
    fail_user("{}{}: {}", at("model.init"), kv("model.init"), e.what());
  }
  Deck from_hf;
  from_hf.model = hf;
  const std::string config = (std::filesystem::path(dir) / "config.json").string();
  for (const hf::ConfigKey& k : hf::config_keys()) {
    if (!preset_given && !given(k.deck)) continue;
    if ((k.moe && !hf.is_moe()) || (k.objective && given(k.deck))) continue;
    const std::string mine = format_value(find_spec(k.deck)->field(deck_));
    const std::string theirs = format_value(find_spec(k.deck)->field(from_hf));
    need(mine == theirs, k.deck,
         "contradicts {}: {} = {}; model.init defines the model, so leave {} out of the deck or "
         "make it agree",
         config, k.hf, theirs, k.deck);
  }
  // RoPE scaling may be set over config.json's (e.g. YaRN for a longer context than the
  // pretrained one): any model.rope_* key given replaces all of config.json's.
  bool rope_given = false;
  for (const char* k : {"model.rope_type", "model.rope_factor",
                        "model.rope_original_max_position_embeddings", "model.rope_attention_factor",
                        "model.rope_beta_fast", "model.rope_beta_slow"})
    rope_given = rope_given || given(k);
  if (rope_given) {
    hf.rope_type = deck_.model.rope_type;
    hf.rope_factor = deck_.model.rope_factor;
    hf.rope_original_max_position_embeddings = deck_.model.rope_original_max_position_embeddings;
    hf.rope_attention_factor = deck_.model.rope_attention_factor;
    hf.rope_beta_fast = deck_.model.rope_beta_fast;
    hf.rope_beta_slow = deck_.model.rope_beta_slow;
  }
  hf.preset = preset_given ? deck_.model.preset : "";
  if (given("model.initializer_range")) hf.initializer_range = deck_.model.initializer_range;
  if (given("model.router_aux_loss_coef")) hf.router_aux_loss_coef = deck_.model.router_aux_loss_coef;
  hf.router_bias_update_rate = deck_.model.router_bias_update_rate;  // training settings
  hf.moe_capacity_factor = deck_.model.moe_capacity_factor;
  deck_.model = hf;
  init_resolved_ = true;
}

void Builder::validate_model() {
  for (const char* k : {"model.vocab_size", "model.hidden_size", "model.intermediate_size",
                        "model.num_layers", "model.num_heads", "model.num_kv_heads",
                        "model.head_dim", "model.max_position_embeddings"}) {
    need(ival(k) >= 1, k, "must be >= 1");
  }
  need(ival("model.head_dim") % 2 == 0, "model.head_dim", "must be even (RoPE rotates halves)");
  need(ival("model.num_heads") % ival("model.num_kv_heads") == 0, "model.num_heads",
       "is not a multiple of model.num_kv_heads = {}", ival("model.num_kv_heads"));
  // Widths are ints in the engine: num_heads x head_dim must be one.
  const std::int64_t q_dim = std::int64_t{ival("model.num_heads")} * ival("model.head_dim");
  need(q_dim <= std::numeric_limits<int>::max(), "model.num_heads",
       "x model.head_dim = {} is too large (at most {})", q_dim, std::numeric_limits<int>::max());
  for (const char* k : {"model.rope_theta", "model.rms_norm_eps", "model.initializer_range"}) {
    need(dval(k) > 0, k, "must be > 0");
  }
  // RoPE scaling: the yarn keys only with model.rope_type = yarn, each in range.
  const ModelConfig& m = deck_.model;
  need(m.rope_type == "default" || m.rope_type == "yarn", "model.rope_type",
       "must be default or yarn");
  if (!m.is_yarn()) {
    const ModelConfig plain;
    for (const auto& [k, set] :
         {std::pair{"model.rope_factor", m.rope_factor != plain.rope_factor},
          std::pair{"model.rope_original_max_position_embeddings",
                    m.rope_original_max_position_embeddings != 0},
          std::pair{"model.rope_attention_factor", m.rope_attention_factor != 0},
          std::pair{"model.rope_beta_fast", m.rope_beta_fast != plain.rope_beta_fast},
          std::pair{"model.rope_beta_slow", m.rope_beta_slow != plain.rope_beta_slow}})
      need(!set, k, "applies to model.rope_type = yarn only");
    return;
  }
  for (const char* k : {"model.rope_factor", "model.rope_beta_fast", "model.rope_beta_slow"})
    need(dval(k) > 0 && std::isfinite(dval(k)), k, "must be a finite number > 0");
  need(m.rope_original_max_position_embeddings >= 1, "model.rope_original_max_position_embeddings",
       "must be >= 1 with model.rope_type = yarn (the context the model was pretrained for)");
  need(m.rope_attention_factor >= 0 && std::isfinite(m.rope_attention_factor),
       "model.rope_attention_factor", "must be a finite number >= 0 (0: 0.1 ln(factor) + 1)");
}

void Builder::validate_mesh() {
  MeshShape& m = deck_.mesh;
  need(m.dp >= 0, "mesh.dp", "must be >= 1, or 0 for auto");
  for (const char* k : {"mesh.tp", "mesh.pp", "mesh.ep", "mesh.cp"})
    need(ival(k) >= 1, k, "must be >= 1");
  if (m.tp > 1) {  // tensor parallelism (parallel/tensor_parallel.h): heads and MLP columns split
    for (const char* k : {"model.num_heads", "model.intermediate_size", "model.vocab_size"})
      need(ival(k) % m.tp == 0, "mesh.tp", "does not divide {} = {} (each tp rank takes an equal "
           "share)", k, ival(k));
    // Fewer kv heads than tp ranks: each kv head on tp / num_kv_heads ranks (Megatron's way).
    const int kv = ival("model.num_kv_heads");
    need(tp_fits_kv_heads(kv, m.tp), "mesh.tp", "neither divides nor is a multiple of "
         "model.num_kv_heads = {} (each tp rank takes an equal share of the key/value heads, or "
         "tp / num_kv_heads ranks share one)", kv);
  }
  if (m.pp > 1) {  // pipeline parallelism (train/backend_cpu_pipeline.cpp): layers over stages
    need(m.pp <= ival("model.num_layers"), "mesh.pp",
         "is more than model.num_layers = {} (each stage runs at least one layer)",
         ival("model.num_layers"));
    need(m.pp * m.pp_chunks <= ival("model.num_layers"), "mesh.pp_chunks",
         "x mesh.pp = {} chunks is more than model.num_layers = {} (each chunk runs at least one "
         "layer)", m.pp * m.pp_chunks, ival("model.num_layers"));
  }
  need(m.pp_schedule == "1f1b" || m.pp_schedule == "zb-h1", "mesh.pp_schedule",
       "must be 1f1b or zb-h1");
  need(m.pp_chunks >= 1, "mesh.pp_chunks", "must be >= 1");
  if (!m.pp_layers.empty()) {
    need(m.pp > 1, "mesh.pp_layers", "splits a pipeline: needs mesh.pp > 1");
    try {
      layer_bounds_from_counts(m.pp_layers, m.pp * m.pp_chunks, ival("model.num_layers"));
    } catch (const std::invalid_argument& e) {
      need(false, "mesh.pp_layers", "{} (one count for each of mesh.pp x mesh.pp_chunks = {} "
           "chunks, summing to model.num_layers)", e.what(), m.pp * m.pp_chunks);
    }
  }
  need(m.pp_chunks == 1 || m.pp > 1, "mesh.pp_chunks", "> 1 interleaves a pipeline: needs mesh.pp > 1");
  if (m.pp_schedule == "zb-h1") {  // the weight halves read the layers' activations later
    need(!deck_.train.recompute, "mesh.pp_schedule",
         "keeps each layer's activations until its weight gradients: not with "
         "train.recompute = true");
  }
  validate_context_parallel();
  const int others = m.tp * m.pp * m.cp;  // the ranks of one dp index
  if (m.dp == 0) {
    need(world_ % others == 0, "mesh.dp",
         "means auto, which needs the world size {} to be a multiple of mesh.tp x mesh.pp x "
         "mesh.cp = {}", world_, others);
    m.dp = world_ / others;
    dp_auto_ = true;
  }
  need(m.world() == world_, "mesh.dp",
       "does not fit the world: mesh.dp x mesh.cp x mesh.tp x mesh.pp = {} x {} x {} x {} = {}, "
       "but {} MPI ranks run",
       m.dp, m.cp, m.tp, m.pp, m.world(), world_);
  need(m.dp % m.ep == 0, "mesh.ep", "does not divide mesh.dp = {}", m.dp);
  if (m.pp > 1 && deck_.train.device == "cuda") {  // cuda/backend_cuda_pipeline.cpp
    need(m.dp == 1 || deck_.optim.zero_stage <= 1, "mesh.pp",
         ": pipeline parallelism on train.device = cuda with mesh.dp = {} runs optim.zero_stage "
         "0 or 1 so far (optim.zero_stage = {}); use ZeRO-1, mesh.dp = 1 or train.device = cpu",
         m.dp, deck_.optim.zero_stage);
  }
  need(m.ep == 1 || deck_.model.is_moe(), "mesh.ep",
       "> 1 splits a Qwen3-MoE model's experts (model.num_experts > 0); this model is dense: set "
       "mesh.ep = 1");
}

// Context parallelism (parallel/context_parallel.h) runs so far on the CPU with a dense model,
// alone and with dp (any ZeRO stage), tp (with or without sequence parallelism), pp (every
// schedule) and [lora] (not in a pipeline); every other combination is refused by name.
void Builder::validate_context_parallel() {
  const MeshShape& m = deck_.mesh;
  if (m.cp <= 1) return;
  const auto not_yet = [&](bool ok, const char* what) {
    need(ok, "mesh.cp", ": context parallelism with {} is not supported yet (it runs on "
         "train.device = cpu with a dense model, alone or with mesh.dp, mesh.tp, mesh.pp and "
         "[lora])",
         what);
  };
  not_yet(deck_.train.device != "cuda", "train.device = cuda");
  not_yet(m.ep == 1, "mesh.ep > 1");
  not_yet(!deck_.model.is_moe(), "a Qwen3-MoE model (model.num_experts > 0)");
  not_yet(deck_.lora.r == 0 || m.pp == 1, "[lora] and mesh.pp > 1");
  // 2 cp chunks of every sequence, none empty.
  need(deck_.train.seq_len >= 2 * m.cp, "mesh.cp",
       "cuts each sequence into 2 x mesh.cp = {} chunks, more than train.seq_len = {} tokens",
       2 * m.cp, deck_.train.seq_len);
}

void Builder::validate_train_optim() {
  TrainConfig& t = deck_.train;
  for (const char* k : {"train.seq_len", "train.micro_batch", "train.global_batch",
                        "train.steps"}) {
    need(ival(k) >= 1, k, "must be >= 1");
  }
  need(t.stop_at >= 0, "train.stop_at", "must be >= 0 (0 = run to train.steps)");
  need(t.stop_at <= t.steps, "train.stop_at", "is beyond train.steps = {}", t.steps);
  need(t.max_consecutive_skips >= 1, "train.max_consecutive_skips",
       "must be >= 1 (1: stop at the first non-finite step, which is not applied)");
  need(t.loss_spike_factor == 0 || (t.loss_spike_factor > 1 && std::isfinite(t.loss_spike_factor)),
       "train.loss_spike_factor", "must be 0 (off) or a finite number > 1");
  const long long per_step = static_cast<long long>(t.micro_batch) * deck_.mesh.dp;
  need(t.global_batch % per_step == 0, "train.global_batch",
       "must be a multiple of train.micro_batch ({}) x mesh.dp ({}) = {}", t.micro_batch,
       deck_.mesh.dp, per_step);
  if (deck_.mesh.pp_chunks > 1 && t.global_batch % per_step == 0)
    need((t.global_batch / per_step) % deck_.mesh.pp == 0, "train.global_batch",
         "gives {} micro-batches a step; interleaved 1F1B (mesh.pp_chunks > 1) needs a multiple of "
         "mesh.pp = {}", t.global_batch / per_step, deck_.mesh.pp);
  need(t.seq_len <= deck_.model.max_position_embeddings, "train.seq_len",
       "exceeds model.max_position_embeddings = {}", deck_.model.max_position_embeddings);
  const std::int64_t tokens = std::int64_t{t.micro_batch} * t.seq_len;  // rows of a micro-batch
  need(tokens <= std::numeric_limits<int>::max(), "train.micro_batch",
       "x train.seq_len = {} tokens is too many for one micro-batch (at most {})", tokens,
       std::numeric_limits<int>::max());
  // Sequence parallelism splits the rows of a micro-batch evenly over tp.
  if (deck_.mesh.sequence_parallel && deck_.mesh.tp > 1)
    need(tokens % deck_.mesh.tp == 0, "mesh.sequence_parallel",
         "splits the train.micro_batch x train.seq_len = {} x {} = {} rows of a micro-batch over "
         "mesh.tp = {} ranks, which does not divide them", t.micro_batch, t.seq_len, tokens,
         deck_.mesh.tp);
  // With mesh.cp too, the rows of each cp rank's share of the sequences (ContextSplit).
  if (deck_.mesh.sequence_parallel && deck_.mesh.tp > 1 && deck_.mesh.cp > 1 &&
      t.seq_len >= 2 * deck_.mesh.cp) {
    const ContextSplit split(t.seq_len, deck_.mesh.cp);
    for (int r = 0; r < deck_.mesh.cp; ++r)
      need(std::int64_t{t.micro_batch} * split.local_len(r) % deck_.mesh.tp == 0,
           "mesh.sequence_parallel",
           "splits each cp rank's rows over mesh.tp = {} ranks, but cp rank {} of mesh.cp = {} "
           "holds train.micro_batch x {} = {} rows ({} of the train.seq_len = {} tokens of each "
           "sequence), which {} does not divide", deck_.mesh.tp, r, deck_.mesh.cp,
           split.local_len(r), std::int64_t{t.micro_batch} * split.local_len(r),
           split.local_len(r), t.seq_len, deck_.mesh.tp);
  }
  // The CUDA kernels are compiled for these head widths (src/ops/cuda/attention_mma.cuh).
  need(t.device != "cuda" || deck_.model.head_dim == 64 || deck_.model.head_dim == 128,
       "model.head_dim", "is not supported by train.device = cuda, whose attention kernels "
       "handle head_dim 64 and 128; use train.device = cpu or another model");

  OptimConfig& o = deck_.optim;
  need(o.lr > 0, "optim.lr", "must be > 0");
  need(o.min_lr >= 0, "optim.min_lr", "must be >= 0");
  need(o.min_lr <= o.lr, "optim.min_lr", "must not exceed optim.lr = {}", o.lr);
  need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0");
  for (const char* k : {"optim.beta1", "optim.beta2"}) {
    need(dval(k) >= 0 && dval(k) < 1, k, "must be in [0, 1)");
  }
  need(o.eps > 0, "optim.eps", "must be > 0");
  need(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0");
  need(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)");
  need(o.zero_stage >= 0 && o.zero_stage <= 3, "optim.zero_stage", "must be 0, 1, 2 or 3");
  need(o.offload == "none" || o.offload == "cpu", "optim.offload", "must be none or cpu");
  // Not built yet: sharding a LoRA run's frozen base; offload beside a whole optimizer state.
  need(o.offload == "none" || deck_.train.device != "cuda" || o.zero_stage >= 2, "optim.offload",
       "on train.device = cuda needs optim.zero_stage = 2 or 3 (on one GPU they are the "
       "same)");
  need(o.grad_reduce == "fp32" || o.zero_stage <= 1, "optim.grad_reduce",
       "is not available with optim.zero_stage = 2 or 3 yet (their reduce-scatters are "
       "fp32)");
  need(o.offload == "none" || deck_.lora.r == 0, "optim.offload",
       "is not available with [lora] (its adapters' state is small)");
  need(o.zero_stage <= 1 || deck_.lora.r == 0, "optim.zero_stage",
       "{} shards the whole model's training state; a LoRA run trains only its adapters: use 0 "
       "or 1 with [lora]",
       o.zero_stage);
  need(o.grad_reduce == "fp32" || o.grad_reduce == "bf16", "optim.grad_reduce",
       "must be fp32 or bf16");
  need(o.grad_reduce == "fp32" || deck_.train.device == "cuda", "optim.grad_reduce",
       "bf16 needs train.device = cuda (the cpu reference reduces in fp32)");
  need(o.reduce_bucket_mb > 0, "optim.reduce_bucket_mb", "must be > 0");
}

// What is wrong with `path` as a file to read, or "" when it is a readable regular file.
std::string file_problem(const std::string& path) {
  std::error_code ec;
  auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) return "no such file";
  if (std::filesystem::is_directory(st)) return "is a directory, not a file";
  if (!std::filesystem::is_regular_file(st)) return "is not a regular file";
  std::ifstream in(path, std::ios::binary);
  if (!in) return "cannot be opened for reading";
  return "";
}

void Builder::validate_data_checkpoint_log() {
  DataConfig& d = deck_.data;
  need(std::find(kDevices.begin(), kDevices.end(), deck_.train.device) != kDevices.end(),
       "train.device", "is not a back end: {}", join(kDevices, " | "));
  need(std::find(kDataSources.begin(), kDataSources.end(), d.source) != kDataSources.end(),
       "data.source", "is not a data source: {}", join(kDataSources, " | "));
  need(d.synthetic_branching >= 1, "data.synthetic_branching", "must be >= 1");
  need(std::find(kPackings.begin(), kPackings.end(), d.packing) != kPackings.end(),
       "data.packing", "is not a packing mode: {}", join(kPackings, " | "));
  need(d.packing == "concat" || d.source == "file", "data.packing",
       "needs data.source = file (the synthetic source has no documents); use concat");
  if (d.source == "synthetic") {
    need(d.synthetic_branching <= deck_.model.vocab_size, "data.synthetic_branching",
         "exceeds model.vocab_size = {}", deck_.model.vocab_size);
  } else {
    if (d.path.empty()) {
      fail_user("{}data.path is not set; data.source = file needs a token file (docs/data.md)",
                at("data.path"));
    }
    std::string why = file_problem(d.path);
    need(why.empty(), "data.path", ": {}", why);
  }

  CheckpointConfig& c = deck_.checkpoint;
  need(!c.dir.empty(), "checkpoint.dir", "must not be empty");
  need(c.every >= -1, "checkpoint.every", "must be >= -1 (0 = only at the end, -1 = never)");
  need(c.keep >= 1, "checkpoint.keep", "must be >= 1");
  if (c.resume != "auto" && c.resume != "none") {
    std::string why = file_problem(c.resume);
    need(why.empty(), "checkpoint.resume",
         ": {}; expected auto, none or the path of a checkpoint file", why);
  }

  need(deck_.log.every >= 1, "log.every", "must be >= 1");
  need(deck_.log.tensorboard.empty() || deck_.log.tensorboard != deck_.log.metrics,
       "log.tensorboard", "is also log.metrics; name a directory for the event files and a file "
       "for the JSON lines");
}

void Builder::validate_topology() {
  need(deck_.topology.gpus_per_host >= 1, "topology.gpus_per_host", "must be >= 1");
  for (const char* k : {"topology.intra_host_gbps", "topology.inter_host_gbps"})
    need(dval(k) > 0 && dval(k) < 1e6, k, "must be a bandwidth in GB/s, > 0 and below 1e6");
}

void Builder::validate() {
  validate_model();
  validate_mesh();
  validate_train_optim();
  validate_lora();
  validate_data_checkpoint_log();
  validate_topology();
  validate_eval();
  validate_precision();
  validate_moe();
}

std::string resolved_text(Deck& d, int world) {
  std::string out = fmt::format(
      "# qtrain resolved deck: every key with its final value ({} MPI ranks{}{})\n", world,
      d.path.empty() ? "" : ", from ", d.path);
  std::string section;
  for (const KeySpec& s : key_table()) {
    std::string sec = s.key.substr(0, s.key.find('.'));
    if (sec != section) {
      out += fmt::format("{}[{}]\n", section.empty() ? "" : "\n", sec);
      section = sec;
    }
    std::string value = format_value(s.field(d));
    // model.init absolute, so that the record (and a checkpoint's base) is found from any working
    // directory; the path as given follows as a comment (unless the working directory's name
    // holds what would break the line).
    if (s.key == "model.init" && !value.empty()) {
      const std::string abs = LoraBase::of(value, 0).init_abs;
      if (abs != value && abs.find_first_of("#\n\r") == std::string::npos)
        value = abs + "  # given as " + value;
    }
    out += fmt::format("{} = {}\n", s.key.substr(sec.size() + 1), value);
  }
  return out;
}

}  // namespace deck_build

using deck_build::Builder;
using deck_build::Origin;
using deck_build::file_problem;
using deck_build::resolved_text;
using namespace config;  // the key table and the value lists
namespace po = boost::program_options;

std::vector<std::string> split_eval_paths(const std::string& paths) {
  std::vector<std::string> out;
  if (ini::trim(paths).empty()) return out;
  std::size_t at = 0;
  for (;;) {
    const std::size_t comma = paths.find(',', at);
    out.push_back(ini::trim(paths.substr(at, comma == std::string::npos ? comma : comma - at)));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::kCosine: return "cosine";
    case Schedule::kLinear: return "linear";
    case Schedule::kConstant: return "constant";
  }
  return "?";
}

Deck parse_deck_text(const std::string& text, const std::string& path,
                     const std::vector<std::string>& overrides, int world_size) {
  if (world_size < 1) fail_user("world size {} must be >= 1", world_size);
  const std::vector<std::string> keys = all_keys();
  const std::string file = path.empty() ? std::string("(deck)") : path;
  Builder b(path, world_size);
  // A UTF-8 byte-order mark (Windows editors write one) is not part of the first line.
  const std::string_view bom = "\xEF\xBB\xBF";
  const std::string body = text.starts_with(bom) ? text.substr(bom.size()) : text;

  // Command line: "--section.key=value" (the leading "--" is optional here).
  std::map<std::string, std::string> cmdline;
  std::vector<std::string> args;
  for (const std::string& o : overrides) {
    std::string s = o.rfind("--", 0) == 0 ? o.substr(2) : o;
    std::size_t eq = s.find('=');
    if (eq == std::string::npos) {
      fail_user("(command line): '{}' has no value; write --section.key=value", o);
    }
    std::string key = ini::trim(s.substr(0, eq));
    std::string value = ini::trim(s.substr(eq + 1));
    if (!find_spec(key)) {
      fail_user("(command line): unknown key {}{}", key, suggestion(key, keys));
    }
    if (!cmdline.emplace(key, value).second) {
      fail_user("(command line): {} is given twice", key);
    }
    // Program_options refuses "--key=" (empty value) but takes "--key" "".
    if (value.empty()) {
      args.insert(args.end(), {"--" + key, ""});
    } else {
      args.push_back("--" + key + "=" + value);
    }
    b.set_origin(key, {Origin::Kind::kCommandLine, 0});
  }

  // File: syntax, sections and keys checked here, with lines; the first bad line is reported.
  ini::Scan scan = ini::scan(body, file);
  int bad_line = 0;
  std::string bad;
  for (const ini::Section& s : scan.sections) {
    if (std::find(kSections.begin(), kSections.end(), s.name) == kSections.end()) {
      std::vector<std::string> known;
      for (const std::string& k : kSections) known.push_back("[" + k + "]");
      bad_line = s.line;
      bad = fmt::format("unknown section [{}]{}; sections are {}", s.name,
                        suggestion("[" + s.name + "]", known), join(known, ", "));
      break;
    }
  }
  for (const ini::Entry& e : scan.entries) {
    if (bad_line && e.line > bad_line) break;
    if (!find_spec(e.key)) {
      bad_line = e.line;
      bad = fmt::format("unknown key {}{}; `qtrain --help` lists every key", e.key,
                        suggestion(e.key, keys));
      break;
    }
    if (!cmdline.count(e.key)) b.set_origin(e.key, {Origin::Kind::kFile, e.line});
  }
  if (bad_line) fail_user("{}:{}: {}", file, bad_line, bad);

  // Program_options: one description per section; the command line is stored first and wins.
  std::vector<std::unique_ptr<po::options_description>> sections;
  po::options_description all("qtrain deck");
  for (const std::string& sec : kSections) {
    sections.push_back(std::make_unique<po::options_description>("[" + sec + "]"));
    for (const KeySpec& s : key_table()) {
      if (s.key.rfind(sec + ".", 0) == 0) {
        sections.back()->add_options()(s.key.c_str(), po::value<std::string>(), s.meaning.c_str());
      }
    }
    all.add(*sections.back());
  }
  po::variables_map vm;
  try {
    namespace style = po::command_line_style;
    po::store(po::command_line_parser(args)
                  .options(all)
                  .style(style::default_style & ~style::allow_guessing)
                  .run(),
              vm);
  } catch (const po::error& e) {
    fail_user("(command line): {}", e.what());
  }
  try {
    std::istringstream cleaned(scan.cleaned);
    po::store(po::parse_config_file(cleaned, all, /*allow_unregistered=*/false), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    fail_user("{}: {}", file, e.what());
  }

  // Values: the preset first, then every other key overrides. An empty preset means none, which
  // only model.init allows (the resolved deck of such a run says `preset =`).
  Deck& d = b.deck();
  const bool init_given = vm.count("model.init") && !vm["model.init"].as<std::string>().empty();
  bool preset_given = false;
  if (vm.count("model.preset") && !(init_given && vm["model.preset"].as<std::string>().empty())) {
    std::string name = vm["model.preset"].as<std::string>();
    preset_given = true;
    auto preset = model_preset(name);
    if (!preset) {
      fail_user("{}model.preset = {} is not a preset{}; presets: {}", b.at("model.preset"), name,
                suggestion(name, model_preset_names()), join(model_preset_names(), " | "));
    }
    d.model = *preset;
  }
  for (const KeySpec& s : key_table()) {
    if (s.key == "model.preset" || !vm.count(s.key)) continue;
    const std::string raw = vm[s.key].as<std::string>();
    assign_value(s.field(d), raw, b.at(s.key) + s.key + " = " + raw);
  }

  b.resolve_init(preset_given);
  b.validate();
  d.resolved = resolved_text(d, world_size);
  return d;
}

Deck parse_deck(int argc, const char* const* argv, int world_size) {
  std::vector<std::string> overrides, positional;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      overrides.push_back(a);
    } else if (a.size() > 1 && a[0] == '-') {
      fail_user("(command line): unknown option {}; settings are --section.key=value", a);
    } else {
      positional.push_back(a);
    }
  }
  if (positional.empty()) {
    fail_user("(command line): no deck file given; usage: qtrain [--section.key=value ...] deck.ini");
  }
  if (positional.size() > 1) {
    fail_user("(command line): expected one deck file, got {}: {}", positional.size(),
              join(positional, " "));
  }
  const std::string& path = positional.front();
  if (std::string why = file_problem(path); !why.empty()) {
    fail_user("deck file {}: {}", path, why);
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) fail_user("deck file {}: read error", path);
  return parse_deck_text(text.str(), path, overrides, world_size);
}

}  // namespace qt
