// The Qwen3-MoE block on the GPU against the CPU reference in double (ops/moe_router.h,
// ops/moe_experts.h) on the same bf16 inputs: the router (probabilities, top-k with exact ties,
// renormalised bf16 weights) and its backward with the load-balancing term, the device routing
// (counts, offsets, a stable permutation and its inverse, exactly), and CudaOps' whole block
// forward and backward over non-uniform routing in which some experts get no token (their
// gradients must be written as zeros), with the load statistics and the aux loss.
//
// The router's inputs are multiples of 1/8 (its logits are then exact sums in fp32 and round to
// the same bf16 on both sides), so both back ends route every token alike; the reference rounds
// the logits and the routing weights to bf16 where the GPU does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

#include "cuda/cuda_ops.h"
#include "cuda/device.h"
#include "cuda_op_check.h"
#include "ops/cuda/moe.cuh"
#include "ops/linear.h"
#include "ops/moe_capacity.h"
#include "ops/moe_experts.h"
#include "ops/moe_router.h"
#include "tiny_model.h"

namespace qt::test {
namespace {

// n values k/8, k uniform in [-m, m]: exact in bf16, their products exact in fp32.
Bf16Input eighths(std::size_t n, std::mt19937_64& rng, int m = 8) {
  std::uniform_int_distribution<int> d(-m, m);
  Bf16Input in{Vec(n), std::vector<bf16>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    in.value[i] = d(rng) / 8.0;
    in.bits[i] = to_bf16(in.value[i]);
  }
  return in;
}

Vec rounded(const Vec& v) {
  Vec r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = round_bf16(v[i]);
  return r;
}

struct RouterCase {
  int N, E, k;
  bool norm;
};

class CudaMoeRouter : public ::testing::TestWithParam<RouterCase> {};

TEST_P(CudaMoeRouter, ForwardAndBackwardMatchCpu) {
  QT_REQUIRE_GPU();
  const auto [N, E, k, norm] = GetParam();
  auto rng = test_rng();
  // Logits of few distinct values: many exact ties, broken towards the lower expert.
  Bf16Input logits = eighths(static_cast<std::size_t>(N) * E, rng, 12);
  GuardedBuffer<bf16> d_logits(logits.bits), d_w(static_cast<std::size_t>(N) * k);
  GuardedBuffer<float> d_probs(static_cast<std::size_t>(N) * E);
  GuardedBuffer<int> d_idx(static_cast<std::size_t>(N) * k);
  fill_nan(d_w);
  fill_nan(d_probs);
  cuda::moe_router_forward(d_probs.get(), d_idx.get(), d_w.get(), d_logits.get(), N, E, k, norm,
                           nullptr);
  Vec probs(static_cast<std::size_t>(N) * E), w(static_cast<std::size_t>(N) * k);
  std::vector<int> idx(w.size());
  cpu::router_forward<double>(probs.data(), idx.data(), w.data(), logits.value.data(), N, E, k,
                              norm);
  EXPECT_EQ(d_idx.download(), idx) << "top-k experts";
  QT_EXPECT_GPU_CLOSE(d_probs, probs, 1e-5);
  QT_EXPECT_GPU_CLOSE(d_w, w, kTolBf16Once);

  // Backward: d w and the balance of two layers' worth of these tokens.
  const Bf16Input dw_in = random_bf16(w.size(), rng);
  std::vector<float> dw_f(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) dw_f[i] = static_cast<float>(dw_in.value[i]);
  cpu::RouterBalance bal(E);
  cpu::router_balance_add<double>(bal, probs.data(), idx.data(), N, k);
  cpu::router_balance_add<double>(bal, probs.data(), idx.data(), N, k);
  const double coef = 0.25;
  Vec dlogits(probs.size());
  cpu::router_backward<double>(dlogits.data(), dw_in.value.data(), probs.data(), idx.data(), N, E,
                               k, norm);
  cpu::router_aux_backward<double>(dlogits.data(), bal, probs.data(), N, coef);
  GuardedBuffer<float> d_dw(dw_f);
  GuardedBuffer<double> d_count(bal.count);
  GuardedBuffer<bf16> d_dlogits(probs.size());
  fill_nan(d_dlogits);
  const float aux_scale = static_cast<float>(coef * E / (bal.tokens * bal.tokens));
  cuda::moe_router_backward(d_dlogits.get(), d_dw.get(), d_probs.get(), d_idx.get(),
                            d_count.get(), aux_scale, N, E, k, norm, nullptr);
  QT_EXPECT_GPU_CLOSE(d_dlogits, dlogits, kTolBf16);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaMoeRouter,
                         ::testing::Values(RouterCase{37, 8, 2, true}, RouterCase{64, 8, 2, false},
                                           RouterCase{300, 128, 8, true},
                                           RouterCase{9, 40, 32, true}, RouterCase{5, 3, 1, false}));

// Auxiliary-loss-free balancing's bias: the top-k of probs + bias, the weights the unbiased
// probabilities, as the CPU reference. Bias values are quarters, so exact ties (equal logits,
// equal bias) stay exact in fp32; a token whose k-th and (k+1)-th scores differ by less than
// 1e-5 (a near-tie fp32 and double may order differently) is not compared, and there must be
// few. A zero bias gives the bits of no bias.
TEST_P(CudaMoeRouter, BiasChoosesAsTheCpuAndKeepsUnbiasedWeights) {
  QT_REQUIRE_GPU();
  const auto [N, E, k, norm] = GetParam();
  auto rng = test_rng();
  Bf16Input logits = eighths(static_cast<std::size_t>(N) * E, rng, 12);
  std::uniform_int_distribution<int> q(-2, 2);
  std::vector<float> bias(static_cast<std::size_t>(E));
  for (float& b : bias) b = q(rng) / 4.0f;
  const Vec bias_d(bias.begin(), bias.end());
  GuardedBuffer<bf16> d_logits(logits.bits), d_w(static_cast<std::size_t>(N) * k),
      d_w0(d_w.size());
  GuardedBuffer<float> d_probs(static_cast<std::size_t>(N) * E), d_bias(bias),
      d_zero(std::vector<float>(bias.size(), 0.0f));
  GuardedBuffer<int> d_idx(static_cast<std::size_t>(N) * k), d_idx0(d_idx.size());
  fill_nan(d_w);
  cuda::moe_router_forward(d_probs.get(), d_idx.get(), d_w.get(), d_logits.get(), N, E, k, norm,
                           nullptr, d_bias.get());
  Vec probs(static_cast<std::size_t>(N) * E), w(static_cast<std::size_t>(N) * k);
  std::vector<int> idx(w.size());
  cpu::router_forward<double>(probs.data(), idx.data(), w.data(), logits.value.data(), N, E, k,
                              norm, bias_d.data());
  const std::vector<int> got = d_idx.download();
  int compared = 0, changed = 0;
  Vec w_sel, w_ref;  // the compared tokens' weights
  const Vec w_got = download(d_w);
  for (int t = 0; t < N; ++t) {
    std::vector<double> s(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e) s[e] = probs[static_cast<std::size_t>(t) * E + e] + bias_d[e];
    std::vector<double> sorted = s;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    bool near = false;
    for (int j = 0; j + 1 < E && j < k; ++j) {
      const double gap = sorted[j] - sorted[j + 1];
      near = near || (gap > 0 && gap < 1e-5);
    }
    if (near) continue;
    ++compared;
    for (int j = 0; j < k; ++j) {
      const std::size_t i = static_cast<std::size_t>(t) * k + j;
      EXPECT_EQ(got[i], idx[i]) << "token " << t << " slot " << j;
      w_sel.push_back(w_got[i]);
      w_ref.push_back(w[i]);
    }
  }
  // The bias must matter: some token's choice differs from the unbiased router's.
  Vec p0(probs.size()), w0(w.size());
  std::vector<int> idx0(idx.size());
  cpu::router_forward<double>(p0.data(), idx0.data(), w0.data(), logits.value.data(), N, E, k,
                              norm);
  for (std::size_t i = 0; i < idx.size(); ++i) changed += idx[i] != idx0[i];
  std::printf("N %d E %d k %d: %d of %d tokens compared, %d slots chosen otherwise than "
              "without the bias\n", N, E, k, compared, N, changed);
  EXPECT_GE(compared, N - std::max(1, N / 100));
  if (N * k >= 64) EXPECT_GT(changed, 0);
  QT_EXPECT_GPU_CLOSE(d_probs, probs, 1e-5);  // the probabilities never see the bias
  EXPECT_LT(rel_err(w_sel, w_ref), kTolBf16Once);

  // b = 0 is no bias, bit for bit.
  cuda::moe_router_forward(d_probs.get(), d_idx0.get(), d_w0.get(), d_logits.get(), N, E, k, norm,
                           nullptr, d_zero.get());
  cuda::moe_router_forward(d_probs.get(), d_idx.get(), d_w.get(), d_logits.get(), N, E, k, norm,
                           nullptr);
  EXPECT_EQ(d_idx0.download(), d_idx.download());
  EXPECT_EQ(download(d_w0), download(d_w));
}

class CudaMoeRoute : public ::testing::TestWithParam<int> {};  // tokens

TEST_P(CudaMoeRoute, GroupsPairsByExpertStably) {
  QT_REQUIRE_GPU();
  const int N = GetParam(), E = 16, k = 4, n = N * k;
  auto rng = test_rng();
  // Skewed: expert 0 most often, 3 and 7 never; a token's experts distinct.
  std::vector<int> idx(static_cast<std::size_t>(n));
  std::discrete_distribution<int> pick({40, 9, 5, 0, 8, 8, 8, 0, 3, 3, 3, 3, 2, 2, 1, 1});
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      int e;
      do e = pick(rng);
      while (std::find(&idx[t * k], &idx[t * k] + j, e) != &idx[t * k] + j);
      idx[t * k + j] = e;
    }
  std::vector<int> counts(E, 0), offsets(E + 1, 0), order(n);
  for (int e : idx) ++counts[e];
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  std::iota(order.begin(), order.end(), 0);  // the pairs by expert, in pair order within one
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return idx[a] < idx[b]; });
  std::vector<int> pos(n);
  for (int r = 0; r < n; ++r) pos[order[r]] = r;

  GuardedBuffer<int> d_idx(idx), d_counts(E), d_kept(E), d_offsets(E + 1), d_pos(n), d_pair(n);
  GuardedBuffer<double> d_bal(std::vector<double>(E, 1.0));
  GuardedBuffer<char> ws(cuda::moe_route_workspace_bytes(n, E));
  cuda::moe_route(d_counts.get(), d_kept.get(), d_offsets.get(), d_pos.get(), d_pair.get(),
                  d_bal.get(), d_idx.get(), n, E, cuda::kMoeDropless, ws.get(), nullptr);
  EXPECT_EQ(d_counts.download(), counts);
  EXPECT_EQ(d_kept.download(), counts);
  EXPECT_EQ(d_offsets.download(), offsets);
  EXPECT_EQ(d_pos.download(), pos);
  EXPECT_EQ(d_pair.download(), order);
  const std::vector<double> bal = d_bal.download();
  for (int e = 0; e < E; ++e) EXPECT_EQ(bal[e], 1.0 + counts[e]) << "expert " << e;
  for (auto* b : {&d_counts, &d_kept, &d_offsets, &d_pos, &d_pair}) EXPECT_TRUE(b->guard_intact());

  // With a capacity C each expert keeps its first C pairs in pair order (capacity_keep, the CPU
  // rule): kept rows packed by expert, dropped pairs at pos -1, the rows past them pair -1; the
  // counts and the balance stay the routed ones.
  const int C = std::max(1, N / 4);
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(n));
  const long dropped = cpu::capacity_keep(keep.data(), idx.data(), N, k, E, C);
  std::vector<int> kept(E), kept_offsets(E + 1, 0), kept_pos(n, -1), kept_pair(n, -1);
  for (int e = 0; e < E; ++e) kept[e] = std::min(counts[e], C);
  for (int e = 0; e < E; ++e) kept_offsets[e + 1] = kept_offsets[e] + kept[e];
  for (int r = 0, next = 0; r < n; ++r)  // order: by expert, pair order within one
    if (keep[order[r]]) kept_pos[order[r]] = next, kept_pair[next++] = order[r];
  cuda::moe_route(d_counts.get(), d_kept.get(), d_offsets.get(), d_pos.get(), d_pair.get(),
                  d_bal.get(), d_idx.get(), n, E, C, ws.get(), nullptr);
  std::printf("[ cap ] N %d, capacity %d: %ld of %d pairs dropped\n", N, C, dropped, n);
  EXPECT_EQ(d_counts.download(), counts);
  EXPECT_EQ(d_kept.download(), kept);
  EXPECT_EQ(d_offsets.download(), kept_offsets);
  EXPECT_EQ(d_pos.download(), kept_pos);
  EXPECT_EQ(d_pair.download(), kept_pair);
  if (N >= 64) EXPECT_GT(dropped, 0) << "the skewed load must overflow the capacity";
  GuardedBuffer<double> d_dropped(std::vector<double>{3.0});
  cuda::moe_dropped_add(d_dropped.get(), d_counts.get(), d_kept.get(), E, nullptr);
  EXPECT_EQ(d_dropped.download()[0], 3.0 + dropped);
  for (auto* b : {&d_counts, &d_kept, &d_offsets, &d_pos, &d_pair}) EXPECT_TRUE(b->guard_intact());
}

INSTANTIATE_TEST_SUITE_P(Tokens, CudaMoeRoute, ::testing::Values(1, 63, 64, 1000));

// CudaOps' block: forward, backward (written, then accumulated), statistics and aux loss.
struct BlockCase {
  int B, T, H, E, k, Im;
  bool norm;
  double capacity_factor = 0;  // model.moe_capacity_factor (0: dropless)
};

class CudaMoeBlock : public ::testing::TestWithParam<BlockCase> {};

TEST_P(CudaMoeBlock, ForwardBackwardAndStatisticsMatchCpu) {
  QT_REQUIRE_GPU();
  const auto [B, T, H, E, k, Im, norm, factor] = GetParam();
  ModelConfig c = tiny_model(2, 1, 64, true);
  c.hidden_size = H;
  c.num_layers = 1;
  c.num_experts = E;
  c.num_experts_per_tok = k;
  c.moe_intermediate_size = Im;
  c.norm_topk_prob = norm;
  c.moe_capacity_factor = factor;
  ASSERT_TRUE(c.is_moe_layer(0));
  const int N = B * T;
  const std::size_t NH = static_cast<std::size_t>(N) * H, NE = static_cast<std::size_t>(N) * E;
  const std::size_t NK = static_cast<std::size_t>(N) * k;
  auto rng = test_rng();
  // x column 0 is 1 for every token; the router's column 0 pushes expert 0 up and the last two
  // experts far down: uneven loads, and two experts without a token.
  Bf16Input x = eighths(NH, rng, 6), router = eighths(static_cast<std::size_t>(E) * H, rng, 2);
  for (int t = 0; t < N; ++t) x.value[t * H] = 1.0, x.bits[t * H] = to_bf16(1.0);
  for (int e = 0; e < E; ++e) {
    const double v = e == 0 ? 2.0 : e >= E - 2 ? -40.0 : 0.0;
    router.value[e * H] = v;
    router.bits[e * H] = to_bf16(v);
  }
  const Bf16Input gate_up = random_bf16(static_cast<std::size_t>(E) * 2 * Im * H, rng, 0.1);
  const Bf16Input down = random_bf16(static_cast<std::size_t>(E) * H * Im, rng, 0.1);
  const Bf16Input dy = random_bf16(NH, rng);
  const double aux_coef = 0.5;

  // The reference: logits and routing weights rounded to bf16 where the GPU rounds them.
  Vec logits(NE), probs(NE), w(NK), y(NH);
  std::vector<int> idx(NK);
  cpu::linear_forward<double>(logits.data(), x.value.data(), router.value.data(), N, H, E);
  logits = rounded(logits);
  cpu::router_forward<double>(probs.data(), idx.data(), w.data(), logits.data(), N, E, k, norm);
  const Vec wb = rounded(w);
  // The capacity's drops (none when dropless): the pairs past each expert's first C.
  std::vector<std::uint8_t> keep(NK, 1);
  const long dropped = cpu::capacity_keep(keep.data(), idx.data(), N, k, E,
                                          expert_capacity(N, k, E, factor));
  cpu::moe_experts_forward<double>(y.data(), x.value.data(), idx.data(), wb.data(),
                                   gate_up.value.data(), down.value.data(), N, H, Im, E, k,
                                   keep.data());
  cpu::RouterBalance bal(E);
  cpu::router_balance_add<double>(bal, probs.data(), idx.data(), N, k);
  const double aux = cpu::router_aux_loss(bal);
  Vec dx(NH), dw(NK), dgu(gate_up.value.size(), 0.0), ddown(down.value.size(), 0.0);
  Vec dlogits(NE), dx_gate(NH), drouter(router.value.size(), 0.0);
  cpu::moe_experts_backward<double>(dx.data(), dw.data(), dgu.data(), ddown.data(),
                                    dy.value.data(), x.value.data(), idx.data(), wb.data(),
                                    gate_up.value.data(), down.value.data(), N, H, Im, E, k,
                                    keep.data());
  cpu::router_backward<double>(dlogits.data(), dw.data(), probs.data(), idx.data(), N, E, k, norm);
  cpu::router_aux_backward<double>(dlogits.data(), bal, probs.data(), N, aux_coef);
  cpu::linear_backward<double>(dx_gate.data(), drouter.data(), dlogits.data(), x.value.data(),
                               router.value.data(), N, H, E);
  for (std::size_t i = 0; i < NH; ++i) dx[i] += dx_gate[i];
  std::vector<int> load(E, 0);
  for (int e : idx) ++load[e];
  ASSERT_EQ(load[E - 1] + load[E - 2], 0) << "the test wants experts without tokens";
  ASSERT_GT(load[0], N / 2) << "the test wants uneven loads";

  cuda::DeviceArena arena(std::size_t{512} << 20, "test arena");
  cuda::CudaOps ops(c, B, T, arena);
  cuda::Stream stream;
  ops.begin(stream.get(), nullptr);
  ops.set_moe_aux_scale(static_cast<float>(aux_coef));
  GuardedBuffer<bf16> d_x(x.bits), d_router(router.bits), d_gu(gate_up.bits), d_down(down.bits);
  GuardedBuffer<bf16> d_dy(dy.bits), d_y(NH), d_rw(NK), d_dx(NH);
  GuardedBuffer<float> d_probs(NE), g_router(drouter.size()), g_gu(dgu.size()), g_down(ddown.size());
  GuardedBuffer<int> d_idx(NK);
  for (auto* b : {&d_y, &d_rw, &d_dx}) fill_nan(*b);
  for (auto* b : {&d_probs, &g_router, &g_gu, &g_down}) fill_nan(*b);
  ops.moe_begin();
  ops.moe(0, d_y.get(), d_probs.get(), d_idx.get(), d_rw.get(), d_x.get(), d_router.get(),
          d_gu.get(), d_down.get(), true);
  // A recomputing forward adds nothing to the statistics.
  ops.moe(0, d_y.get(), d_probs.get(), d_idx.get(), d_rw.get(), d_x.get(), d_router.get(),
          d_gu.get(), d_down.get(), false);
  ops.moe_backward(0, d_dx.get(), g_router.get(), g_gu.get(), g_down.get(), d_dy.get(), d_x.get(),
                   d_probs.get(), d_idx.get(), d_rw.get(), d_router.get(), d_gu.get(),
                   d_down.get(), /*acc=*/false);
  stream.synchronize();
  EXPECT_EQ(d_idx.download(), idx);
  QT_EXPECT_GPU_CLOSE(d_probs, probs, 1e-5);
  QT_EXPECT_GPU_CLOSE(d_rw, w, kTolBf16Once);
  QT_EXPECT_GPU_CLOSE(d_y, y, kTolBf16);
  QT_EXPECT_GPU_CLOSE(d_dx, dx, kTolBf16Model);
  QT_EXPECT_GPU_CLOSE(g_router, drouter, kTolBf16Model);
  QT_EXPECT_GPU_CLOSE(g_gu, dgu, kTolBf16Model);
  QT_EXPECT_GPU_CLOSE(g_down, ddown, kTolBf16Model);
  const double aux_gpu = ops.moe_aux_loss();
  std::printf("[ err ] aux loss cpu %.6f cuda %.6f (k = %d when balanced)\n", aux, aux_gpu, k);
  EXPECT_NEAR(aux_gpu, aux, 1e-5 * aux);
  const std::vector<double>& got_load = ops.moe_load();
  ASSERT_EQ(got_load.size(), static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) EXPECT_EQ(got_load[e], load[e]) << "expert " << e;
  std::printf("[ cap ] capacity factor %.2f: %ld of %zu pairs dropped\n", factor, dropped, NK);
  if (factor > 0) EXPECT_GT(dropped, 0) << "the test wants the capacity to drop pairs";
  EXPECT_EQ(ops.moe_dropped(), std::vector<double>{static_cast<double>(dropped)});
  // Experts without a token: gradients written as zeros (not left as NaN).
  const std::vector<float> gd = g_down.download();
  for (std::size_t i = (E - 2) * static_cast<std::size_t>(H) * Im; i < gd.size(); ++i)
    ASSERT_EQ(gd[i], 0.0f) << i;

  // acc = true adds: the same gradients again give twice the reference.
  ops.moe_backward(0, d_dx.get(), g_router.get(), g_gu.get(), g_down.get(), d_dy.get(), d_x.get(),
                   d_probs.get(), d_idx.get(), d_rw.get(), d_router.get(), d_gu.get(),
                   d_down.get(), /*acc=*/true);
  stream.synchronize();
  for (Vec* v : {&drouter, &dgu, &ddown})
    for (double& a : *v) a *= 2;
  QT_EXPECT_GPU_CLOSE(g_router, drouter, kTolBf16Model);
  QT_EXPECT_GPU_CLOSE(g_gu, dgu, kTolBf16Model);
  QT_EXPECT_GPU_CLOSE(g_down, ddown, kTolBf16Model);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaMoeBlock,
                         ::testing::Values(BlockCase{2, 48, 128, 8, 2, 64, true},
                                           BlockCase{1, 100, 64, 16, 4, 32, false},
                                           BlockCase{2, 64, 60, 6, 3, 40, true},
                                           BlockCase{2, 48, 128, 8, 2, 64, true, 1.0},
                                           BlockCase{1, 100, 64, 16, 4, 32, false, 1.25}));

}  // namespace
}  // namespace qt::test
