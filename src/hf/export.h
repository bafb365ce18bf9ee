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

namespace qt {

// The sub-command. argv[0] is "export"; then <checkpoint.h5> <dir> [--tokenizer DIR]
// [--max-shard-size SIZE] [--force] [--merge] [--help], options also as --key=value. Collective over
// `world`. Returns the exit code: 0, or 2 after a UserError (printed once by rank 0).
int export_main(int argc, char** argv, std::shared_ptr<MpiComm> world);

namespace hf {

struct ExportOptions {
  std::string checkpoint;     // a qtrain checkpoint file
  std::string out_dir;        // the model directory to write
  std::string tokenizer_dir;  // tokenizer files to copy; empty = the checkpoint's model.init
  std::uint64_t max_shard_bytes = 5'000'000'000;  // like transformers' default "5GB"
  bool force = false;         // replace a non-empty out_dir
  bool merge = false;         // LoRA checkpoint: the base with the adapters merged, not adapters
};

// Collective over `world`: reads and validates the checkpoint (every rank), rank 0 writes.
// Throws UserError on every rank alike. Returns a summary line.
std::string export_checkpoint(const ExportOptions& o, std::shared_ptr<MpiComm> world);

// Writes the model files (config.json, generation_config.json unless `generation_config` is
// empty, the safetensors shards and, for more than one shard, the index) into the existing
// directory `dir`. Serial. Returns the names of the weight files.
std::vector<std::string> write_model_dir(const std::string& dir, const ModelConfig& cfg,
                                         const ParamLayout& layout, const float* params,
                                         std::uint64_t max_shard_bytes, const ConfigExtras& extras,
                                         const std::string& generation_config);

// What a checkpoint says about its model: the root attributes and the [model] keys of its deck.
struct CheckpointModel {
  ModelConfig cfg;
  std::int64_t step = 0;
  std::string init_dir;  // [model] init of the run's deck, "" when none
  std::optional<LoraCheckpointInfo> lora;  // a LoRA run's checkpoint: adapters, not the model
};

// Serial (any one rank): the model of checkpoint `path`, without reading its tensors. UserError
// when it is missing or not a qtrain checkpoint.
CheckpointModel read_checkpoint_model(const std::string& path);

// "5GB" (10^9), "500MB", "2GiB" (2^30), "1024" (bytes), ...; UserError when malformed.
std::uint64_t parse_size(const std::string& text);

// The tokenizer files copied on export, when present.
const std::vector<std::string>& tokenizer_file_names();

}  // namespace hf
}  // namespace qt
