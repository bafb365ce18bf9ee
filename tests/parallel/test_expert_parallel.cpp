// Expert parallelism on the CPU reference (parallel/expert_parallel.h), under mpiexec -n 2 and
// -n 4: the sparse block with its experts split over the ranks gives each rank's tokens the
// serial block's output and input gradient, each rank its router's gradient, and each rank's
// experts the gradient the serial block gives them over every rank's tokens; with the
// load-balancing loss, norm_topk_prob on and off, and with a capacity factor that drops pairs
// (each rank deciding its own tokens' drops before the exchange, as the serial block does
// over them; a rank then receives at most E C rows). Fresh random inputs (the seed is printed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "ops/moe_block.h"
#include "parallel/expert_parallel.h"
#include "qtrain/comm.h"
#include "support/compare.h"
#include "support/random.h"

namespace qt {
namespace {

using test::rel_error;

// capacity_factor 0.5: C = ceil(0.5 x 3 N / 4P) and E C < 3 N (N from 10 to 13, P 2 or 4), so
// every rank drops pairs whatever the routing.
void check(bool norm_topk, bool aux, double capacity_factor = 0) {
  MpiComm world(MPI_COMM_WORLD, "ep", false);
  const int P = world.size(), r = world.rank();
  const int E = 4 * P, k = 3, H = 16, Im = 8, N = 10 + r;  // ranks route different counts
  const cpu::MoeShape s{N, H, Im, E, k, norm_topk, capacity_factor};
  std::uint64_t seed = test::test_seed();
  world.broadcast(&seed, 1, DType::kU64, 0);
  std::mt19937_64 shared(seed), own(seed + 1 + r);
  // The model is the same on every rank; the tokens are each rank's own.
  const auto gate = test::random_vector<float>(static_cast<std::size_t>(E) * H, shared, 0.5);
  const auto gate_up = test::random_vector<float>(static_cast<std::size_t>(E) * 2 * Im * H, shared, 0.3);
  const auto down = test::random_vector<float>(static_cast<std::size_t>(E) * H * Im, shared, 0.3);
  const auto x = test::random_vector<float>(static_cast<std::size_t>(N) * H, own);
  const auto dy = test::random_vector<float>(static_cast<std::size_t>(N) * H, own);
  const std::size_t NH = static_cast<std::size_t>(N) * H, NK = static_cast<std::size_t>(N) * k;

  // Serial: every expert here; the expert gradients then summed over the ranks' tokens.
  std::vector<float> y_ref(NH), probs(static_cast<std::size_t>(N) * E), w(NK), dx_ref(NH);
  std::vector<int> idx(NK);
  std::vector<float> dgate_ref(gate.size()), dgu_ref(gate_up.size()), ddown_ref(down.size());
  const long dropped_ref = cpu::moe_block_forward(y_ref.data(), probs.data(), idx.data(),
                                                  w.data(), x.data(), gate.data(),
                                                  gate_up.data(), down.data(), s);
  cpu::RouterBalance balance(E);
  cpu::router_balance_add(balance, probs.data(), idx.data(), N, k);
  const float coef = aux ? 0.05f : 0.0f;
  cpu::moe_block_backward(dx_ref.data(), dgate_ref.data(), dgu_ref.data(), ddown_ref.data(),
                          dy.data(), x.data(), probs.data(), idx.data(), w.data(), gate.data(),
                          gate_up.data(), down.data(), s, aux ? &balance : nullptr, coef);
  world.all_reduce(dgu_ref.data(), dgu_ref.size(), DType::kF32, ReduceOp::kSum);
  world.all_reduce(ddown_ref.data(), ddown_ref.size(), DType::kF32, ReduceOp::kSum);

  // Expert parallel: this rank's rows of the expert tensors.
  ExpertDispatch dispatch(world, E, H, Im);
  const int El = dispatch.local_experts(), first = dispatch.first_expert();
  ASSERT_EQ(El * P, E);
  const std::size_t gu_rows = static_cast<std::size_t>(2) * Im * H, dn_rows = static_cast<std::size_t>(H) * Im;
  const std::vector<float> gu_mine(gate_up.begin() + first * gu_rows, gate_up.begin() + (first + El) * gu_rows);
  const std::vector<float> dn_mine(down.begin() + first * dn_rows, down.begin() + (first + El) * dn_rows);
  std::vector<float> y(NH), probs2(probs.size()), w2(NK), slot_out(NK * H), dx(NH);
  std::vector<int> idx2(NK);
  std::vector<float> dgate(gate.size()), dgu(gu_mine.size()), ddown(dn_mine.size());
  const long dropped = moe_block_forward_ep(y.data(), probs2.data(), idx2.data(), w2.data(),
                                            slot_out.data(), x.data(), gate.data(),
                                            gu_mine.data(), dn_mine.data(), s, dispatch);
  EXPECT_EQ(idx2, idx);
  EXPECT_EQ(dropped, dropped_ref);
  if (capacity_factor > 0) {
    EXPECT_GT(dropped, 0);
    // This rank received every source's kept rows for its experts, at most E C of the largest
    // source's C.
    const std::vector<std::uint8_t> keep = cpu::moe_capacity_keep(idx.data(), s);
    std::vector<std::int64_t> to_rank(P, 0);
    for (std::size_t p = 0; p < NK; ++p)
      if (keep[p]) ++to_rank[idx[p] / El];
    world.all_reduce(to_rank.data(), P, DType::kI64, ReduceOp::kSum);
    std::int64_t bound = std::int64_t{E} * expert_capacity(N, k, E, capacity_factor);
    world.all_reduce(&bound, 1, DType::kI64, ReduceOp::kMax);
    const auto received = static_cast<std::int64_t>(dispatch.received_rows());
    EXPECT_EQ(received, to_rank[r]);
    EXPECT_LE(received, bound);
  } else {
    EXPECT_EQ(dropped, 0);
  }
  moe_block_backward_ep(dx.data(), dgate.data(), dgu.data(), ddown.data(), dy.data(), x.data(),
                        probs2.data(), idx2.data(), w2.data(), slot_out.data(), gate.data(),
                        gu_mine.data(), dn_mine.data(), s, dispatch, aux ? &balance : nullptr,
                        coef);
  const std::vector<float> dgu_want(dgu_ref.begin() + first * gu_rows, dgu_ref.begin() + (first + El) * gu_rows);
  const std::vector<float> ddown_want(ddown_ref.begin() + first * dn_rows, ddown_ref.begin() + (first + El) * dn_rows);
  const double e_y = rel_error(y, y_ref), e_dx = rel_error(dx, dx_ref);
  const double e_gate = rel_error(dgate, dgate_ref), e_gu = rel_error(dgu, dgu_want);
  const double e_down = rel_error(ddown, ddown_want);
  if (r == 0)
    std::printf("ep %d, norm_topk %d, aux %d, capacity factor %g (%ld pairs dropped on rank 0): "
                "rel err y %.2e, dx %.2e, d router %.2e, d gate_up %.2e, d down %.2e\n", P,
                norm_topk, aux, capacity_factor, dropped, e_y, e_dx, e_gate, e_gu, e_down);
  EXPECT_LT(e_y, 1e-6);
  EXPECT_LT(e_dx, 1e-5);
  EXPECT_LT(e_gate, 1e-5);
  EXPECT_LT(e_gu, 1e-5);
  EXPECT_LT(e_down, 1e-5);
}

TEST(ExpertParallel, BlockMatchesTheSerialBlock) {
  check(true, false);
  check(true, true);
  check(false, true);
}

TEST(ExpertParallel, BlockWithCapacityMatchesTheSerialBlock) {
  check(true, true, 0.5);
  check(false, false, 0.5);
}

}  // namespace
}  // namespace qt
