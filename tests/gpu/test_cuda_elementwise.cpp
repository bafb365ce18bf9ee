// CUDA SwiGLU, embedding and precision conversions against the CPU ops (double, or float where
// the GPU must match bit for bit) on the same bf16 inputs: NaN-filled outputs, guard bytes,
// tails that are not a whole 16-byte vector, misaligned pointers (the scalar paths), aliases,
// and the deterministic embedding backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cuda_op_check.h"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/embedding.cuh"
#include "ops/cuda/swiglu.cuh"
#include "ops/embedding.h"
#include "ops/swiglu.h"

namespace qt::test {
namespace {

// ---------------------------------------------------------------------------------------------
// swiglu

struct SwigluCase {
  int N, I;
  int shift;  // elements by which every pointer is moved off 16-byte alignment (0: aligned)
};

class CudaSwiglu : public ::testing::TestWithParam<SwigluCase> {};

TEST_P(CudaSwiglu, ForwardAndBackwardMatchCpu) {
  QT_REQUIRE_GPU();
  const auto [N, I, shift] = GetParam();
  const std::size_t n = std::size_t(N) * I;
  auto rng = test_rng();
  Bf16Input g = random_bf16(n, rng, 3.0);
  const Bf16Input u = random_bf16(n, rng), dh = random_bf16(n, rng);
  if (n > 2) {  // saturated gates: silu -> 0 and silu -> g must stay finite
    g.bits[0] = to_bf16(-200.0), g.value[0] = from_bf16(g.bits[0]);
    g.bits[1] = to_bf16(200.0), g.value[1] = from_bf16(g.bits[1]);
  }
  // Buffers kSlack elements longer, so that the op can be pointed at element `shift`.
  constexpr int kSlack = 8;
  ASSERT_LT(shift, kSlack);
  auto padded = [&](const std::vector<bf16>& v) {
    std::vector<bf16> p(v.size() + kSlack, to_bf16(0.0));
    std::copy(v.begin(), v.end(), p.begin() + shift);
    return p;
  };
  GuardedBuffer<bf16> dg(padded(g.bits)), du(padded(u.bits)), ddh(padded(dh.bits));
  GuardedBuffer<bf16> dh_out(n + kSlack), ddg(n + kSlack), ddu(n + kSlack);
  fill_nan(dh_out);
  fill_nan(ddg);
  fill_nan(ddu);
  cuda::swiglu_forward(dh_out.get() + shift, dg.get() + shift, du.get() + shift, N, I, nullptr);
  cuda::swiglu_backward(ddg.get() + shift, ddu.get() + shift, ddh.get() + shift, dg.get() + shift,
                        du.get() + shift, N, I, nullptr);
  auto body = [&](const GuardedBuffer<bf16>& b) {
    const Vec all = download(b);
    return Vec(all.begin() + shift, all.begin() + shift + n);
  };
  Vec h(n), dgate(n), dup(n);
  cpu::swiglu_forward<double>(h.data(), g.value.data(), u.value.data(), N, I);
  cpu::swiglu_backward<double>(dgate.data(), dup.data(), dh.value.data(), g.value.data(),
                               u.value.data(), N, I);
  const double eh = rel_err(body(dh_out), h), eg = rel_err(body(ddg), dgate),
               eu = rel_err(body(ddu), dup);
  EXPECT_LT(eh, kTolBf16) << "h";          // bf16(silu), then the product
  EXPECT_LT(eg, kTolBf16Once) << "dgate";  // fp32 math, one rounding
  EXPECT_LT(eu, kTolBf16) << "dup";        // times bf16(silu): two roundings
  std::printf("[ err ] swiglu N=%d I=%d shift=%d: h %.3e dgate %.3e dup %.3e\n", N, I, shift, eh,
              eg, eu);
  for (const auto* b : {&dh_out, &ddg, &ddu}) {  // nothing written outside [shift, shift + n)
    EXPECT_TRUE(b->guard_intact());
    const Vec all = download(*b);
    for (std::size_t i = 0; i < all.size(); ++i)
      if (i < std::size_t(shift) || i >= shift + n) EXPECT_TRUE(std::isnan(all[i])) << i;
  }

  // Outputs aliasing the inputs (dgate = gate, dup = up): the same bits.
  cuda::swiglu_backward(dg.get() + shift, du.get() + shift, ddh.get() + shift, dg.get() + shift,
                        du.get() + shift, N, I, nullptr);
  EXPECT_EQ(rel_err(body(dg), body(ddg)), 0.0);
  EXPECT_EQ(rel_err(body(du), body(ddu)), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSwiglu,
                         ::testing::Values(SwigluCase{37, 300, 0}, SwigluCase{64, 3072, 0},
                                           SwigluCase{1, 7, 0}, SwigluCase{13, 101, 1},
                                           SwigluCase{16, 64, 3}),
                         [](const auto& i) {
                           return "N" + std::to_string(i.param.N) + "_I" +
                                  std::to_string(i.param.I) + "_shift" +
                                  std::to_string(i.param.shift);
                         });

// The strided forms (gate and up as the two halves of one [N, ld] buffer, as the model uses them)
// give the same bits as the contiguous op, and leave the columns past 2I untouched.
struct StridedSwigluCase {
  int N, I, ld;
};

class CudaSwigluStrided : public ::testing::TestWithParam<StridedSwigluCase> {};

std::uint16_t raw_bits(bf16 v) {
  std::uint16_t u;
  std::memcpy(&u, &v, 2);
  return u;
}
bool same_bits(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0;
}

TEST_P(CudaSwigluStrided, MatchesContiguousBitForBit) {
  QT_REQUIRE_GPU();
  const auto [N, I, ld] = GetParam();
  const std::size_t n = std::size_t(N) * I;
  auto rng = test_rng();
  const Bf16Input g = random_bf16(n, rng, 3.0), u = random_bf16(n, rng), dh = random_bf16(n, rng);
  const bf16 nan_bits = to_bf16(std::numeric_limits<double>::quiet_NaN());
  std::vector<bf16> packed(std::size_t(N) * ld, nan_bits);  // rows [gate | up | NaN padding]
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < I; ++c) {
      packed[std::size_t(r) * ld + c] = g.bits[std::size_t(r) * I + c];
      packed[std::size_t(r) * ld + I + c] = u.bits[std::size_t(r) * I + c];
    }
  GuardedBuffer<bf16> dg(g.bits), du(u.bits), ddh(dh.bits), dgu(packed);
  GuardedBuffer<bf16> h_ref(n), dg_ref(n), du_ref(n), h(n);
  cuda::swiglu_forward(h_ref.get(), dg.get(), du.get(), N, I, nullptr);
  cuda::swiglu_backward(dg_ref.get(), du_ref.get(), ddh.get(), dg.get(), du.get(), N, I, nullptr);
  fill_nan(h);
  cuda::swiglu_forward_strided(h.get(), dgu.get(), dgu.get() + I, ld, N, I, nullptr);
  EXPECT_TRUE(same_bits(h.download(), h_ref.download())) << "h";
  // Backward in place over the packed buffer, as the model runs it.
  cuda::swiglu_backward_strided(dgu.get(), dgu.get() + I, ddh.get(), dgu.get(), dgu.get() + I, ld,
                                N, I, nullptr);
  const std::vector<bf16> out = dgu.download(), want_g = dg_ref.download(),
                          want_u = du_ref.download();
  std::size_t bad = 0, padding_touched = 0;
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < ld; ++c) {
      const bf16 v = out[std::size_t(r) * ld + c];
      if (c < I)
        bad += raw_bits(v) != raw_bits(want_g[std::size_t(r) * I + c]);
      else if (c < 2 * I)
        bad += raw_bits(v) != raw_bits(want_u[std::size_t(r) * I + c - I]);
      else
        padding_touched += !std::isnan(__bfloat162float(v));
    }
  EXPECT_EQ(bad, 0u) << "dgate/dup differ from the contiguous op";
  EXPECT_EQ(padding_touched, 0u) << "columns past 2I were written";
  EXPECT_TRUE(dgu.guard_intact());
  EXPECT_TRUE(h.guard_intact());
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSwigluStrided,
                         ::testing::Values(StridedSwigluCase{37, 296, 592},   // vector path
                                           StridedSwigluCase{5, 64, 136},     // vector, padded
                                           StridedSwigluCase{13, 101, 205}),  // scalar path
                         [](const auto& i) {
                           return "N" + std::to_string(i.param.N) + "_I" +
                                  std::to_string(i.param.I) + "_ld" + std::to_string(i.param.ld);
                         });

// ---------------------------------------------------------------------------------------------
// embedding

struct EmbCase {
  int N, C, V;
};

class CudaEmbedding : public ::testing::TestWithParam<EmbCase> {};

TEST_P(CudaEmbedding, ForwardGathersRowsExactly) {
  QT_REQUIRE_GPU();
  const auto [N, C, V] = GetParam();
  auto rng = test_rng();
  const Bf16Input wte = random_bf16(std::size_t(V) * C, rng);
  std::uniform_int_distribution<int> pick(0, V - 1);
  std::vector<std::int32_t> ids(N);
  for (auto& id : ids) id = pick(rng);
  GuardedBuffer<bf16> dwte(wte.bits), dx(std::size_t(N) * C);
  GuardedBuffer<std::int32_t> dids(ids);
  fill_nan(dx);
  cuda::embedding_forward(dx.get(), dids.get(), dwte.get(), N, C, nullptr);
  Vec x(std::size_t(N) * C);
  cpu::embedding_forward<double>(x.data(), ids.data(), wte.value.data(), N, C);
  EXPECT_EQ(rel_err(download(dx), x), 0.0);
  EXPECT_TRUE(dx.guard_intact());
}

// Vocabulary-parallel: two ranks' parts of the table (rows [0, V1) and [V1, V)) each give their
// rows and zeros elsewhere; their sum is the whole lookup, bit for bit.
TEST_P(CudaEmbedding, RowsOfPartOfTheTableSumToTheLookup) {
  QT_REQUIRE_GPU();
  const auto [N, C, V] = GetParam();
  auto rng = test_rng();
  const Bf16Input wte = random_bf16(std::size_t(V) * C, rng);
  std::uniform_int_distribution<int> pick(0, V - 1);
  std::vector<std::int32_t> ids(N);
  for (auto& id : ids) id = pick(rng);
  GuardedBuffer<std::int32_t> dids(ids);
  Vec want(std::size_t(N) * C);
  cpu::embedding_forward<double>(want.data(), ids.data(), wte.value.data(), N, C);
  const int split = V / 2;
  Vec sum(want.size(), 0.0);
  for (const auto [first, count] : {std::pair{0, split}, std::pair{split, V - split}}) {
    const std::vector<bf16> part(wte.bits.begin() + std::size_t(first) * C,
                                 wte.bits.begin() + std::size_t(first + count) * C);
    GuardedBuffer<bf16> dpart(part.empty() ? std::vector<bf16>(1) : part),
        dx(std::size_t(N) * C);
    fill_nan(dx);
    cuda::embedding_forward_rows(dx.get(), dids.get(), dpart.get(), N, C, first, count, nullptr);
    const Vec got = download(dx);
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c) {
        const std::size_t k = std::size_t(n) * C + c;
        const bool here = ids[n] >= first && ids[n] < first + count;
        ASSERT_EQ(got[k], here ? want[k] : 0.0) << "row " << n << " column " << c;
        sum[k] += got[k];
      }
    EXPECT_TRUE(dx.guard_intact());
  }
  EXPECT_EQ(rel_err(sum, want), 0.0);
}

TEST_P(CudaEmbedding, BackwardIsBitEqualToTokenOrderAndDeterministic) {
  QT_REQUIRE_GPU();
  const auto [N, C, V] = GetParam();
  auto rng = test_rng();
  const Bf16Input dx = random_bf16(std::size_t(N) * C, rng);
  // Skewed ids: a few very frequent ones (long runs after the sort) and a tail of rare ones.
  std::uniform_int_distribution<int> pick(0, V - 1), hot(0, std::min(V, 4) - 1);
  std::bernoulli_distribution is_hot(0.3);
  std::vector<std::int32_t> ids(N);
  for (auto& id : ids) id = is_hot(rng) ? hot(rng) : pick(rng);
  const Vec dwte0 = random_f32_exact(std::size_t(V) * C, rng);
  GuardedBuffer<bf16> ddx(dx.bits);
  GuardedBuffer<std::int32_t> dids(ids);
  GuardedBuffer<float> ddwte(cast<float>(dwte0));
  GuardedBuffer<char> ws(cuda::embedding_backward_workspace_bytes(N));
  cuda::embedding_backward(ddwte.get(), ddx.get(), dids.get(), N, C, ws.get(), ws.size(), nullptr);
  const std::vector<float> got = ddwte.download();

  // The CPU op in float adds the rows in token order: the GPU must give exactly its bits.
  std::vector<float> want = cast<float>(dwte0);
  const std::vector<float> dxf = cast<float>(dx.value);
  cpu::embedding_backward<float>(want.data(), dxf.data(), ids.data(), N, C);
  EXPECT_TRUE(bitwise_equal(got, want)) << "rel err " << rel_err(got, want);
  // And close to the double op (catches a wrong reference too).
  Vec wd = dwte0;
  cpu::embedding_backward<double>(wd.data(), dx.value.data(), ids.data(), N, C);
  EXPECT_LT(rel_err(got, wd), kTolF32);
  EXPECT_TRUE(ddwte.guard_intact());
  EXPECT_TRUE(ws.guard_intact());

  ddwte.upload(cast<float>(dwte0));
  cuda::embedding_backward(ddwte.get(), ddx.get(), dids.get(), N, C, ws.get(), ws.size(), nullptr);
  EXPECT_TRUE(bitwise_equal(ddwte.download(), got)) << "dwte differs between two runs";
}

// The backward into ZeRO shards of the table (flat ranges that start and end inside rows, at
// element offsets that are not multiples of a vector) gives, shard by shard, the bits of the
// whole-table op, and writes nothing outside its range.
TEST_P(CudaEmbedding, BackwardIntoShardsGivesTheWholeTablesBits) {
  QT_REQUIRE_GPU();
  const auto [N, C, V] = GetParam();
  auto rng = test_rng();
  const Bf16Input dx = random_bf16(std::size_t(N) * C, rng);
  std::uniform_int_distribution<int> pick(0, V - 1);
  std::vector<std::int32_t> ids(N);
  for (auto& id : ids) id = pick(rng);
  const std::size_t total = std::size_t(V) * C;
  const std::vector<float> dwte0 = cast<float>(random_f32_exact(total, rng));
  GuardedBuffer<bf16> ddx(dx.bits);
  GuardedBuffer<std::int32_t> dids(ids);
  GuardedBuffer<char> ws(cuda::embedding_backward_workspace_bytes(N));
  GuardedBuffer<float> whole(dwte0);
  cuda::embedding_backward(whole.get(), ddx.get(), dids.get(), N, C, ws.get(), ws.size(), nullptr);
  const std::vector<float> want = whole.download();
  // Three shards: [0, a), [a, b), [b, total), a and b odd and inside rows where possible.
  const std::size_t a = std::min(total, total / 3 + 1), b = std::min(total, 2 * (total / 3) + 3);
  std::vector<float> got;
  for (const auto& [lo, hi] : {std::pair{std::size_t{0}, a}, std::pair{a, b}, std::pair{b, total}}) {
    if (lo == hi) continue;
    GuardedBuffer<float> shard(std::vector<float>(dwte0.begin() + lo, dwte0.begin() + hi));
    cuda::embedding_backward_range(shard.get(), lo, hi, ddx.get(), dids.get(), N, C, ws.get(),
                                   ws.size(), nullptr);
    const std::vector<float> part = shard.download();
    EXPECT_TRUE(shard.guard_intact()) << "shard [" << lo << ", " << hi << ")";
    got.insert(got.end(), part.begin(), part.end());
  }
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(bitwise_equal(got, want)) << "rel err " << rel_err(got, want);
  EXPECT_NE(want, dwte0);  // the rows changed
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaEmbedding,
                         ::testing::Values(EmbCase{1000, 264, 50}, EmbCase{37, 8, 5},
                                           EmbCase{4096, 1024, 3000}, EmbCase{1, 2048, 7}),
                         [](const auto& i) {
                           return "N" + std::to_string(i.param.N) + "_C" +
                                  std::to_string(i.param.C) + "_V" + std::to_string(i.param.V);
                         });

// ---------------------------------------------------------------------------------------------
// convert

class CudaConvert : public ::testing::TestWithParam<int> {};  // param: pointer shift in elements

TEST_P(CudaConvert, RoundsToNearestEvenAndBackExactly) {
  QT_REQUIRE_GPU();
  const int shift = GetParam();
  const std::size_t n = 100003;  // not a multiple of 8
  auto rng = test_rng();
  std::vector<float> src = cast<float>(random_f32_exact(n + 1, rng, 10.0));
  src[shift + 0] = std::numeric_limits<float>::infinity();
  src[shift + 1] = -std::numeric_limits<float>::infinity();
  src[shift + 2] = std::numeric_limits<float>::quiet_NaN();
  src[shift + 3] = 3.4e38f;      // rounds to Inf
  src[shift + 4] = 1e-40f;       // subnormal
  src[shift + 5] = 1.00390625f;  // halfway between two bf16: ties to even (1.0)
  src[shift + 6] = 1.01171875f;  // halfway: ties to even (1.015625)
  GuardedBuffer<float> dsrc(src), dback(n + 1);
  GuardedBuffer<bf16> dbf(n + 1);
  fill_nan(dbf);
  fill_nan(dback);
  cuda::convert_f32_to_bf16(dbf.get() + shift, dsrc.get() + shift, n, nullptr);
  cuda::convert_bf16_to_f32(dback.get() + shift, dbf.get() + shift, n, nullptr);
  const std::vector<bf16> bf = dbf.download();
  const std::vector<float> back = dback.download();
  std::size_t wrong = 0, wrong_back = 0;
  for (std::size_t i = shift; i < shift + n; ++i) {
    const float want = __bfloat162float(__float2bfloat16_rn(src[i]));
    const float got = __bfloat162float(bf[i]);
    if (std::isnan(src[i]))
      wrong += !std::isnan(got);
    else
      wrong += std::memcmp(&got, &want, sizeof(float)) != 0;
    wrong_back += std::memcmp(&back[i], &got, sizeof(float)) != 0;
  }
  EXPECT_EQ(wrong, 0u);
  EXPECT_EQ(wrong_back, 0u);
  EXPECT_EQ(__bfloat162float(bf[shift + 5]), 1.0f);
  EXPECT_EQ(__bfloat162float(bf[shift + 6]), 1.015625f);
  EXPECT_TRUE(std::isinf(__bfloat162float(bf[shift + 3])));
  EXPECT_TRUE(dbf.guard_intact());
  EXPECT_TRUE(dback.guard_intact());
}

INSTANTIATE_TEST_SUITE_P(Alignment, CudaConvert, ::testing::Values(0, 1),
                         [](const auto& i) { return "shift" + std::to_string(i.param); });

}  // namespace
}  // namespace qt::test
