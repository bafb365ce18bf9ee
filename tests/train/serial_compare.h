// Comparing a training run with the serial one (the parallel dimensions' equivalence tests):
// losses and gradient norms step by step, and the final parameters of two checkpoints.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/mesh.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "training_harness.h"

namespace qt::test {

// Losses: fp32 sums in another order, over 10 steps (the bound). Gradient norms and
// parameters move further apart once AdamW has amplified those differences for a few steps (the
// flat-buffer trainer before the sharded state showed the same), but the first step's norm,
// taken before any update, differs only by the order of its sums.
inline constexpr double kTol = 1e-5;
inline constexpr double kNormTol = 1e-4, kFirstNormTol = 1e-6, kParamTol = 1e-4;

// Largest relative difference of the losses (or with `norms` of the gradient norms) at the steps
// both runs logged from `from`; infinity when a value is not finite or no step is shared.
inline double max_rel(const std::vector<StepRecord>& a, const std::vector<StepRecord>& b,
                      long from = 1, bool norms = false, long to = 1L << 40) {
  double worst = -1;
  for (const auto& x : a)
    for (const auto& y : b) {
      if (x.step != y.step || x.step < from || x.step > to) continue;
      if (!std::isfinite(x.loss) || !std::isfinite(x.grad_norm)) return INFINITY;
      worst = std::max(worst, norms ? std::abs(x.grad_norm - y.grad_norm) / std::abs(y.grad_norm)
                                    : std::abs(x.loss - y.loss) / std::abs(y.loss));
    }
  return worst < 0 ? INFINITY : worst;
}

// Every check of a run against the serial one.
inline void expect_serial(const std::vector<StepRecord>& got,
                          const std::vector<StepRecord>& serial, long from = 1) {
  EXPECT_LT(max_rel(got, serial, from), kTol) << "losses";
  EXPECT_LT(max_rel(got, serial, from, true), kNormTol) << "gradient norms";
  if (from == 1) EXPECT_LT(max_rel(got, serial, 1, true, 1), kFirstNormTol) << "first norm";
}

// The parameters of a checkpoint, whole, on every world rank.
// kv_heads: the model's key/value heads when not the tiny preset's (0).
inline std::vector<float> read_params(const std::string& path, bool tied, int kv_heads = 0) {
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  MeshShape shape;
  shape.dp = world->size();
  Mesh mesh(shape, world);
  ModelConfig m = *model_preset("tiny");
  m.tie_word_embeddings = tied;
  if (kv_heads > 0) m.num_kv_heads = kv_heads;
  const ParamLayout layout(m);
  std::vector<float> params(layout.numel());
  checkpoint_read(path, mesh, layout,
                  StateTargets{{{Range{0, layout.numel()}, params.data()}}, {}, {}}, m);
  return params;
}

// ||a - b|| / ||b|| over the whole model.
inline double rel_norm_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || b.empty()) return INFINITY;
  double d = 0, n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d / n);
}

}  // namespace qt::test
