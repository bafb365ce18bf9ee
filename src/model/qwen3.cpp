// Qwen3 dense forward and backward on the CPU: the layer program over CpuOps, the parameters
// unit by unit from a ModelParams.
#include "model/qwen3.h"

#include <algorithm>

#include "ops/cross_entropy.h"
#include "qtrain/error.h"

namespace qt {

namespace {

const ModelConfig& checked(const ModelConfig& cfg) {
  QT_CHECK(cfg.num_heads % cfg.num_kv_heads == 0, "heads {} not divisible by kv heads {}",
           cfg.num_heads, cfg.num_kv_heads);
  QT_CHECK(cfg.head_dim % 2 == 0, "head_dim {} must be even for RoPE", cfg.head_dim);
  return cfg;
}

}  // namespace

Qwen3Model::Qwen3Model(const ModelConfig& cfg, int B, int T, bool recompute, int seq_parallel)
    : cfg_(checked(cfg)),
      B_(B),
      T_(T),
      ops_(cfg, B, T, arena_, seq_parallel),
      program_(cfg, B, T, recompute,
               allocate_acts<float>(cfg, B, T, recompute, arena_, seq_parallel)) {
  const std::size_t N = static_cast<std::size_t>(B) * T;
  inputs_.resize(N);
  targets_.resize(N);
  pos_.resize(N);
}

double Qwen3Model::buffer_bytes(const ModelConfig& cfg, int B, int T, bool recompute,
                                int seq_parallel) {
  // What the constructor allocates for `layers` layers, counted, not allocated.
  auto count = [&](int layers) {
    ModelConfig c = cfg;
    c.num_layers = layers;
    HostArena arena(/*counting_only=*/true);
    CpuOps ops(c, B, T, arena, seq_parallel);
    allocate_acts<float>(c, B, T, recompute, arena, seq_parallel);
    return arena.bytes();
  };
  // Past the first layer, each adds the same bytes (its residual stream and, without recompute,
  // its activations): counted at one and two layers, so an absurd num_layers is checked at once.
  const double L = cfg.num_layers;
  const double bytes = L < 1 ? count(0) : count(1) + (L - 1) * (count(2) - count(1));
  return bytes + 3.0 * B * T * sizeof(std::int32_t);  // inputs_, targets_, pos_
}

void check_micro_batch(const std::int32_t* inputs, const std::int32_t* targets,
                       const std::int32_t* positions, int B, int T, int V) {
  for (int i = 0; i < B * T; ++i) {
    QT_CHECK(!inputs || (inputs[i] >= 0 && inputs[i] < V), "input id {} at {} outside [0, {})",
             inputs[i], i, V);
    QT_CHECK(!targets || targets[i] == cpu::kIgnoreIndex || (targets[i] >= 0 && targets[i] < V),
             "target id {} at {} outside [0, {})", targets[i], i, V);
    QT_CHECK(!positions || positions[i] == 0 ||
                 (i % T != 0 && positions[i] == positions[i - 1] + 1),
             "position {} at {} is neither 0 nor one past the previous", positions[i], i);
  }
}

double Qwen3Model::forward(ModelParams& mp, const std::int32_t* inputs,
                           const std::int32_t* targets, const std::int32_t* positions) {
  const int N = B_ * T_;
  QT_CHECK(!context_parallel_ || positions != nullptr,
           "a context-parallel forward needs each token's global position");
  check_micro_batch(inputs, targets, context_parallel_ ? nullptr : positions, B_, T_,
                    vocab_global_);
  std::copy(inputs, inputs + N, inputs_.begin());
  std::copy(targets, targets + N, targets_.begin());
  if (positions) std::copy(positions, positions + N, pos_.begin());
  ops_.set_positions(positions ? pos_.data() : nullptr);
  CpuUnits units{mp};
  program_.forward(ops_, units, inputs_.data());
  program_.head_forward(ops_, units, targets_.data());
  return ops_.take_loss();
}

double Qwen3Model::forward(const float* P, const std::int32_t* inputs, const std::int32_t* targets,
                           const std::int32_t* positions) {
  FlatParams flat(units(), P, nullptr);
  return forward(flat, inputs, targets, positions);
}

double Qwen3Model::forward_only(ModelParams& mp, const std::int32_t* inputs,
                                const std::int32_t* targets, const std::int32_t* positions) {
  const double loss = forward(mp, inputs, targets, positions);
  for (std::size_t u = 0; u < units().units.size(); ++u) mp.release(static_cast<int>(u));
  return loss;
}

void Qwen3Model::backward(ModelParams& mp, float loss_scale) {
  CpuUnits units{mp};
  program_.head_backward(ops_, units, targets_.data(), loss_scale);
  program_.backward(ops_, units, inputs_.data(), /*accumulate=*/true);
}

void Qwen3Model::backward(const float* P, float* G, float loss_scale) {
  FlatParams flat(units(), P, G);
  backward(flat, loss_scale);
}

}  // namespace qt
