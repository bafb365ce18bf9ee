// Local pieces to global ones through a LayoutMap's segments.
#include "parallel/layout_map.h"

namespace qt {

std::vector<FlatPiece> LayoutMap::to_global(const std::vector<FlatPiece>& local,
                                            bool writing) const {
  std::vector<FlatPiece> out;
  for (const FlatPiece& p : local)
    for (const Segment& s : segments(p.range, writing))
      out.push_back({Range{s.global, s.global + s.count}, p.data + (s.local - p.range.begin)});
  return out;
}

std::vector<StatePiece> LayoutMap::to_global(const std::vector<StatePiece>& local,
                                             bool writing) const {
  std::vector<StatePiece> out;
  auto at = [](const float* base, std::size_t k) { return base ? base + k : nullptr; };
  for (const StatePiece& p : local)
    for (const Segment& s : segments(p.range, writing)) {
      const std::size_t k = s.local - p.range.begin;
      out.push_back({Range{s.global, s.global + s.count}, at(p.params, k), at(p.exp_avg, k),
                     at(p.exp_avg_sq, k)});
    }
  return out;
}

StateTargets LayoutMap::to_global(const StateTargets& local) const {
  return {to_global(local.params, false), to_global(local.exp_avg, false),
          to_global(local.exp_avg_sq, false)};
}

std::vector<FlatPiece> global_pieces(const LayoutMap* map, std::vector<FlatPiece> local,
                                     bool writing) {
  return map ? map->to_global(local, writing) : local;
}

std::vector<StatePiece> global_pieces(const LayoutMap* map, std::vector<StatePiece> local,
                                      bool writing) {
  return map ? map->to_global(local, writing) : local;
}

StateTargets global_targets(const LayoutMap* map, StateTargets local) {
  return map ? map->to_global(local) : local;
}

}  // namespace qt
