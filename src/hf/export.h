// `qtrain export <checkpoint.h5> <dir>`: a qtrain checkpoint as a Hugging Face model directory
// that transformers' from_pretrained loads (docs/finetune.md):
//   config.json, generation_config.json,
//   model.safetensors (one shard) or model-0000i-of-0000n.safetensors + model.safetensors.index.json,
//   weights in bf16 (round to nearest even, as torch's .to(torch.bfloat16)),
//   the tokenizer files of --tokenizer DIR, or of the checkpoint's model.init directory.
// The directory is written under a temporary name beside it and renamed when complete.
// A LoRA run's checkpoint exports as PEFT's adapter directory (hf/lora_export.h), or with --merge
// as the model directory above with W + scale * B A.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hf/config.h"
#include "qtrain/comm.h"
#include "qtrain/lora.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "runtime/memory.h"

namespace qt {

// The sub-command. argv[0] is "export"; then <checkpoint.h5> <dir> [--tokenizer DIR]
// [--base DIR] [--max-shard-size SIZE] [--force] [--merge] [--help], options also as
// --key=value. Collective over `world`. Returns the exit code: 0, or 2 after a UserError (printed
// once by rank 0).
int export_main(int argc, char** argv, std::shared_ptr<MpiComm> world);

namespace hf {

struct ExportOptions {
  std::string checkpoint;     // a qtrain checkpoint file
  std::string out_dir;        // the model directory to write
  std::string tokenizer_dir;  // tokenizer files to copy; empty = the checkpoint's model.init
  std::string base_dir;       // --base: where the checkpoint's model.init directory is now
  std::uint64_t max_shard_bytes = 5'000'000'000;  // like transformers' default "5GB"
  bool force = false;         // replace a non-empty out_dir
  bool merge = false;         // LoRA checkpoint: the base with the adapters merged, not adapters
};

// Collective over `world`: reads and validates the checkpoint (every rank), rank 0 writes.
// Throws UserError on every rank alike. Returns a summary line.
std::string export_checkpoint(const ExportOptions& o, std::shared_ptr<MpiComm> world);

// Writes the model files (config.json, generation_config.json unless `generation_config` is
// empty, the safetensors shards and, for more than one shard, the index) into the existing
// directory `dir`; a Qwen3-MoE layer's experts per expert, as checkpoints name them
// (hf/moe_weights.h). Serial. Returns the names of the weight files.
std::vector<std::string> write_model_dir(const std::string& dir, const ModelConfig& cfg,
                                         const ParamLayout& layout, const float* params,
                                         std::uint64_t max_shard_bytes, const ConfigExtras& extras,
                                         const std::string& generation_config);

// Where a checkpoint's model.init directory (a LoRA run's base, the default tokenizer) is now.
struct InitDirSearch {
  std::string dir;                 // the first candidate with config.json; "" = none found
  std::vector<std::string> tried;  // every candidate passed over, "<path> (<why>)"
};

// What a checkpoint says about its model: the root attributes and the [model] keys of its deck.
struct CheckpointModel {
  ModelConfig cfg;
  std::int64_t step = 0;
  // [model] init of the run's deck, "" when none: absolute in the resolved deck of runs since
  // the absolute path is stored, as given (relative to the run's working directory) before.
  std::string init_dir;
  std::optional<LoraCheckpointInfo> lora;  // a LoRA run's checkpoint: adapters, not the model
  InitDirSearch init_found;                // find_init_dir's answer, set by the reader's caller
};

// Serial (any one rank): the model of checkpoint `path`, without reading its tensors. UserError
// when it is missing, not a qtrain checkpoint, or its sizes are out of range (validate_model).
CheckpointModel read_checkpoint_model(const std::string& path);

// Serial: where the checkpoint's model.init directory is now. Candidates in order: `base`
// (--base; UserError when it has no config.json, or the run had no model.init), the absolute
// path stored at training time, then the path as given, relative to this working directory
// (all that older checkpoints hold). dir "" and tried empty when the run had no model.init.
InitDirSearch find_init_dir(const CheckpointModel& cm, const std::string& base);

// "a (no such directory), b (no config.json)", for messages.
std::string tried_text(const InitDirSearch& s);

// Parameters of `cfg` (ParamLayout's count) in double, so that absurd sizes cannot wrap.
double param_count(const ModelConfig& cfg);
// The host memory of the checkpoint's model as fp32 weights (`model` false: without them) and a
// LoRA checkpoint's adapters, for runtime/memory.h's checks.
HostMemoryNeed weights_memory_need(const CheckpointModel& cm, bool model = true);

// "5GB" (10^9), "500MB", "2GiB" (2^30), "1024" (bytes), ...; UserError when malformed.
std::uint64_t parse_size(const std::string& text);

// The tokenizer files copied on export, when present.
const std::vector<std::string>& tokenizer_file_names();

}  // namespace hf
}  // namespace qt
