// Where a rank's LoRA adapters are held: the optimizer's units of the adapter layout
// (plan_adapters), each a flat range with its own weights and gradients. One unit at most
// meshes; with adapters on the experts at mesh.ep > 1 several (the dense adapters over dp, the
// experts' over expert-dp), so an adapter tensor is found through its unit, never by one base
// pointer. W: the weights' type (the CPU's fp32, the GPU's bf16 compute copy); gradients fp32.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "qtrain/error.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

template <typename W>
struct AdapterBuffers {
  struct Unit {
    Range range;                 // elements of the layout, flat
    const W* weights = nullptr;  // [range.size()]
    float* grads = nullptr;      // [range.size()], or null (no backward follows)
  };
  std::vector<Unit> units;  // ascending, not overlapping

  // One buffer for the whole layout [0, n).
  static AdapterBuffers whole(std::size_t n, const W* weights, float* grads) {
    return {{{Range{0, n}, weights, grads}}};
  }
  bool bound() const { return !units.empty(); }
  bool has_grads() const {
    return bound() && std::all_of(units.begin(), units.end(),
                                  [](const Unit& u) { return u.grads != nullptr; });
  }
  // Element `at` of the layout (a tensor's first: a tensor lies in one unit).
  const W* weights(std::size_t at) const {
    const Unit& u = unit(at);
    return u.weights + (at - u.range.begin);
  }
  float* grads(std::size_t at) const {
    const Unit& u = unit(at);
    return u.grads ? u.grads + (at - u.range.begin) : nullptr;
  }
  // The part in r, with offsets relative to r.begin (a pipeline chunk's adapters in its stage's).
  AdapterBuffers part(Range r) const {
    AdapterBuffers out;
    for (const Unit& u : units) {
      const std::size_t lo = std::max(u.range.begin, r.begin), hi = std::min(u.range.end, r.end);
      if (lo >= hi) continue;
      out.units.push_back({Range{lo - r.begin, hi - r.begin}, u.weights + (lo - u.range.begin),
                           u.grads ? u.grads + (lo - u.range.begin) : nullptr});
    }
    return out;
  }

  // The buffers of a state's units (weights_of(u), grads_of(u): unit u's whole buffers).
  template <typename WeightsOf, typename GradsOf>
  static AdapterBuffers of_units(const std::vector<ParamUnit>& plan_units, WeightsOf weights_of,
                                 GradsOf grads_of) {
    AdapterBuffers out;
    for (std::size_t u = 0; u < plan_units.size(); ++u)
      out.units.push_back({plan_units[u].range, weights_of(static_cast<int>(u)),
                           grads_of(static_cast<int>(u))});
    return out;
  }

 private:
  const Unit& unit(std::size_t at) const {
    for (const Unit& u : units)
      if (at >= u.range.begin && at < u.range.end) return u;
    QT_CHECK(false, "adapter element {} in no bound unit (bind() first)", at);
    return units.front();
  }
};

}  // namespace qt
