// Deterministic, mesh-independent initialisation (transformers' _init_weights for Qwen3).
#include <cmath>
#include <cstring>

#include "model/qwen3.h"
#include "runtime/rng.h"

namespace qt {

void init_params(const ModelConfig& cfg, const ParamLayout& layout, std::uint64_t seed,
                 float* params) {
  for (const ParamInfo& p : layout.params()) {
    float* w = params + p.offset;
    if (p.shape.size() == 1) {  // RMSNorm weights start at one
      for (std::size_t i = 0; i < p.numel; ++i) w[i] = 1.0f;
      continue;
    }
    const std::uint64_t stream = rng::hash_combine(seed, rng::hash_string(p.name));
    for (std::size_t i = 0; i < p.numel; ++i)
      w[i] = static_cast<float>(cfg.initializer_range * rng::normal(stream, i));
  }
}

}  // namespace qt
