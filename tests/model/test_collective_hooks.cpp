// The layer program's collective hooks as a back end without tensor or sequence parallelism
// inherits them (NoCollectives in model/layer_program.h; CudaOps does): they must leave the
// program exactly as it was. The program over CpuOps with NoCollectives' hooks put back gives
// Qwen3Model's loss and gradients bit for bit, with recompute on and off.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "model/qwen3.h"
#include "support/random.h"
#include "support/random_model.h"

namespace qt {
namespace {

// CpuOps with the default hooks: NoCollectives' templates hide CpuOps' own.
struct DefaultHookOps : CpuOps {
  using CpuOps::CpuOps;
  using NoCollectives::tp_block_input;
  using NoCollectives::tp_block_input_backward;
  using NoCollectives::tp_block_output;
  using NoCollectives::tp_block_output_backward;
};

TEST(CollectiveHooks, DefaultsLeaveTheProgramUnchanged) {
  ModelConfig c;
  c.vocab_size = 24;
  c.hidden_size = 16;
  c.intermediate_size = 20;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 10000.0;
  const int B = 2, T = 5, N = B * T;
  std::mt19937_64 rng(test::test_seed());  // printed by test_seed
  const ParamLayout layout(c);
  const std::vector<float> params = test::random_model_params(layout, rng);
  std::uniform_int_distribution<int> tok(0, c.vocab_size - 1);
  std::vector<std::int32_t> inputs(N), targets(N);
  for (int i = 0; i < N; ++i) {
    inputs[i] = tok(rng);
    targets[i] = i % 4 == 1 ? -100 : tok(rng);
  }
  const float scale = 0.125f;
  for (const bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "keep activations");
    Qwen3Model model(c, B, T, recompute);
    std::vector<float> want(layout.numel(), 0.0f);
    const double want_loss = model.forward(params.data(), inputs.data(), targets.data());
    model.backward(params.data(), want.data(), scale);

    HostArena arena;
    DefaultHookOps ops(c, B, T, arena);
    Qwen3Program<DefaultHookOps> program(c, B, T, recompute,
                                         allocate_acts<float>(c, B, T, recompute, arena));
    std::vector<float> got(layout.numel(), 0.0f);
    FlatParams flat(program.units(), params.data(), got.data());
    CpuUnits units{flat};
    program.forward(ops, units, inputs.data());
    program.head_forward(ops, units, targets.data());
    EXPECT_EQ(ops.take_loss(), want_loss);
    program.head_backward(ops, units, targets.data(), scale);
    program.backward(ops, units, inputs.data(), /*accumulate=*/true);
    EXPECT_EQ(program.local_rows(), N);
    EXPECT_EQ(got, want);  // bit for bit
  }
}

}  // namespace
}  // namespace qt
