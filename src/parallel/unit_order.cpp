#include "parallel/unit_order.h"

#include <map>
#include <string>

#include "qtrain/error.h"

namespace qt {

namespace {
// The decoder layer of a unit named "<prefix>.<l>" (shard_plan.cpp's names), or -1.
int layer_of(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix + ".", 0) != 0) return -1;
  return std::stoi(name.substr(prefix.size() + 1));
}
}  // namespace

std::vector<int> forward_unit_order(const ShardPlan& plan) {
  std::map<int, int> experts_of;  // decoder layer -> its experts' unit
  for (std::size_t u = 0; u < plan.units.size(); ++u) {
    const int l = layer_of(plan.units[u].name, "experts");
    if (l >= 0) experts_of[l] = static_cast<int>(u);
  }
  std::vector<int> order;
  for (std::size_t u = 0; u < plan.units.size(); ++u) {
    const std::string& name = plan.units[u].name;
    if (layer_of(name, "experts") >= 0) continue;  // placed after its layer
    order.push_back(static_cast<int>(u));
    const auto x = experts_of.find(layer_of(name, "layers"));
    if (x != experts_of.end()) {
      order.push_back(x->second);
      experts_of.erase(x);
    }
  }
  QT_CHECK(experts_of.empty(), "an experts' unit of layer {} without its layer's unit",
           experts_of.begin()->first);
  return order;
}

}  // namespace qt
