// Checkpoints: one parallel-HDF5 file per checkpoint, every tensor with its global shape.
//
// File layout (docs/checkpoints.md):
//   /params/<transformers name>            fp32, global shape   (master weights)
//   /optim/exp_avg/<transformers name>     fp32, global shape   (AdamW first moment)
//   /optim/exp_avg_sq/<transformers name>  fp32, global shape   (AdamW second moment)
//   each dataset has attribute "checksum" (uint64, see below)
//   root attributes: format ("qtrain-checkpoint"), format_version, step, samples_consumed,
//   tokens_consumed, seed, rng_counter, skipped_steps, deck (resolved INI text), model config
//   fields; an fp16 run's loss_scale (f64), loss_scale_hysteresis, loss_scale_clean_steps and
//   overflow_steps.
//   /router_bias/model.layers.<l>.mlp.gate.expert_bias  fp32 [E], each sparse layer l: only
//   with a router bias (TrainState::router_bias; compact datasets, no checksum)
// A LoRA run's checkpoint holds the adapters instead of the model (/params/<PEFT name>, their
// moments under /optim) and names its frozen base in root attributes lora_r, lora_alpha,
// lora_dropout, lora_targets, lora_base_init (as given), lora_base_init_abs (absolute) and
// lora_base_seed.
//
// Written under "<name>.tmp" (the metadata built in memory, the values with MPI-IO:
// io/parallel_file.h) and renamed when complete. The checksum of a tensor is
// sum over its elements of mix(flat index, bit pattern) mod 2^64: additive over any partition of
// the elements, so each rank sums its own part and one all-reduce gives the total.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qtrain/error.h"
#include "qtrain/lora.h"
#include "qtrain/mesh.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"

namespace qt {

// Everything besides tensors that a resumed run needs to continue bit for bit.
struct TrainState {
  std::int64_t step = 0;              // optimizer steps completed
  std::int64_t samples_consumed = 0;  // sequences of the data order consumed so far
  std::int64_t tokens_consumed = 0;   // counted (loss) tokens so far
  std::uint64_t seed = 0;             // the run's seed
  std::uint64_t rng_counter = 0;      // draws taken from the run's counter-based RNG
  // Steps whose update was skipped for a non-finite loss or gradient norm (train.max_consecutive_skips);
  // AdamW's bias correction counts the applied ones, step - skipped_steps. A checkpoint without
  // it (written before it existed) reads as 0.
  std::int64_t skipped_steps = 0;
  // train.precision = fp16: the loss scaler's state for the next step (optim/loss_scaler.h's
  // LossScalerState) and how many of the skipped steps were overflows. loss_scale 0: none (a run
  // of another precision, or a checkpoint without it: the scaler starts afresh).
  double loss_scale = 0;
  std::int64_t loss_scale_hysteresis = 0;
  std::int64_t loss_scale_clean_steps = 0;
  std::int64_t overflow_steps = 0;
  // Qwen3-MoE auxiliary-loss-free balancing: the routers' bias [sparse layers, E] (fp32, the
  // same on every rank), or empty (none; a checkpoint without one reads as empty). Stored as
  // /router_bias/model.layers.<l>.mlp.gate.expert_bias [E], one a sparse layer.
  std::vector<float> router_bias;
};

// The optimizer tensors one rank holds: AdamW moments for the flat range `range` of the layout.
struct MomentShard {
  Range range;                 // flat elements held, e.g. the ZeRO-1 shard or everything
  float* exp_avg = nullptr;    // [range.size()]
  float* exp_avg_sq = nullptr; // [range.size()]
};

// A complete, valid checkpoint that does not fit the deck (another model shape, LoRA settings or
// base, a checkpoint of the other kind, a newer format version). Resuming must stop on it: it is
// someone's work, never to be skipped and then overwritten or pruned.
class CheckpointMismatch : public UserError {
 public:
  using UserError::UserError;
};

// The state to be written holds a NaN or an infinity; nothing was written.
class NonFiniteState : public UserError {
 public:
  using UserError::UserError;
};

// One flat range of the trained state that this rank writes: the parameters and both AdamW
// moments of `range`, each [range.size()].
struct StatePiece {
  Range range;
  const float* params = nullptr;
  const float* exp_avg = nullptr;
  const float* exp_avg_sq = nullptr;
};

// The flat ranges of the trained state this rank holds, which checkpoint_read fills: any ranges
// (several ranks may hold the same), in any order, for the parameters and each moment alike.
struct StateTargets {
  std::vector<FlatPiece> params, exp_avg, exp_avg_sq;
};

// The old contract as pieces: the write partition split_range(numel, world size, world rank) of a
// full flat `params` buffer and the moments of `moments.range` (which must contain it).
std::vector<StatePiece> flat_state_pieces(std::size_t numel, const Comm& world,
                                          const float* params, const MomentShard& moments);
// Targets of a full flat `params` buffer and the moments of `moments.range`.
StateTargets flat_state_targets(std::size_t numel, float* params, const MomentShard& moments);

// Collective over mesh.world(). Each rank writes its `pieces`; over all ranks they must cover
// [0, layout.numel()) exactly once (a gap or an overlap is a QT_CHECK failure on every rank,
// before anything is written): a tensor replicated over ranks is written by one of them. Writes
// `path`.tmp, then renames it to `path`. Checksums, non-finite checks and errors as below.
void checkpoint_write(const std::string& path, Mesh& mesh, const ParamLayout& layout,
                      const std::vector<StatePiece>& pieces, const TrainState& state,
                      const ModelConfig& model, const std::string& deck_text,
                      const LoraCheckpointInfo* lora = nullptr);

// Collective. Validates the file as the flat-buffer overload below does, then fills every
// target of this rank (each element of the file is read once over all ranks and checksummed,
// then moved to the ranks that hold it), so a checkpoint written at any mesh and ZeRO stage loads
// at any other.
TrainState checkpoint_read(const std::string& path, Mesh& mesh, const ParamLayout& layout,
                           const StateTargets& targets, const ModelConfig& model,
                           const LoraCheckpointInfo* lora = nullptr);

// Collective over mesh.world(). `params` is the full flat buffer (identical on every rank).
// The write partition is split_range(numel, world size, world rank); it must lie inside
// moments.range. Writes `path`.tmp, then renames it to `path`.
// Throws, on every rank alike and before anything is written, NonFiniteState when a parameter or
// moment is not finite, and UserError when the file system lacks the space; a failed write
// (disk full, quota, I/O error) removes the partial file and throws UserError naming the OS
// error and the path. An existing `path` is replaced only by a complete new file.
// lora: a LoRA run's checkpoint; layout and params are then the adapters'.
void checkpoint_write(const std::string& path, Mesh& mesh, const ParamLayout& layout,
                      const float* params, const MomentShard& moments, const TrainState& state,
                      const ModelConfig& model, const std::string& deck_text,
                      const LoraCheckpointInfo* lora = nullptr);

// Collective. Validates the file (format, model shape compatibility, every tensor present with
// the right shape, checksums) and fills `params` (full flat buffer) and the moments of
// `moments.range`. Throws UserError on every rank alike when anything is wrong, as
// CheckpointMismatch when the file is a readable qtrain checkpoint whose format version, model
// or LoRA settings differ from the caller's (other errors mean the file is missing, incomplete
// or corrupt); never modifies the file. lora: read a LoRA run's checkpoint (layout and params the adapters'), which must have
// the same r, alpha, targets and base; null: a checkpoint of the whole model. A checkpoint of
// the other kind is a UserError saying so.
TrainState checkpoint_read(const std::string& path, Mesh& mesh, const ParamLayout& layout,
                           float* params, const MomentShard& moments, const ModelConfig& model,
                           const LoraCheckpointInfo* lora = nullptr);

// Complete checkpoint files ("step_NNNNNNNN.h5") in `dir`, newest step first. Same on every rank
// (rank 0 lists, then broadcasts).
std::vector<std::string> checkpoint_list(const std::string& dir, Comm& world);

// File name for a step inside dir: dir/step_00000010.h5
std::string checkpoint_path(const std::string& dir, std::int64_t step);

// The step of a checkpoint file name ("step_00000010.h5" -> 10); -1 for any other name.
std::int64_t checkpoint_step(const std::string& path);

}  // namespace qt
