// What a training run does in its checkpoint directory (docs/checkpoints.md, "Resuming" and
// "What a run deletes"). The rules that keep a user's work:
//  * one run at a time: the directory is locked (io/dir_lock.h) while the run may write to it;
//  * resume = auto continues from the newest readable checkpoint; an unreadable one (incomplete,
//    corrupt) is skipped and kept, but a valid one that does not fit the deck stops the run
//    (CheckpointMismatch): it is someone's work;
//  * resume = none refuses a directory that already holds checkpoints, and resume = <file>
//    refuses one that holds checkpoints newer than that file: the run would overwrite them;
//  * only checkpoints the run wrote, the one it resumed from and the older ones beside it may be
//    pruned (checkpoint.keep); a skipped unreadable file in the way of a new checkpoint is moved
//    aside (".unreadable"), never overwritten.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/dir_lock.h"
#include "qtrain/checkpoint.h"
#include "qtrain/deck.h"
#include "qtrain/mesh.h"

namespace qt {

class RunCheckpoints {
 public:
  // Collective. Locks checkpoint.dir when the run writes checkpoints (checkpoint.every >= 0).
  RunCheckpoints(const Deck& deck, Mesh& mesh);

  // Collective. Restores state, parameters and moments from the checkpoint that
  // checkpoint.resume names; returns false when the run starts afresh. Throws UserError (on
  // every rank) when resuming would put a user's checkpoint at risk (see above).
  bool resume(const ParamLayout& layout, const StateTargets& targets, TrainState& state,
              const LoraCheckpointInfo* lora);

  // Collective. Writes the checkpoint of state.step, then prunes. Throws NonFiniteState (nothing
  // written, nothing pruned) when the state holds NaN or infinity, UserError on a failed write.
  std::string save(const ParamLayout& layout, const std::vector<StatePiece>& pieces,
                   const TrainState& state, const ModelConfig& model, const std::string& deck_text,
                   const LoraCheckpointInfo* lora);

  // The newest checkpoint this run resumed from or wrote; "" when none.
  const std::string& newest() const { return newest_; }

 private:
  void prune();
  void move_aside_foreign(const std::string& path);

  const Deck& deck_;
  Mesh& mesh_;
  bool saving_;
  std::unique_ptr<DirLock> lock_;          // held while saving_
  std::vector<std::string> prunable_;      // files this run may delete (rank 0's view)
  std::string newest_;
};

}  // namespace qt
