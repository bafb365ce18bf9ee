// Moving a flat buffer from the checkpoint partition to the ranges ranks need.
#pragma once

#include <cstddef>
#include <vector>

#include "qtrain/comm.h"
#include "qtrain/params.h"

namespace qt {

// Default elements each rank packs per all-to-all round (256 MiB of fp32).
inline constexpr std::size_t kRedistributeStage = std::size_t{1} << 26;

// Collective. Rank r holds its partition split_range(n, size, r) of a flat fp32 buffer of n
// elements in `mine` [partition size] and receives the flat range `want` (any range; ranges of
// different ranks may overlap) into `out` [want.size()]. Moves at most `stage` elements per rank
// per round, so MPI's int counts and displacements never overflow.
void redistribute_flat(Comm& comm, std::size_t n, const float* mine, Range want, float* out,
                       std::size_t stage = kRedistributeStage);

// Collective. The ranks hold a flat fp32 buffer of n elements as the pieces `have` (over all
// ranks a partition of [0, n): each element held by exactly one rank) and receive the pieces
// `want` (any ranges; ranks may want the same elements). Moves at most about `stage` elements per
// rank per round.
void redistribute_pieces(Comm& comm, std::size_t n, const std::vector<ConstFlatPiece>& have,
                         const std::vector<FlatPiece>& want, std::size_t stage = kRedistributeStage);

}  // namespace qt
