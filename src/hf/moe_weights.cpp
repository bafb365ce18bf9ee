// Qwen3-MoE experts: ParamLayout's fused tensors <-> per-expert file tensors (moe_weights.h).
#include "hf/moe_weights.h"

#include <fmt/format.h>

#include <cctype>

#include "qtrain/error.h"

namespace qt::hf {

namespace {

constexpr std::string_view kGateUp = "mlp.experts.gate_up_proj";
constexpr std::string_view kDown = "mlp.experts.down_proj";

}  // namespace

std::int64_t FileTensor::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

std::vector<std::vector<FileTensor>> expert_file_tensors(const ParamInfo& p) {
  const std::string& n = p.name;
  const bool gate_up = n.ends_with(kGateUp), down = n.ends_with(kDown);
  if (!gate_up && !down) return {};
  QT_CHECK(p.shape.size() == 3, "{}: a fused expert tensor has 3 dimensions", n);
  // "model.layers.{l}.mlp.experts." before the suffix's last part
  const std::string prefix = n.substr(0, n.size() - (gate_up ? kGateUp : kDown).size()) + "mlp.experts.";
  const std::int64_t E = p.shape[0];
  std::vector<std::vector<FileTensor>> out(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string at = fmt::format("{}{}.", prefix, e);
    if (gate_up) {  // [E, 2 Im, H]: gate rows first, then up
      QT_CHECK(p.shape[1] % 2 == 0, "{}: odd 2 Im = {}", n, p.shape[1]);
      const std::vector<std::int64_t> half = {p.shape[1] / 2, p.shape[2]};
      out[e] = {{at + "gate_proj.weight", half}, {at + "up_proj.weight", half}};
    } else {  // [E, H, Im]
      out[e] = {{at + "down_proj.weight", {p.shape[1], p.shape[2]}}};
    }
  }
  return out;
}

bool is_expert_file_tensor(const std::string& name) {
  // model.layers.{l}.mlp.experts.{e}.<anything>
  const auto at = name.find(".mlp.experts.");
  if (at == std::string::npos || name.rfind("model.layers.", 0) != 0) return false;
  std::size_t i = at + std::string_view(".mlp.experts.").size(), digits = 0;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i, ++digits;
  return digits > 0 && i < name.size() && name[i] == '.';
}

}  // namespace qt::hf
