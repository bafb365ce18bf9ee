// LoRA on the GPU (src/cuda/lora_cuda.*, Qwen3Cuda with a frozen base) against the CPU LoRA
// engine (fp32) on the same bf16-representable base weights and adapters: the whole model's loss
// and every adapter gradient, for several target sets, dropout 0 and 0.1, tied and untied,
// plain and packed rows. Activation recompute must give the same bits, and so must a second
// pass. The dropout kernel is checked bit for bit against the CPU's masks (a tensor-parallel
// row-parallel input's columns of them too).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cuda/device.h"
#include "cuda/lora_cuda.h"
#include "cuda/qwen3_cuda.h"
#include "gpu_test.h"
#include "tiny_model.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/lora_dropout.cuh"
#include "runtime/rng.h"
#include "support/compare.h"
#include "support/random.h"

namespace qt {
namespace {

using test::bf16_bits;
using test::bf16_value;
using test::rel_error;

// ---- The dropout kernel: the CPU's masks, bit for bit --------------------------------------------

struct DropoutCase {
  int N, T, in;
  double p;
  std::int64_t first_sample;
  int layer, target;
  // Tensor parallelism's row-parallel input: columns [col0, col0 + in) of mask rows of `width`
  // elements (0: in).
  int width = 0, col0 = 0;
};

class LoraDropoutKernel : public ::testing::TestWithParam<DropoutCase> {};

TEST_P(LoraDropoutKernel, MatchesTheCpuMaskBitForBit) {
  QT_REQUIRE_GPU();
  const DropoutCase k = GetParam();
  const std::size_t n = static_cast<std::size_t>(k.N) * k.in;
  std::mt19937_64 rng(test::test_seed());
  std::vector<std::uint16_t> x(n), d(n), dx(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = bf16_bits(static_cast<float>(std::normal_distribution<double>(0, 1)(rng)));
    d[i] = bf16_bits(static_cast<float>(std::normal_distribution<double>(0, 1)(rng)));
    dx[i] = bf16_bits(static_cast<float>(std::normal_distribution<double>(0, 1)(rng)));
  }
  const std::uint64_t seed = rng();
  // The CPU's rule (LoraAdapters::dropped): row n is token n % T of sequence first + n / T, its
  // mask row `width` wide, of which the input holds columns [col0, col0 + in).
  const std::uint64_t stream = lora_dropout_stream(seed, k.layer, k.target);
  const float keep_scale = static_cast<float>(1.0 / (1.0 - k.p));
  std::vector<std::uint16_t> want_xd(n), want_dx(n);
  std::size_t kept = 0;
  for (int row = 0; row < k.N; ++row) {
    const std::uint64_t g = static_cast<std::uint64_t>(k.first_sample + row / k.T);
    const std::uint64_t first =
        (g * k.T + row % k.T) * static_cast<std::uint64_t>(k.width > 0 ? k.width : k.in) +
        static_cast<std::uint64_t>(k.col0);
    for (int i = 0; i < k.in; ++i) {
      const std::size_t e = static_cast<std::size_t>(row) * k.in + i;
      const float m = rng::uniform(stream, first + i) >= k.p ? keep_scale : 0.0f;
      kept += m != 0.0f;
      want_xd[e] = bf16_bits(bf16_value(x[e]) * m);
      want_dx[e] = bf16_bits(bf16_value(dx[e]) + bf16_value(d[e]) * m);
    }
  }
  test::GuardedBuffer<std::uint16_t> gx(x), gd(d), gdx(dx), gxd(n);
  cuda::LoraDropoutKey key;
  key.stream = stream;
  key.first_row = k.first_sample * k.T;
  key.p = k.p;
  key.keep_scale = keep_scale;
  key.row_width = k.width;
  key.col0 = k.col0;
  auto* bx = reinterpret_cast<cuda::bf16*>(gx.get());
  cuda::lora_dropout_forward(reinterpret_cast<cuda::bf16*>(gxd.get()), bx, k.N, k.in, key, nullptr);
  cuda::lora_dropout_backward(reinterpret_cast<cuda::bf16*>(gdx.get()),
                              reinterpret_cast<const cuda::bf16*>(gd.get()), k.N, k.in, key,
                              nullptr);
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(gxd.download(), want_xd);
  EXPECT_EQ(gdx.download(), want_dx);
  EXPECT_TRUE(gxd.guard_intact());
  EXPECT_TRUE(gdx.guard_intact());
  // The mask is not degenerate: about 1 - p of the elements kept (within 6 standard deviations).
  const double frac = static_cast<double>(kept) / static_cast<double>(n);
  EXPECT_NEAR(frac, 1.0 - k.p, 6 * std::sqrt(k.p * (1 - k.p) / static_cast<double>(n))) << frac;
}

INSTANTIATE_TEST_SUITE_P(Cases, LoraDropoutKernel,
                         ::testing::Values(DropoutCase{192, 96, 128, 0.1, 0, 0, kLoraQ},
                                           DropoutCase{200, 64, 256, 0.5, 12345, 3, kLoraDown},
                                           DropoutCase{7, 3, 1024, 0.05, 1LL << 33, 27, kLoraUp},
                                           DropoutCase{64, 64, 8, 0.9, 5, 1, kLoraO},
                                           // tp 4's rank 2 of down_proj's input
                                           DropoutCase{128, 64, 64, 0.1, 9, 2, kLoraDown, 256,
                                                       128}));

// ---- The whole model: CUDA LoRA against the CPU LoRA engine --------------------------------------

struct Case {
  const char* name;
  const char* targets;
  double dropout;
  int r;
  int heads, kv_heads, head_dim;
  bool tied;
  bool packed = false;
};

class LoraCudaVsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(LoraCudaVsCpu, LossAndAdapterGradients) {
  QT_REQUIRE_GPU();
  const Case k = GetParam();
  const ModelConfig c = test::tiny_model(k.heads, k.kv_heads, k.head_dim, k.tied);
  LoraConfig lc;
  lc.r = k.r;
  lc.alpha = 2.0 * k.r;
  lc.dropout = k.dropout;
  lc.targets = k.targets;
  const int B = 2, T = 96;
  const std::uint64_t seed = 77;
  const std::int64_t first_sample = 6;  // the masks of sequences 6 and 7 of the data order
  ParamLayout layout(c);
  const ParamLayout alayout = lora_layout(c, lc);
  std::mt19937_64 rng(test::test_seed());
  const std::vector<float> params = test::bf16_weights(c, rng);  // both sides: bf16 values
  // A as PEFT initialises it, B random (not 0), so that every gradient path is live.
  std::vector<float> adapters(alayout.numel());
  lora_init(alayout, rng(), adapters.data());
  for (const ParamInfo& p : alayout.params())
    if (p.name.find(".lora_B.") != std::string::npos)
      for (std::size_t i = 0; i < p.numel; ++i)
        adapters[p.offset + i] = static_cast<float>(std::normal_distribution<double>(0, 0.1)(rng));
  for (float& x : adapters) x = test::round_bf16(x);
  const test::TokenBatch batch = test::random_batch(B, T, c.vocab_size, rng);
  const long counted = batch.counted;
  const std::int32_t* pos = k.packed ? batch.positions.data() : nullptr;
  const float scale = 1.0f / counted;

  // CPU: the fp32 engine with the base frozen (no base gradients).
  Qwen3Model cpu_model(c, B, T, false);
  LoraAdapters cpu_lora(c, lc, B, T);
  cpu_model.set_lora(&cpu_lora);
  std::vector<float> cpu_grads(alayout.numel(), 0.0f);
  cpu_lora.bind(adapters.data(), cpu_grads.data());
  cpu_lora.set_dropout_key(seed, first_sample);
  const double cpu_loss =
      cpu_model.forward(params.data(), batch.inputs.data(), batch.targets.data(), pos) / counted;
  cpu_model.backward(params.data(), nullptr, scale);
  ASSERT_TRUE(std::isfinite(cpu_loss));

  cuda::DeviceArena arena(std::size_t{1} << 30, "test arena");
  cuda::gemm_init(arena.allocate(cuda::kGemmWorkspaceBytes), cuda::kGemmWorkspaceBytes);
  cuda::Stream stream;
  const std::size_t na = alayout.numel();
  float* staging = arena.allocate<float>(std::max(layout.numel(), na));
  cuda::bf16* weights = arena.allocate<cuda::bf16>(layout.numel());
  cuda::bf16* aw = arena.allocate<cuda::bf16>(na);
  float* grads = arena.allocate<float>(na);
  std::int32_t* d_in = arena.allocate<std::int32_t>(B * T);
  std::int32_t* d_tg = arena.allocate<std::int32_t>(B * T);
  std::int32_t* d_pos = arena.allocate<std::int32_t>(B * T);
  cuda::upload(staging, params.data(), params.size() * 4);
  cuda::convert_f32_to_bf16(weights, staging, layout.numel(), stream.get());
  stream.synchronize();
  cuda::upload(staging, adapters.data(), na * 4);
  cuda::convert_f32_to_bf16(aw, staging, na, stream.get());
  cuda::upload(d_in, batch.inputs.data(), B * T * 4);
  cuda::upload(d_tg, batch.targets.data(), B * T * 4);
  cuda::upload(d_pos, batch.positions.data(), B * T * 4);
  const std::int32_t* dpos = k.packed ? d_pos : nullptr;

  // One pass of the GPU model (recompute or not): loss and adapter gradients.
  auto gpu_pass = [&](cuda::Qwen3Cuda& model, cuda::LoraCuda& lora, double* loss) {
    QT_CHECK_CUDA(cudaMemsetAsync(grads, 0, na * 4, stream.get()));
    lora.bind(aw, grads);
    lora.set_dropout_key(seed, first_sample);
    *loss = model.forward_backward(weights, nullptr, d_in, d_tg, scale, stream.get(), {}, dpos) /
            counted;
    std::vector<float> g(na);
    QT_CHECK_CUDA(cudaMemcpy(g.data(), grads, na * 4, cudaMemcpyDeviceToHost));
    return g;
  };
  cuda::Qwen3Cuda model(c, B, T, arena);
  cuda::LoraCuda lora(c, lc, B, T, arena);
  model.set_lora(&lora);
  double loss = 0;
  const std::vector<float> gpu_grads = gpu_pass(model, lora, &loss);

  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_LT(std::abs(loss - cpu_loss) / cpu_loss, 1e-2) << loss << " vs " << cpu_loss;
  std::printf("[%s] loss %.6f (cpu %.6f)\n", k.name, loss, cpu_loss);
  double worst = 0;
  for (const ParamInfo& p : alayout.params()) {
    const double err = rel_error(gpu_grads.data() + p.offset, cpu_grads.data() + p.offset, p.numel);
    EXPECT_LT(err, 5e-2) << p.name;
    worst = std::max(worst, err);
    double norm = 0;
    for (std::size_t i = 0; i < p.numel; ++i) norm += std::abs(cpu_grads[p.offset + i]);
    EXPECT_GT(norm, 0) << p.name << ": a dead gradient path in the oracle";
  }
  const double total = rel_error(gpu_grads, cpu_grads);
  EXPECT_LT(total, 2e-2);
  std::printf("[%s] adapter gradient rel err: all %.3e, worst tensor %.3e\n", k.name, total, worst);

  // Deterministic: a second pass gives the same bits.
  double again = 0;
  EXPECT_EQ(gpu_pass(model, lora, &again), gpu_grads);
  EXPECT_EQ(again, loss);

  // Recompute (its own model and adapters): the same bits.
  cuda::Qwen3Cuda rec_model(c, B, T, arena, true);
  cuda::LoraCuda rec_lora(c, lc, B, T, arena);
  rec_model.set_lora(&rec_lora);
  double rec_loss = 0;
  EXPECT_EQ(gpu_pass(rec_model, rec_lora, &rec_loss), gpu_grads);
  EXPECT_EQ(rec_loss, loss);
}

INSTANTIATE_TEST_SUITE_P(
    Targets, LoraCudaVsCpu,
    ::testing::Values(
        Case{"qkvo_tied_gqa2_hd64", "q_proj,k_proj,v_proj,o_proj", 0.0, 8, 4, 2, 64, true},
        Case{"all_linear_dropout_untied_hd128", "all-linear", 0.1, 8, 8, 2, 128, false},
        Case{"all_linear_dropout_packed_tied", "all-linear", 0.1, 8, 4, 2, 64, true, true},
        Case{"qkvo_packed_untied_hd128", "q_proj,k_proj,v_proj,o_proj", 0.0, 8, 8, 2, 128, false,
             true},
        // Layer 0's backward stops at its lowest adapter: o_proj, gate/up, down_proj.
        Case{"o_up_r4_untied", "o_proj,up_proj", 0.0, 4, 4, 2, 64, false},
        Case{"gate_r16_dropout_tied", "gate_proj", 0.1, 16, 4, 2, 64, true},
        Case{"v_down_dropout_untied", "v_proj,down_proj", 0.1, 8, 8, 2, 128, false},
        Case{"down_only_tied", "down_proj", 0.0, 8, 4, 2, 64, true}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace qt
