// The receiving side of expert-parallel dispatch on the GPU (ops/cuda/moe_ep.cuh) against a CPU
// reference that lists every received row: from random routing counts of an ep group (some
// experts and whole sources sending nothing, and a rank receiving no row at all), the local
// experts' offsets and both maps between received and expert order must match exactly, and
// moe_permute with k = 1 over those maps must move random bf16 rows to expert order and back
// bit for bit. Guard bytes after every output catch writes past its end.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "cuda_op_check.h"
#include "gpu_test.h"
#include "ops/cuda/moe.cuh"
#include "ops/cuda/moe_ep.cuh"

namespace qt::test {
namespace {

std::uint16_t bits(bf16 v) {
  std::uint16_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

struct EpCase {
  int P, E, H;
  double empty;  // the share of (source, expert) counts that are zero
};

struct Reference {
  std::vector<int> offsets, to_expert, from_expert;
};

// counts [P, E]: rank p's rows for each global expert. Rank r receives, source by source and
// within a source expert by expert, counts[p, r El + e] rows; expert order lists them expert by
// expert, then source by source.
Reference reference(const std::vector<int>& counts, int P, int E, int r) {
  const int El = E / P;
  struct Row {
    int e, p, c;
  };
  std::vector<Row> received;
  for (int p = 0; p < P; ++p)
    for (int e = 0; e < El; ++e)
      for (int c = 0; c < counts[static_cast<std::size_t>(p) * E + r * El + e]; ++c)
        received.push_back({e, p, c});
  std::vector<int> order(received.size());
  for (std::size_t j = 0; j < order.size(); ++j) order[j] = static_cast<int>(j);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return std::tie(received[a].e, received[a].p) < std::tie(received[b].e, received[b].p);
  });
  Reference ref;
  ref.to_expert.resize(received.size());
  ref.from_expert = order;  // expert-order row i is received row order[i]
  for (std::size_t i = 0; i < order.size(); ++i) ref.to_expert[order[i]] = static_cast<int>(i);
  ref.offsets.assign(El + 1, 0);
  for (const Row& x : received) ++ref.offsets[x.e + 1];
  for (int e = 0; e < El; ++e) ref.offsets[e + 1] += ref.offsets[e];
  return ref;
}

class CudaMoeEp : public ::testing::TestWithParam<EpCase> {};

TEST_P(CudaMoeEp, ReceiveOrderAndPermutationMatchCpu) {
  QT_REQUIRE_GPU();
  const auto [P, E, H, empty] = GetParam();
  auto rng = test_rng();
  std::uniform_int_distribution<int> count(1, 9);
  std::bernoulli_distribution zero(empty);
  std::vector<int> counts(static_cast<std::size_t>(P) * E);
  for (int& c : counts) c = zero(rng) ? 0 : count(rng);
  const int El = E / P;
  // Rank P - 1 receives nothing (when P > 1): every source sends its experts no row.
  if (P > 1)
    for (int p = 0; p < P; ++p)
      for (int e = 0; e < El; ++e) counts[static_cast<std::size_t>(p) * E + (P - 1) * El + e] = 0;
  GuardedBuffer<int> d_counts(counts);
  GuardedBuffer<int> segments(2 * static_cast<std::size_t>(E));
  for (int r = 0; r < P; ++r) {
    const Reference ref = reference(counts, P, E, r);
    const int R = static_cast<int>(ref.to_expert.size());
    GuardedBuffer<int> offsets(El + 1), to(R), from(R);
    cuda::moe_ep_recv_order(offsets.get(), to.get(), from.get(), d_counts.get(), P, E, r, R,
                      segments.get(), nullptr);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(offsets.download(), ref.offsets) << "rank " << r;
    EXPECT_EQ(to.download(), ref.to_expert) << "rank " << r;
    EXPECT_EQ(from.download(), ref.from_expert) << "rank " << r;
    EXPECT_TRUE(offsets.guard_intact() && to.guard_intact() && from.guard_intact() &&
                segments.guard_intact())
        << "rank " << r;
    if (P > 1 && r == P - 1) EXPECT_EQ(R, 0);
    if (R == 0) continue;
    // Rows to expert order and back: a gather each way, exact.
    std::vector<bf16> x(static_cast<std::size_t>(R) * H);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (bf16& v : x) v = to_bf16(normal(rng));
    GuardedBuffer<bf16> d_x(x), d_exp(x.size()), d_back(x.size());
    cuda::moe_permute(d_exp.get(), d_x.get(), from.get(), R, 1, H, nullptr);
    cuda::moe_permute(d_back.get(), d_exp.get(), to.get(), R, 1, H, nullptr);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
    const std::vector<bf16> got = d_exp.download(), back = d_back.download();
    int wrong = 0;
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < H; ++c) {
        const std::size_t src = static_cast<std::size_t>(ref.from_expert[i]) * H + c;
        wrong += bits(got[static_cast<std::size_t>(i) * H + c]) != bits(x[src]);
      }
    EXPECT_EQ(wrong, 0) << "rank " << r << ": rows out of expert order";
    int lost = 0;
    for (std::size_t i = 0; i < x.size(); ++i) lost += bits(back[i]) != bits(x[i]);
    EXPECT_EQ(lost, 0) << "rank " << r << ": expert order and back is not the identity";
    EXPECT_TRUE(d_exp.guard_intact() && d_back.guard_intact()) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaMoeEp,
                         ::testing::Values(EpCase{1, 4, 64, 0.2}, EpCase{2, 8, 128, 0.3},
                                           EpCase{4, 16, 72, 0.5}, EpCase{3, 6, 40, 0.0},
                                           EpCase{8, 128, 256, 0.4}, EpCase{8, 1024, 16, 0.9}));

}  // namespace
}  // namespace qt::test
