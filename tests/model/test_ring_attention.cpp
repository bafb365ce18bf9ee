// Context parallelism's pieces under mpiexec (cp = the world: 2 or 4 ranks): the load-balanced
// split of a sequence (parallel/context_parallel.h), and ring attention (model/ring_attention.h)
// against the serial attention (ops/attention.h) in fp32: each rank's rows of out, lse and of
// the gradients dq, dk, dv, with packed documents crossing the chunk boundaries and sequence
// lengths that 2 cp does not divide (so the ranks hold different numbers of tokens).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "model/ring_attention.h"
#include "ops/attention.h"
#include "ops/check.h"
#include "parallel/context_parallel.h"
#include "qtrain/comm.h"

namespace qt {
namespace {

using I32 = std::vector<std::int32_t>;
using F32 = std::vector<float>;

// The seed of rank 0, on every rank (the ranks must draw the same sequences).
std::uint64_t shared_seed() {
  std::uint64_t s = test::test_seed();
  MPI_Bcast(&s, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return s;
}

TEST(ContextSplit, ChunksCoverTheSequenceAndMirrorEachOther) {
  for (const int cp : {1, 2, 3, 4}) {
    for (int T = 2 * cp; T <= 40; ++T) {
      SCOPED_TRACE(testing::Message() << "T " << T << ", cp " << cp);
      const ContextSplit split(T, cp);
      const int chunks = 2 * cp;
      // The first T % (2 cp) chunks one token longer than the others.
      for (int j = 0; j < chunks; ++j)
        EXPECT_EQ(split.chunk_end(j) - split.chunk_begin(j), T / chunks + (j < T % chunks ? 1 : 0));
      EXPECT_EQ(split.chunk_begin(0), 0);
      EXPECT_EQ(split.chunk_end(chunks - 1), T);
      std::vector<int> owners(static_cast<std::size_t>(T), 0);
      for (int r = 0; r < cp; ++r) {
        const I32& idx = split.indices(r);
        EXPECT_EQ(split.local_len(r), static_cast<int>(idx.size()));
        EXPECT_TRUE(std::is_sorted(idx.begin(), idx.end()));
        EXPECT_EQ(idx.front(), split.chunk_begin(r));             // chunk r from the front
        EXPECT_EQ(idx.back(), split.chunk_end(chunks - 1 - r) - 1);  // and its mirror
        for (std::int32_t t : idx) ++owners[static_cast<std::size_t>(t)];
        EXPECT_LE(std::abs(split.local_len(r) - split.local_len(0)), 2);
      }
      EXPECT_TRUE(std::all_of(owners.begin(), owners.end(), [](int n) { return n == 1; }));
    }
  }
  // One of the lengths the ring test runs: 13 tokens over 2 ranks, chunks 4, 3, 3, 3.
  const ContextSplit split(13, 2);
  EXPECT_EQ(split.indices(0), (I32{0, 1, 2, 3, 10, 11, 12}));
  EXPECT_EQ(split.indices(1), (I32{4, 5, 6, 7, 8, 9}));
  const I32 pos = {0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 0, 1};  // documents at 0, 3, 5, 11
  I32 mine(6);
  split.take_positions(mine.data(), pos.data(), 1, 1);
  EXPECT_EQ(mine, (I32{1, 0, 1, 2, 3, 4}));
  split.take_positions(mine.data(), nullptr, 1, 1);
  EXPECT_EQ(mine, (I32{4, 5, 6, 7, 8, 9}));  // plain causal: the global index
}

// Rows `idx` of x [B, T, width] -> [B, idx.size(), width].
F32 rows_of(const F32& x, const I32& idx, int B, int T, int width) {
  F32 out(static_cast<std::size_t>(B) * idx.size() * width);
  for (int b = 0; b < B; ++b)
    for (std::size_t i = 0; i < idx.size(); ++i)
      std::copy_n(x.begin() + (static_cast<std::ptrdiff_t>(b) * T + idx[i]) * width, width,
                  out.begin() + (b * static_cast<std::ptrdiff_t>(idx.size()) + i) * width);
  return out;
}

// lse [B, nh, T] -> this rank's [B, nh, Tl].
F32 lse_of(const F32& lse, const I32& idx, int B, int nh, int T) {
  F32 out;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < nh; ++h)
      for (std::int32_t t : idx) out.push_back(lse[(static_cast<std::size_t>(b) * nh + h) * T + t]);
  return out;
}

TEST(RingAttention, EqualsTheSerialAttentionOnEachRanksRows) {
  auto cp = std::make_shared<MpiComm>(MPI_COMM_WORLD, "cp", false);
  ASSERT_GE(cp->size(), 2) << "run under mpiexec -n 2 or 4";
  const std::uint64_t seed = shared_seed();
  if (cp->rank() == 0) std::printf("seed %llu (QT_TEST_SEED repeats it)\n",
                                   static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const int B = 2, nh = 4, nkv = 2, hd = 8, Q = nh * hd, KV = nkv * hd;
  const int n = cp->size();
  // 2 cp + 5 and 4 cp + 3 tokens: no multiple of the chunk count.
  for (const int T : {2 * n + 5, 4 * n + 3, 8 * n}) {
    for (const bool packed : {false, true}) {
      SCOPED_TRACE(testing::Message() << "T " << T << ", cp " << n << (packed ? ", packed" : ""));
      const F32 q = test::random_vector<float>(static_cast<std::size_t>(B) * T * Q, rng);
      const F32 k = test::random_vector<float>(static_cast<std::size_t>(B) * T * KV, rng);
      const F32 v = test::random_vector<float>(static_cast<std::size_t>(B) * T * KV, rng);
      const F32 dout = test::random_vector<float>(static_cast<std::size_t>(B) * T * Q, rng);
      // pos [B, T]: documents of 1 to 6 tokens (packed: several in each chunk, many crossing
      // a chunk boundary), or one document (plain causal).
      I32 pos(static_cast<std::size_t>(B) * T);
      std::uniform_int_distribution<int> doc_len(1, 6);
      for (int b = 0; b < B; ++b)
        for (int t = 0, left = 0, p = 0; t < T; ++t, --left) {
          if (left == 0) {
            left = packed ? doc_len(rng) : T;
            p = 0;
          }
          pos[static_cast<std::size_t>(b) * T + t] = p++;
        }
      // The serial attention of the whole sequences (every rank the same).
      F32 out(q.size()), lse(static_cast<std::size_t>(B) * nh * T);
      F32 dq(q.size()), dk(k.size()), dv(v.size());
      cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, nh, nkv,
                             hd, pos.data());
      cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                              v.data(), out.data(), lse.data(), B, T, nh, nkv, hd, pos.data());
      // This rank's rows through the ring.
      const ContextSplit split(T, n);
      const I32& idx = split.indices(cp->rank());
      const int Tl = split.local_len(cp->rank());
      I32 pos_l(static_cast<std::size_t>(B) * Tl);
      split.take_positions(pos_l.data(), packed ? pos.data() : nullptr, B, cp->rank());
      const F32 q_l = rows_of(q, idx, B, T, Q), k_l = rows_of(k, idx, B, T, KV);
      const F32 v_l = rows_of(v, idx, B, T, KV), dout_l = rows_of(dout, idx, B, T, Q);
      F32 out_l(q_l.size()), lse_l(static_cast<std::size_t>(B) * nh * Tl);
      F32 dq_l(q_l.size(), 7.0f), dk_l(k_l.size(), 7.0f), dv_l(v_l.size(), 7.0f);  // written
      RingAttention ring(*cp, split, B, nh, nkv, hd);
      ring.forward(out_l.data(), lse_l.data(), q_l.data(), k_l.data(), v_l.data(), pos_l.data());
      ring.backward(dq_l.data(), dk_l.data(), dv_l.data(), dout_l.data(), q_l.data(), k_l.data(),
                    v_l.data(), out_l.data(), lse_l.data(), pos_l.data());
      const double tol = 1e-5;  // fp32: the same math with the keys' sums in another order
      EXPECT_LT(test::rel_err(out_l, rows_of(out, idx, B, T, Q)), tol) << "out";
      EXPECT_LT(test::rel_err(lse_l, lse_of(lse, idx, B, nh, T)), tol) << "lse";
      EXPECT_LT(test::rel_err(dq_l, rows_of(dq, idx, B, T, Q)), tol) << "dq";
      EXPECT_LT(test::rel_err(dk_l, rows_of(dk, idx, B, T, KV)), tol) << "dk";
      EXPECT_LT(test::rel_err(dv_l, rows_of(dv, idx, B, T, KV)), tol) << "dv";
    }
  }
}

}  // namespace
}  // namespace qt
