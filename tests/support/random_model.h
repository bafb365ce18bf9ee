// Random Qwen3 weights for model tests: every tensor normal(0, 0.3), large enough that attention
// is far from uniform; the norm weights (the 1-D tensors) 1 + 0.3 x normal, away from 1, so that
// every path of the model matters. One draw per element in layout order.
#pragma once

#include <random>
#include <vector>

#include "qtrain/params.h"
#include "support/random.h"

namespace qt::test {

inline std::vector<float> random_model_params(const ParamLayout& layout, std::mt19937_64& rng) {
  std::vector<float> p = random_vector<float>(layout.numel(), rng, 0.3);
  for (const ParamInfo& info : layout.params())
    if (info.shape.size() == 1)
      for (std::size_t i = 0; i < info.numel; ++i)
        p[info.offset + i] = 1.0f + 0.3f * p[info.offset + i];
  return p;
}

}  // namespace qt::test
