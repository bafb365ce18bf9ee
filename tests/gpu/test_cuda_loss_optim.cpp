// CUDA cross-entropy against the CPU op in double (Qwen3's V = 151936, V not a multiple of 8,
// misaligned logits, ignored rows, large logits, the aliased backward), and the fused AdamW and
// gradient norm against the CPU optimizer driver (ShardedState): the same parameters and moments bit for bit.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda_op_check.h"
#include "ops/cross_entropy.h"
#include "ops/cuda/adamw.cuh"
#include "ops/cuda/cross_entropy.cuh"
#include "optim/sharded_state.h"

namespace qt::test {
namespace {

// ---------------------------------------------------------------------------------------------
// cross-entropy

struct CeCase {
  int N, V;
  int shift;  // elements by which logits and dlogits are moved off 16-byte alignment
};

class CudaCrossEntropy : public ::testing::TestWithParam<CeCase> {};

TEST_P(CudaCrossEntropy, ForwardAndBackwardMatchCpu) {
  QT_REQUIRE_GPU();
  const auto [N, V, shift] = GetParam();
  const std::size_t n = std::size_t(N) * V;
  auto rng = test_rng();
  Bf16Input logits = random_bf16(n, rng, 3.0);
  if (N > 1)  // row 1 far from 0: the max must be subtracted
    for (int v = 0; v < V; ++v) {
      const std::size_t k = std::size_t(V) + v;
      logits.bits[k] = to_bf16(logits.value[k] + 500.0);
      logits.value[k] = from_bf16(logits.bits[k]);
    }
  std::uniform_int_distribution<int> pick(0, V - 1);
  std::vector<std::int32_t> targets(N);
  int counted = 0;
  for (int i = 0; i < N; ++i) {
    targets[i] = i % 5 == 2 ? cpu::kIgnoreIndex : pick(rng);
    counted += targets[i] != cpu::kIgnoreIndex;
  }
  std::vector<bf16> padded(n + 1, to_bf16(0.0));
  std::copy(logits.bits.begin(), logits.bits.end(), padded.begin() + shift);
  GuardedBuffer<bf16> dlogits(padded), dgrad(n + 1);
  GuardedBuffer<std::int32_t> dtargets(targets);
  GuardedBuffer<float> dlosses(N), dlse(N);
  const double prior = 1.5;  // the loss sum is accumulated
  GuardedBuffer<double> dsum(std::vector<double>{prior});
  fill_nan(dlosses);
  fill_nan(dlse);
  fill_nan(dgrad);
  cuda::cross_entropy_forward(dlosses.get(), dlse.get(), dlogits.get() + shift, dtargets.get(), N,
                              V, dsum.get(), nullptr);
  const float scale = counted > 0 ? 1.0f / counted : 1.0f;
  cuda::cross_entropy_backward(dgrad.get() + shift, dlogits.get() + shift, dlse.get(),
                               dtargets.get(), scale, N, V, nullptr);

  Vec losses(N), lse(N), grad(n);
  const double total = cpu::cross_entropy_forward<double>(
      losses.data(), lse.data(), logits.value.data(), targets.data(), N, V);
  cpu::cross_entropy_backward<double>(grad.data(), logits.value.data(), lse.data(), targets.data(),
                                      double(scale), N, V);
  // A row's loss is lse - logit[target], both rounded in fp32 on the GPU: its error scales with
  // |lse| (about 500 in row 1), not with the loss, which can be near 0. So each row's loss, and
  // their sum, are bounded relative to max(1, |lse|) of the rows.
  auto check_forward = [&](const GuardedBuffer<float>& glosses, const GuardedBuffer<float>& glse,
                           const GuardedBuffer<double>& gsum) {
    QT_EXPECT_GPU_CLOSE(glse, lse, kTolF32);
    const Vec got_losses = download(glosses);
    double lse_scale = 0.0;
    for (int i = 0; i < N; ++i) {
      if (targets[i] == cpu::kIgnoreIndex) {
        EXPECT_EQ(got_losses[i], 0.0) << "ignored row " << i;
        continue;
      }
      const double bound = kTolF32 * std::max(1.0, std::abs(lse[i]));
      EXPECT_NEAR(got_losses[i], losses[i], bound) << "loss of row " << i;
      lse_scale += std::max(1.0, std::abs(lse[i]));
    }
    const double sum = gsum.download()[0] - prior;
    EXPECT_NEAR(sum, total, kTolF32 * lse_scale + 1e-12);
    EXPECT_TRUE(gsum.guard_intact());
  };
  check_forward(dlosses, dlse, dsum);
  auto body = [&](const GuardedBuffer<bf16>& b) {
    const Vec all = download(b);
    return Vec(all.begin() + shift, all.begin() + shift + n);
  };
  const Vec g = body(dgrad);
  const double eg = rel_err(g, grad);
  EXPECT_LT(eg, kTolBf16Once) << "dlogits";
  std::printf("[ err ] cross_entropy N=%d V=%d shift=%d: dlogits rel err %.3e\n", N, V, shift, eg);
  EXPECT_TRUE(dgrad.guard_intact());
  auto check_ignored_rows = [&](const Vec& grads) {  // exact zeros
    for (int i = 0; i < N; ++i)
      if (targets[i] == cpu::kIgnoreIndex)
        for (int v = 0; v < V; ++v) ASSERT_EQ(grads[std::size_t(i) * V + v], 0.0) << "row " << i;
  };
  check_ignored_rows(g);

  // Forward and backward in one kernel, the gradient over the logits (the fused lm head's call).
  GuardedBuffer<bf16> fused(padded);
  GuardedBuffer<float> flosses(N), flse(N);
  GuardedBuffer<double> fsum(std::vector<double>{prior});
  fill_nan(flosses);
  fill_nan(flse);
  cuda::cross_entropy_forward_backward(flosses.get(), flse.get(), fused.get() + shift,
                                       dtargets.get(), scale, N, V, fsum.get(), nullptr);
  check_forward(flosses, flse, fsum);
  const Vec fg = body(fused);
  const double efg = rel_err(fg, grad);
  EXPECT_LT(efg, kTolBf16Once) << "fused dlogits";
  std::printf("[ err ] cross_entropy_forward_backward: dlogits rel err %.3e\n", efg);
  EXPECT_TRUE(fused.guard_intact() && flosses.guard_intact() && flse.guard_intact());
  check_ignored_rows(fg);

  // In place (dlogits = logits): the same bits.
  cuda::cross_entropy_backward(dlogits.get() + shift, dlogits.get() + shift, dlse.get(),
                               dtargets.get(), scale, N, V, nullptr);
  EXPECT_EQ(rel_err(body(dlogits), g), 0.0);
  EXPECT_TRUE(dlogits.guard_intact());
}

// Vocabulary-parallel (two tp ranks in one process: columns [0, V1) and [V1, V)): each rank's
// partial pass, the parts gathered on the host as NCCL's all-gather would, the finish and the
// backward over its columns give the whole vocabulary's loss, lse and gradient, the loss and
// lse the same bits on both ranks.
TEST_P(CudaCrossEntropy, VocabularyParallelMatchesCpu) {
  QT_REQUIRE_GPU();
  const auto [N, V, shift] = GetParam();
  if (V < 2) GTEST_SKIP() << "one column cannot be split";
  auto rng = test_rng();
  const std::size_t n = std::size_t(N) * V;
  const Bf16Input logits = random_bf16(n, rng, 3.0);
  std::uniform_int_distribution<int> pick(0, V - 1);
  std::vector<std::int32_t> targets(N);
  int counted = 0;
  for (int i = 0; i < N; ++i) {
    targets[i] = i % 5 == 2 ? cpu::kIgnoreIndex : pick(rng);
    counted += targets[i] != cpu::kIgnoreIndex;
  }
  const float scale = counted > 0 ? 1.0f / counted : 1.0f;
  Vec losses(N), lse(N), grad(n);
  const double total = cpu::cross_entropy_forward<double>(
      losses.data(), lse.data(), logits.value.data(), targets.data(), N, V);
  cpu::cross_entropy_backward<double>(grad.data(), logits.value.data(), lse.data(), targets.data(),
                                      double(scale), N, V);
  const int tp = 2, split = V / 2;
  const int first[2] = {0, split}, width[2] = {split, V - split};
  GuardedBuffer<std::int32_t> dtargets(targets);
  std::vector<std::unique_ptr<GuardedBuffer<bf16>>> dlogits;  // [tp] this rank's columns
  std::vector<float> parts;  // [tp, 2, N]
  for (int r = 0; r < tp; ++r) {
    std::vector<bf16> cols(std::size_t(N) * width[r]);
    for (int i = 0; i < N; ++i)
      for (int v = 0; v < width[r]; ++v)
        cols[std::size_t(i) * width[r] + v] = logits.bits[std::size_t(i) * V + first[r] + v];
    dlogits.push_back(std::make_unique<GuardedBuffer<bf16>>(cols));
    GuardedBuffer<float> part(2 * std::size_t(N));
    fill_nan(part);
    cuda::cross_entropy_vp_partial(part.get(), dlogits[r]->get(), dtargets.get(), N, width[r],
                                   first[r], nullptr);
    EXPECT_TRUE(part.guard_intact());
    const std::vector<float> p = part.download();
    parts.insert(parts.end(), p.begin(), p.end());
  }
  GuardedBuffer<float> dparts(parts);
  std::vector<std::vector<float>> got_lse, got_losses;
  Vec got_grad(n);
  double got_total = 0;
  const double prior = 1.5;
  for (int r = 0; r < tp; ++r) {
    GuardedBuffer<float> dlosses(N), dlse(N);
    GuardedBuffer<std::int32_t> dlocal(N);
    GuardedBuffer<double> dsum(std::vector<double>{prior});
    fill_nan(dlosses);
    fill_nan(dlse);
    cuda::cross_entropy_vp_finish(dlosses.get(), dlse.get(), dlocal.get(), dparts.get(), tp,
                                  dtargets.get(), N, width[r], first[r], dsum.get(), nullptr);
    cuda::cross_entropy_backward(dlogits[r]->get(), dlogits[r]->get(), dlse.get(), dlocal.get(),
                                 scale, N, width[r], nullptr);
    EXPECT_TRUE(dlosses.guard_intact() && dlse.guard_intact() && dlocal.guard_intact() &&
                dsum.guard_intact() && dlogits[r]->guard_intact());
    got_lse.push_back(dlse.download());
    got_losses.push_back(dlosses.download());
    got_total = dsum.download()[0] - prior;
    const Vec g = download(*dlogits[r]);
    for (int i = 0; i < N; ++i)
      for (int v = 0; v < width[r]; ++v)
        got_grad[std::size_t(i) * V + first[r] + v] = g[std::size_t(i) * width[r] + v];
  }
  EXPECT_EQ(got_lse[0], got_lse[1]) << "the ranks' lse differ";
  EXPECT_EQ(got_losses[0], got_losses[1]) << "the ranks' losses differ";
  double lse_scale = 0.0;
  for (int i = 0; i < N; ++i) {
    const double bound = kTolF32 * std::max(1.0, std::abs(lse[i]));
    EXPECT_NEAR(got_lse[0][i], lse[i], bound) << "lse of row " << i;
    if (targets[i] == cpu::kIgnoreIndex) {
      EXPECT_EQ(got_losses[0][i], 0.0f) << "ignored row " << i;
      for (int v = 0; v < V; ++v) ASSERT_EQ(got_grad[std::size_t(i) * V + v], 0.0) << "row " << i;
      continue;
    }
    EXPECT_NEAR(got_losses[0][i], losses[i], bound) << "loss of row " << i;
    lse_scale += std::max(1.0, std::abs(lse[i]));
  }
  EXPECT_NEAR(got_total, total, kTolF32 * lse_scale + 1e-12);
  const double eg = rel_err(got_grad, grad);
  EXPECT_LT(eg, kTolBf16Once) << "dlogits";
  std::printf("[ err ] vocabulary-parallel cross_entropy N=%d V=%d: dlogits rel err %.3e\n", N, V,
              eg);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaCrossEntropy,
                         // N 300 > the SMs' clusters: the fused kernel's clusters take
                         // several rows each (its row loop), as in training.
                         ::testing::Values(CeCase{6, 151936, 0}, CeCase{33, 1001, 0},
                                           CeCase{64, 4096, 0}, CeCase{300, 4096, 0},
                                           CeCase{5, 8, 0}, CeCase{4, 3, 0}, CeCase{9, 1000, 1}),
                         [](const auto& i) {
                           return "N" + std::to_string(i.param.N) + "_V" +
                                  std::to_string(i.param.V) + "_shift" +
                                  std::to_string(i.param.shift);
                         });

// ---------------------------------------------------------------------------------------------
// AdamW and the gradient norm

TEST(CudaAdamW, MatchesCpuAdamWBitForBit) {
  QT_REQUIRE_GPU();
  ModelConfig c;
  c.vocab_size = 1000;
  c.hidden_size = 64;
  c.intermediate_size = 136;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.tie_word_embeddings = false;
  const ParamLayout layout(c);
  OptimConfig o;
  o.lr = 1e-2;
  o.min_lr = 1e-3;
  o.warmup_steps = 2;
  o.weight_decay = 0.1;
  o.grad_clip = 1.0;
  const int steps = 5;
  MpiComm self(MPI_COMM_SELF, "self", false);
  ShardedState opt(plan_one_unit(layout, "model", MeshShape{}, 0), layout, o, self, steps);
  const std::size_t n = layout.numel();

  std::vector<cuda::AdamWSegment> segs;
  for (const ParamInfo& p : layout.params())
    segs.push_back({p.offset, p.offset + p.numel, p.weight_decay ? 1 : 0});
  const std::size_t seg_bytes = segs.size() * sizeof(cuda::AdamWSegment);
  GuardedBuffer<char> dsegs(seg_bytes);
  qt::cuda::upload(dsegs.get(), segs.data(), seg_bytes);
  const auto* seg_ptr = reinterpret_cast<const cuda::AdamWSegment*>(dsegs.get());

  auto rng = test_rng();
  std::vector<float> params = cast<float>(random_f32_exact(n, rng, 0.5));
  ASSERT_EQ(opt.param_pieces().size(), 1u);
  float* cpu_params = opt.param_pieces()[0].data;  // the driver's whole unit [n]
  std::copy(params.begin(), params.end(), cpu_params);
  // Two GPU copies: one updated by a single call, one by two calls split at an odd element (a
  // ZeRO-like range with an offset; the second part misaligned, so the scalar path runs).
  GuardedBuffer<float> p1(params), m1(n), v1(n), p2(params), m2(n), v2(n), dg(n);
  GuardedBuffer<bf16> b1(n), b2(n);
  GuardedBuffer<char> ws(cuda::grad_norm_workspace_bytes());
  GuardedBuffer<double> dnorm(1);
  const std::size_t split = n / 3 | 1;
  for (int t = 0; t < steps; ++t) {
    // Step 0's gradients are large, so clipping is active there.
    std::vector<float> g = cast<float>(random_f32_exact(n, rng, t == 0 ? 1.0 : 1e-3));
    dg.upload(g);
    cuda::grad_norm_squared(dnorm.get(), dg.get(), n, ws.get(), nullptr);
    opt.zero_grads();
    std::copy(g.begin(), g.end(), opt.grads(0));
    opt.grads_done(0);
    const OptimStepStats s = opt.step(t);
    params.assign(cpu_params, cpu_params + n);
    EXPECT_NEAR(std::sqrt(dnorm.download()[0]), s.grad_norm, 1e-10 * s.grad_norm);
    if (t == 0) EXPECT_LT(s.clip_scale, 1.0);
    cuda::AdamWStepArgs a;
    a.lr = s.lr;
    a.beta1 = o.beta1;
    a.beta2 = o.beta2;
    a.eps = o.eps;
    a.weight_decay = o.weight_decay;
    a.clip_scale = s.clip_scale;
    a.step = t + 1;
    cuda::adamw_step(p1.get(), b1.get(), m1.get(), v1.get(), dg.get(), n, 0, seg_ptr,
                     static_cast<int>(segs.size()), a, nullptr);
    cuda::adamw_step(p2.get(), b2.get(), m2.get(), v2.get(), dg.get(), split, 0, seg_ptr,
                     static_cast<int>(segs.size()), a, nullptr);
    cuda::adamw_step(p2.get() + split, b2.get() + split, m2.get() + split, v2.get() + split,
                     dg.get() + split, n - split, split, seg_ptr, static_cast<int>(segs.size()), a,
                     nullptr);
    const StateTargets held = opt.checkpoint_targets();
    const float* m_held = held.exp_avg[0].data;
    const float* v_held = held.exp_avg_sq[0].data;
    const std::vector<float> m_cpu(m_held, m_held + n), v_cpu(v_held, v_held + n);
    const std::vector<float> got = p1.download();
    EXPECT_TRUE(bitwise_equal(got, params)) << "step " << t << ": rel err " << rel_err(got, params);
    EXPECT_TRUE(bitwise_equal(m1.download(), m_cpu)) << "step " << t;
    EXPECT_TRUE(bitwise_equal(v1.download(), v_cpu)) << "step " << t;
    EXPECT_TRUE(bitwise_equal(p2.download(), got)) << "split update, step " << t;
    EXPECT_TRUE(bitwise_equal(m2.download(), m_cpu)) << "split update, step " << t;
    const std::vector<bf16> bf = b1.download(), bf2 = b2.download();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i)
      wrong += __bfloat162float(bf[i]) != __bfloat162float(__float2bfloat16_rn(got[i])) ||
               __bfloat162float(bf2[i]) != __bfloat162float(bf[i]);
    EXPECT_EQ(wrong, 0u) << "bf16 copy, step " << t;
  }
  for (const auto* b : {&p1, &m1, &v1, &p2, &m2, &v2}) EXPECT_TRUE(b->guard_intact());
  EXPECT_TRUE(b1.guard_intact());
  EXPECT_TRUE(b2.guard_intact());
  // Norm weights (no decay) and matrices (decay) both moved: the flags were applied per tensor.
  EXPECT_FALSE(layout.find("model.norm.weight").weight_decay);
}

TEST(CudaGradNorm, SumOfSquaresIsExactEnoughAndDeterministic) {
  QT_REQUIRE_GPU();
  auto rng = test_rng();
  for (const std::size_t n : {std::size_t(1), std::size_t(1000003), std::size_t(20000000)}) {
    for (const int shift : {0, 1}) {
      const std::vector<float> x = cast<float>(random_f32_exact(n + 1, rng, 0.01));
      double want = 0;
      for (std::size_t i = shift; i < shift + n; ++i) want += double(x[i]) * x[i];
      GuardedBuffer<float> dx(x);
      GuardedBuffer<char> ws(cuda::grad_norm_workspace_bytes());
      GuardedBuffer<double> out(1);
      fill_nan(out);
      cuda::grad_norm_squared(out.get(), dx.get() + shift, n, ws.get(), nullptr);
      const double got = out.download()[0];
      EXPECT_NEAR(got, want, 1e-10 * want) << "n " << n << " shift " << shift;
      const double again = cuda::grad_norm_squared_sync(dx.get() + shift, n, ws.get(), nullptr);
      EXPECT_EQ(std::memcmp(&got, &again, sizeof(double)), 0) << "not deterministic";
      EXPECT_TRUE(out.guard_intact());
      EXPECT_TRUE(ws.guard_intact());
    }
  }
}

}  // namespace
}  // namespace qt::test
