// Block attention (ops/attention_block.h), the reference of context parallelism: each sequence
// cut into 2 cp chunks per rank (rank r holds chunk r from the front and its mirror from the
// back), every rank's queries run against every rank's K/V in ring order and are merged by
// log-sum-exp; the merged out and lse, and the sums of the blocks' backward, equal the
// whole-sequence attention_forward and attention_backward (double, random inputs, packed
// documents crossing the chunk boundaries, lengths no multiple of the chunk count).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "ops/attention.h"
#include "ops/attention_block.h"

namespace qt::cpu {
namespace {

using test::kTolF64;
using test::random_f32_exact;
using test::rel_err;
using test::test_rng;
using test::Vec;
using I32 = std::vector<std::int32_t>;

// Global indices held by cp rank r of `cp`: 2 cp chunks of a sequence of T tokens (the last
// ones shorter when 2 cp does not divide T), chunk r and chunk 2 cp - 1 - r.
I32 rank_rows(int T, int cp, int r) {
  const int chunks = 2 * cp, len = (T + chunks - 1) / chunks;
  I32 rows;
  for (int c : {r, chunks - 1 - r})
    for (int t = c * len; t < std::min(T, (c + 1) * len); ++t) rows.push_back(t);
  return rows;
}

// Rows `idx` of x [B, T, heads, hd] -> [B, idx.size(), heads, hd] (and back, adding).
Vec gather(const Vec& x, const I32& idx, int B, int T, int width) {
  Vec out(static_cast<std::size_t>(B) * idx.size() * width);
  for (int b = 0; b < B; ++b)
    for (std::size_t i = 0; i < idx.size(); ++i)
      for (int w = 0; w < width; ++w)
        out[(b * idx.size() + i) * width + w] =
            x[(static_cast<std::size_t>(b) * T + idx[i]) * width + w];
  return out;
}
void scatter_add(Vec& x, const Vec& part, const I32& idx, int B, int T, int width) {
  for (int b = 0; b < B; ++b)
    for (std::size_t i = 0; i < idx.size(); ++i)
      for (int w = 0; w < width; ++w)
        x[(static_cast<std::size_t>(b) * T + idx[i]) * width + w] +=
            part[(b * idx.size() + i) * width + w];
}

TEST(ops_attention_block, RingOfCpRanksEqualsTheWholeSequence) {
  auto rng = test_rng();
  const int B = 2, nh = 4, nkv = 2, hd = 8;
  for (const int T : {13, 24}) {
    for (const int cp : {2, 4}) {
      for (const bool packed : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << "T " << T << ", cp " << cp << (packed ? ", packed" : ""));
        const int Q = nh * hd, KV = nkv * hd;
        Vec q = random_f32_exact(B * T * Q, rng), k = random_f32_exact(B * T * KV, rng);
        Vec v = random_f32_exact(B * T * KV, rng), dout = random_f32_exact(B * T * Q, rng);
        // pos [B, T]: documents of 1 to 9 tokens (packed), or plain causal
        I32 pos(static_cast<std::size_t>(B) * T);
        std::uniform_int_distribution<int> doc_len(1, 9);
        for (int b = 0; b < B; ++b)
          for (int t = 0, left = 0, p = 0; t < T; ++t, --left) {
            if (left == 0) {  // a new document starts at t
              left = packed ? doc_len(rng) : T;
              p = 0;
            }
            pos[b * T + t] = p++;
          }
        // the whole sequence
        Vec out(B * T * Q), lse(B * nh * T), dq(q.size()), dk(k.size()), dv(v.size());
        attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), B, T, nh,
                                  nkv, hd, pos.data());
        attention_backward<double>(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                                   v.data(), out.data(), lse.data(), B, T, nh, nkv, hd, pos.data());
        // cp ranks: each merges every rank's K/V block in ring order (its own first)
        Vec got_out(out.size(), 0.0), got_lse(lse.size()), got_dq(q.size(), 0.0);
        Vec got_dk(k.size(), 0.0), got_dv(v.size(), 0.0);
        std::vector<I32> rows(cp);
        for (int r = 0; r < cp; ++r) rows[r] = rank_rows(T, cp, r);
        for (int r = 0; r < cp; ++r) {
          const I32& qi = rows[r];
          const int Tq = static_cast<int>(qi.size());
          I32 first(static_cast<std::size_t>(B) * Tq);
          for (int b = 0; b < B; ++b)
            for (int i = 0; i < Tq; ++i) first[b * Tq + i] = qi[i] - pos[b * T + qi[i]];
          const Vec qr = gather(q, qi, B, T, Q), dor = gather(dout, qi, B, T, Q);
          Vec o(static_cast<std::size_t>(B) * Tq * Q, 0.0);
          Vec l(static_cast<std::size_t>(B) * nh * Tq, -std::numeric_limits<double>::infinity());
          for (int step = 0; step < cp; ++step) {
            const I32& ki = rows[(r + step) % cp];
            const int Tk = static_cast<int>(ki.size());
            const Vec kr = gather(k, ki, B, T, KV), vr = gather(v, ki, B, T, KV);
            Vec ob(o.size()), lb(l.size());
            attention_block_forward<double>(ob.data(), lb.data(), qr.data(), kr.data(), vr.data(),
                                            B, Tq, Tk, nh, nkv, hd,
                                            {qi.data(), ki.data(), first.data()});
            attention_merge<double>(o.data(), l.data(), ob.data(), lb.data(), B, Tq, nh, hd);
          }
          // the backward of every block from the merged out and lse
          for (int step = 0; step < cp; ++step) {
            const I32& ki = rows[(r + step) % cp];
            const int Tk = static_cast<int>(ki.size());
            const Vec kr = gather(k, ki, B, T, KV), vr = gather(v, ki, B, T, KV);
            Vec dqr(qr.size(), 0.0), dkr(kr.size(), 0.0), dvr(vr.size(), 0.0);
            attention_block_backward<double>(
                dqr.data(), dkr.data(), dvr.data(), dor.data(), qr.data(), kr.data(), vr.data(),
                o.data(), l.data(), B, Tq, Tk, nh, nkv, hd, {qi.data(), ki.data(), first.data()});
            scatter_add(got_dq, dqr, qi, B, T, Q);
            scatter_add(got_dk, dkr, ki, B, T, KV);
            scatter_add(got_dv, dvr, ki, B, T, KV);
          }
          scatter_add(got_out, o, qi, B, T, Q);
          for (int b = 0; b < B; ++b)
            for (int h = 0; h < nh; ++h)
              for (int i = 0; i < Tq; ++i)
                got_lse[(b * nh + h) * T + qi[i]] = l[(b * nh + h) * Tq + i];
        }
        EXPECT_LT(rel_err(got_out, out), kTolF64);
        EXPECT_LT(rel_err(got_lse, lse), kTolF64);
        EXPECT_LT(rel_err(got_dq, dq), kTolF64);
        EXPECT_LT(rel_err(got_dk, dk), kTolF64);
        EXPECT_LT(rel_err(got_dv, dv), kTolF64);
      }
    }
  }
}

// A block whose keys all lie after the queries (a rank's front chunk against the back chunk of
// another) adds nothing: lse -inf, out 0, and merging it changes no bit.
TEST(ops_attention_block, InvisibleBlockAddsNothing) {
  auto rng = test_rng();
  const int B = 1, nh = 2, nkv = 1, hd = 4, Tq = 3, Tk = 2;
  const I32 qi = {0, 1, 2}, ki = {7, 8};
  Vec q = random_f32_exact(B * Tq * nh * hd, rng), k = random_f32_exact(B * Tk * nkv * hd, rng);
  Vec v = random_f32_exact(B * Tk * nkv * hd, rng);
  Vec o(q.size(), 1.0), l(B * nh * Tq, -1.0);
  attention_block_forward<double>(o.data(), l.data(), q.data(), k.data(), v.data(), B, Tq, Tk, nh,
                                  nkv, hd, {qi.data(), ki.data(), nullptr});
  for (double x : o) EXPECT_EQ(x, 0.0);
  for (double x : l) EXPECT_EQ(x, -std::numeric_limits<double>::infinity());
  Vec run_o = random_f32_exact(q.size(), rng), run_l = random_f32_exact(l.size(), rng);
  const Vec o0 = run_o, l0 = run_l;
  attention_merge<double>(run_o.data(), run_l.data(), o.data(), l.data(), B, Tq, nh, hd);
  EXPECT_EQ(run_o, o0);
  EXPECT_EQ(run_l, l0);
}

}  // namespace
}  // namespace qt::cpu
