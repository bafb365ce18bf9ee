// Moving a flat buffer from the checkpoint partition to the ranges ranks need.
#pragma once

#include <cstddef>
#include <string>
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

// Collective. Every rank's ranges: out[s] = the ranges rank s passed, in its order (the counts
// are all-gathered, then the ranges).
std::vector<std::vector<Range>> all_gather_ranges(Comm& comm, const std::vector<Range>& mine);

// "" when the ranges of all ranks (ranges[s]: rank s's; empty ranges ignored) cover [0, n)
// exactly once; else the first fault in flat order: a range outside [0, n), elements held by two
// ranges (naming both and their ranks) or by none.
std::string partition_error(const std::vector<std::vector<Range>>& ranges, std::size_t n);

// Collective. The ranks hold a flat fp32 buffer of n elements as the pieces `have` (over all
// ranks a partition of [0, n): each element held by exactly one rank) and receive the pieces
// `want` (any ranges; ranks may want the same elements). Moves at most about `stage` elements per
// rank per round.
// Rounds: the elements pair (a -> b) moves are have_a ∩ want_b in the order of b's want pieces,
// then of the flat index; each round moves the next max(1, stage / size) of them for every pair,
// so a rank sends and receives at most max(stage, size) elements per round and MPI's int counts
// never overflow. A have partition that is not exact is a QT_CHECK failure on every rank.
void redistribute_pieces(Comm& comm, std::size_t n, const std::vector<ConstFlatPiece>& have,
                         const std::vector<FlatPiece>& want, std::size_t stage = kRedistributeStage);

// Collective. redistribute_pieces with one want, the whole [0, n) into `out` [n] on rank 0
// (untouched elsewhere), from `have` pieces that may overlap where they hold the same values
// (e.g. weights replicated over ranks): each element comes from the first piece that holds it,
// in rank order, then the pieces' order. An element no rank holds is a QT_CHECK failure naming
// `what` on every rank.
void gather_pieces(Comm& comm, std::size_t n, const std::vector<ConstFlatPiece>& have, float* out,
                   const char* what, std::size_t stage = kRedistributeStage);

}  // namespace qt
