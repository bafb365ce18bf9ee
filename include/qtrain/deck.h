// The input deck: every setting of a run, read from an INI file with Boost.Program_options.
// docs/decks.md documents every key; `qtrain --help` lists them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qtrain/lora.h"
#include "qtrain/mesh.h"
#include "qtrain/model_config.h"

namespace qt {

struct TrainConfig {
  int seq_len = 64;        // tokens per sequence (T)
  int micro_batch = 4;     // sequences per micro-batch per dp rank
  int global_batch = 8;    // sequences per optimizer step, over all dp ranks
  int steps = 100;         // total optimizer steps of the run (the schedule's horizon)
  int stop_at = 0;         // stop after this step (checkpointing first); 0 = run to `steps`
  std::uint64_t seed = 1234;
  bool recompute = false;  // recompute each layer's activations in backward
  std::string device = "cpu";  // back end: cpu | cuda
  // Numerical safety (docs/decks.md): a step with a non-finite loss or gradient norm updates
  // nothing and is counted; this many such steps in a row stop the run (exit 3).
  int max_consecutive_skips = 5;
  // A step whose loss exceeds this factor times the recent mean (an exponential mean over about
  // 20 steps, from the 10th step of the process) is logged as a spike; 0 = not watched.
  double loss_spike_factor = 2.0;
  // Arithmetic (docs/decks.md): "auto" (cpu: fp32; cuda: bf16) | "fp32" (cpu) | "bf16" (cuda) |
  // "fp16": gradients scaled by a loss scale (optim/loss_scaler.h) and unscaled before the
  // update; on the cpu the arithmetic stays fp32, the scaling runs as on a GPU.
  std::string precision = "auto";
  // train.precision = fp16, DeepSpeed's fp16 keys: loss_scale > 0 a static scale, 0 dynamic,
  // from 2^initial_scale_power, doubled after loss_scale_window clean steps, halved on an
  // overflow once `hysteresis` overflows are spent, never below min_loss_scale.
  double loss_scale = 0;
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;
  bool fp16() const { return precision == "fp16"; }
};

enum class Schedule { kCosine, kLinear, kConstant };

struct OptimConfig {
  double lr = 1e-3;
  double min_lr = 1e-4;
  int warmup_steps = 10;
  Schedule schedule = Schedule::kCosine;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;   // max global gradient L2 norm; 0 disables clipping
  // ZeRO over dp: 0 everything replicated; 1 AdamW moments sharded;
  // 2 also the gradients (reduce-scattered per unit during the backward); 3 also the parameters
  // (each unit all-gathered before use, freed after).
  int zero_stage = 0;
  // Where the rank's master weights and AdamW moments live: "none" (the back end's memory) or
  // "cpu" (host memory, AdamW on the host; on the cpu back end the state is there already).
  std::string offload = "none";
  // Data-parallel gradient reduction (cuda back end): the dtype on the wire ("fp32" | "bf16";
  // gradients are accumulated and stored in fp32 either way). reduce_bucket_mb: no longer used
  // (each unit is one reduction), accepted so that older decks still run.
  std::string grad_reduce = "fp32";
  double reduce_bucket_mb = 32;  // MiB (> 0)
};

struct DataConfig {
  std::string source = "synthetic";  // "synthetic" or "file"
  std::string path;                  // token file (HDF5) when source = file
  // How documents fill the windows: "concat" | "packed" | "padded" (docs/data.md, Packing);
  // packed and padded need source = file.
  std::string packing = "concat";
  // Synthetic source: a random first-order Markov chain over the model's vocabulary.
  int synthetic_branching = 4;       // successors with non-zero probability per token
};

struct CheckpointConfig {
  std::string dir = "checkpoints";
  int every = 0;                     // steps between checkpoints; 0 = only at the end; -1 = never
  int keep = 3;                      // newest complete checkpoints retained
  std::string resume = "auto";       // auto | none | <path to a checkpoint file>
};

struct LogConfig {
  int every = 1;                     // steps between log lines
  std::string metrics = "metrics.jsonl";  // JSON-lines file; empty disables
  std::string tensorboard;           // directory of TensorBoard event files; empty disables
};

// [eval]: evaluation during training (docs/monitoring.md, "Evaluation"): the loss over held-out
// token files and greedy continuations of prompts, every `every` steps and at the end.
struct EvalConfig {
  std::string paths;        // held-out token files (HDF5, as data.path), comma-separated; "" = none
  double split = 0;         // fraction of data.path's windows held out of training, in [0, 1)
  int every = 0;            // steps between evaluations of the loss; 0 = only at the end
  int max_sequences = 0;    // at most this many held-out sequences (the first of a fixed order);
                            // 0 = all
  std::string samples;      // text file of prompts, one a line; "" = no samples
  int samples_every = 0;    // steps between samples; 0 = only at the end
  int max_new_tokens = 32;  // tokens generated a prompt (greedy)
  std::string tokenizer;    // directory with tokenizer.json; "" = model.init's
  bool loss_on() const { return !paths.empty() || split > 0; }
  bool samples_on() const { return !samples.empty(); }
};

// [topology]: the machine's shape and link rates, for `qtrain plan`'s step-time prediction (and
// the start-up topology report, which prints measured values for these keys). Bandwidths are an
// all-reduce's bus bandwidth per GPU as nccl-tests reports it (busbw), in GB/s (1e9 bytes/s).
struct TopologyConfig {
  int gpus_per_host = 8;           // GPUs (ranks) of one host
  double intra_host_gbps = 350;    // within a host (NVLink; H100 SXM, NCCL all-reduce)
  double inter_host_gbps = 45;     // across hosts, per GPU (one 400 Gb/s InfiniBand NIC a GPU)
};

struct Deck {
  std::string path;                  // the deck file, empty when none
  ModelConfig model;
  // [model] init: a Hugging Face model directory whose config.json defines `model` and whose
  // safetensors weights start the run (at step 0, when no checkpoint is resumed); "" = the seed.
  std::string model_init;
  MeshShape mesh;
  TrainConfig train;
  OptimConfig optim;
  LoraConfig lora;                   // [lora]: r = 0 (the default) trains the whole model
  DataConfig data;
  CheckpointConfig checkpoint;
  LogConfig log;
  EvalConfig eval;
  TopologyConfig topology;
  // The resolved deck as INI text (every key with its final value), stored in checkpoints.
  std::string resolved;
};

// Reads the deck from `argv` (`qtrain [options] deck.ini`, `--section.key=value` wins over the
// file), validates it against `world_size` ranks and returns it. Throws UserError naming the key
// and, where there is one, file:line. Prints nothing.
Deck parse_deck(int argc, const char* const* argv, int world_size);
// Parses deck text (as if read from `path`) plus overrides; for tests.
Deck parse_deck_text(const std::string& text, const std::string& path,
                     const std::vector<std::string>& overrides, int world_size);
// The entries of eval.paths: split at commas, blanks around each trimmed (an empty entry stays,
// for the deck to refuse); none for "".
std::vector<std::string> split_eval_paths(const std::string& paths);
// The --help text: every key with its default and unit.
std::string deck_help();

const char* schedule_name(Schedule s);

}  // namespace qt
