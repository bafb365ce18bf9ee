// Where the elements of a rank's local layout live in the model's global one: the map every
// piece of state crosses on its way to initialisation, imports and checkpoints (which see global
// tensors only), so that any mesh resumes any other. TpMap (parallel/tensor_parallel.h) for
// tensor parallelism, EpMap (parallel/expert_parallel.h) for expert parallelism.
#pragma once

#include <cstddef>
#include <vector>

#include "qtrain/checkpoint.h"
#include "qtrain/params.h"

namespace qt {

class LayoutMap {
 public:
  // A contiguous run of `count` elements at `local` in the local layout and `global` in the
  // global one.
  struct Segment {
    std::size_t local, global, count;
  };
  virtual ~LayoutMap() = default;

  // The segments of the local flat range r, in local order. writing: leave out copies another
  // rank writes, so that over all ranks a checkpoint gets each global element once.
  virtual std::vector<Segment> segments(Range r, bool writing) const = 0;

  // The same pieces in global coordinates (data pointers advanced to each segment).
  std::vector<FlatPiece> to_global(const std::vector<FlatPiece>& local, bool writing) const;
  std::vector<StatePiece> to_global(const std::vector<StatePiece>& local, bool writing) const;
  // A checkpoint read's targets (everything held, replicated tensors too).
  StateTargets to_global(const StateTargets& local) const;
};

// Pieces in global coordinates: through `map`, or as they are (null: the local layout is the
// global one). For the CPU back ends' state.
std::vector<FlatPiece> global_pieces(const LayoutMap* map, std::vector<FlatPiece> local,
                                     bool writing);
std::vector<StatePiece> global_pieces(const LayoutMap* map, std::vector<StatePiece> local,
                                      bool writing);
StateTargets global_targets(const LayoutMap* map, StateTargets local);

}  // namespace qt
