// The CUDA Qwen3 (bf16) against the CPU model (fp32) on the same bf16-representable weights:
// loss and every weight gradient; plain causal rows, and packed rows (documents of random
// lengths, positions restarting at each, data.packing = packed).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "cuda/device.h"
#include "cuda/qwen3_cuda.h"
#include "cuda_op_check.h"
#include "tiny_model.h"
#include "gpu_test.h"
#include "model/qwen3.h"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/gemm.cuh"
#include "support/compare.h"
#include "support/random.h"

namespace qt {
namespace {

using test::rel_error;

struct Case {
  const char* name;
  int heads, kv_heads, head_dim;
  bool tied;
  bool packed = false;  // rows of several documents, with positions
};

class Qwen3CudaVsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(Qwen3CudaVsCpu, LossAndGradients) {
  QT_REQUIRE_GPU();
  const Case k = GetParam();
  const ModelConfig c = test::tiny_model(k.heads, k.kv_heads, k.head_dim, k.tied);
  const int B = 2, T = 96;
  ParamLayout layout(c);
  std::mt19937_64 rng(test::test_seed());
  const std::vector<float> params = test::bf16_weights(c, rng);  // both sides see bf16 weights
  const test::TokenBatch batch = test::random_batch(B, T, c.vocab_size, rng);
  const long counted = batch.counted;
  const std::int32_t* pos = k.packed ? batch.positions.data() : nullptr;
  const float scale = 1.0f / counted;

  Qwen3Model cpu_model(c, B, T, false);
  std::vector<float> cpu_grads(layout.numel(), 0.0f);
  const double cpu_loss =
      cpu_model.forward(params.data(), batch.inputs.data(), batch.targets.data(), pos) / counted;
  cpu_model.backward(params.data(), cpu_grads.data(), scale);

  cuda::DeviceArena arena(std::size_t{1} << 30, "test arena");
  cuda::gemm_init(arena.allocate(cuda::kGemmWorkspaceBytes), cuda::kGemmWorkspaceBytes);
  cuda::Stream stream;
  float* master = arena.allocate<float>(layout.numel());
  cuda::bf16* weights = arena.allocate<cuda::bf16>(layout.numel());
  float* grads = arena.allocate<float>(layout.numel());
  std::int32_t* d_in = arena.allocate<std::int32_t>(B * T);
  std::int32_t* d_tg = arena.allocate<std::int32_t>(B * T);
  std::int32_t* d_pos = arena.allocate<std::int32_t>(B * T);
  qt::cuda::upload(master, params.data(), params.size() * 4);
  cuda::convert_f32_to_bf16(weights, master, layout.numel(), stream.get());
  QT_CHECK_CUDA(cudaMemsetAsync(grads, 0, layout.numel() * 4, stream.get()));
  qt::cuda::upload(d_in, batch.inputs.data(), B * T * 4);
  qt::cuda::upload(d_tg, batch.targets.data(), B * T * 4);
  qt::cuda::upload(d_pos, batch.positions.data(), B * T * 4);
  const std::int32_t* dpos = k.packed ? d_pos : nullptr;
  cuda::Qwen3Cuda model(c, B, T, arena);
  const double loss =
      model.forward_backward(weights, grads, d_in, d_tg, scale, stream.get(), {}, dpos) / counted;
  std::vector<float> gpu_grads(layout.numel());
  QT_CHECK_CUDA(cudaMemcpy(gpu_grads.data(), grads, layout.numel() * 4, cudaMemcpyDeviceToHost));

  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_LT(std::abs(loss - cpu_loss) / cpu_loss, 1e-2) << loss << " vs " << cpu_loss;
  std::printf("[%s] loss %.6f (cpu %.6f)\n", k.name, loss, cpu_loss);
  double worst = 0;
  for (const ParamInfo& p : layout.params()) {
    const double err = rel_error(gpu_grads.data() + p.offset, cpu_grads.data() + p.offset, p.numel);
    EXPECT_LT(err, 5e-2) << p.name;
    worst = std::max(worst, err);
  }
  const double total = rel_error(gpu_grads.data(), cpu_grads.data(), layout.numel());
  EXPECT_LT(total, test::kTolBf16Model);
  std::printf("[%s] gradient rel err: all %.3e, worst tensor %.3e\n", k.name, total, worst);

  // Deterministic: a second pass gives the same bits.
  QT_CHECK_CUDA(cudaMemsetAsync(grads, 0, layout.numel() * 4, stream.get()));
  const double again =
      model.forward_backward(weights, grads, d_in, d_tg, scale, stream.get(), {}, dpos) / counted;
  std::vector<float> again_grads(layout.numel());
  QT_CHECK_CUDA(cudaMemcpy(again_grads.data(), grads, layout.numel() * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(loss, again);
  EXPECT_EQ(gpu_grads, again_grads);

  // GradWrite::kOverwrite writes every gradient without reading G: over NaN it gives the bits of
  // accumulating into zeros; a second micro-batch accumulated on top gives those of two
  // accumulations into zeros.
  using GW = cuda::Qwen3Cuda::GradWrite;
  QT_CHECK_CUDA(cudaMemsetAsync(grads, 0xff, layout.numel() * 4, stream.get()));  // NaN
  model.forward_backward(weights, grads, d_in, d_tg, scale, stream.get(), {}, dpos, GW::kOverwrite);
  std::vector<float> written(layout.numel());
  QT_CHECK_CUDA(cudaMemcpy(written.data(), grads, layout.numel() * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(written.data(), gpu_grads.data(), written.size() * 4), 0)
      << "overwritten gradients differ from accumulated ones (or kept a NaN)";
  model.forward_backward(weights, grads, d_in, d_tg, scale, stream.get(), {}, dpos);
  std::vector<float> twice(layout.numel());
  QT_CHECK_CUDA(cudaMemcpy(twice.data(), grads, layout.numel() * 4, cudaMemcpyDeviceToHost));
  model.forward_backward(weights, grads, d_in, d_tg, scale, stream.get(), {}, dpos, GW::kOverwrite);
  model.forward_backward(weights, grads, d_in, d_tg, scale, stream.get(), {}, dpos, GW::kAccumulate);
  std::vector<float> twice_again(layout.numel());
  QT_CHECK_CUDA(cudaMemcpy(twice_again.data(), grads, layout.numel() * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(twice, twice_again);
  std::vector<float> doubled(gpu_grads);  // the second micro-batch added (fp32 rounding only)
  for (float& x : doubled) x *= 2;
  EXPECT_LT(rel_error(twice.data(), doubled.data(), twice.size()), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Qwen3CudaVsCpu,
                         ::testing::Values(Case{"tied_gqa2_hd64", 4, 2, 64, true},
                                           Case{"untied_gqa4_hd128", 8, 2, 128, false},
                                           Case{"packed_tied_gqa2_hd64", 4, 2, 64, true, true},
                                           Case{"packed_untied_gqa4_hd128", 8, 2, 128, false, true}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace qt
