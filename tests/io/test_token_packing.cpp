// Token files with data.packing = packed | padded: positions, targets (-100 at document
// boundaries and pads), chunking, and determinism (reopen, on-demand reads, any rank count).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "data/token_file.h"
#include "qtrain/data.h"
#include "qtrain/error.h"
#include "support/random.h"

namespace fs = std::filesystem;

namespace qt {
namespace {

using Row = std::vector<std::int32_t>;
constexpr std::int32_t kIgn = -100;

struct Sample {
  Row in, tg, pos;
  bool operator==(const Sample&) const = default;
};

Sample get(const DataSource& src, std::int64_t g, int T) {
  Sample s{Row(T), Row(T), Row(T, -7)};
  src.sample(g, s.in.data(), s.tg.data(), s.pos.data(), T);
  return s;
}

class TokenPacking : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qtrain_packing_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    rng_.seed(test::test_seed());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Documents A = 10 11 12 | B = 20..25 | C = 30 | D = (empty) | E = 40 41 42; 13 tokens.
  std::string small_file() {
    const std::string path = dir_ + "/small.h5";
    write_token_file(path, {10, 11, 12, 20, 21, 22, 23, 24, 25, 30, 40, 41, 42},
                     {0, 3, 9, 10, 10, 13}, {}, 50);
    return path;
  }

  std::string dir_;
  std::mt19937_64 rng_;
};

// Every sample of epoch `epoch`, in order.
std::vector<Sample> epoch_samples(const DataSource& src, std::int64_t units, std::int64_t epoch,
                                  int T) {
  std::vector<Sample> out;
  for (std::int64_t k = 0; k < units; ++k) out.push_back(get(src, epoch * units + k, T));
  return out;
}

void expect_valid_positions(const Row& pos) {
  ASSERT_EQ(pos[0], 0);
  for (std::size_t t = 1; t < pos.size(); ++t)
    ASSERT_TRUE(pos[t] == 0 || pos[t] == pos[t - 1] + 1) << "pos[" << t << "] = " << pos[t];
}

TEST_F(TokenPacking, PackedWindowsByHand) {
  const int T = 4;
  const std::string path = small_file();
  const std::uint64_t seed = rng_();
  auto src = open_token_file(path, 50, T, seed, Packing::kPacked);
  EXPECT_NE(src->describe().find("packed"), std::string::npos) << src->describe();
  // W = (13 - 1) / 4 = 3 windows, in the same order as concat.
  const std::vector<Sample> want = {
      {{10, 11, 12, 20}, {11, 12, kIgn, 21}, {0, 1, 2, 0}},       // tokens 0..4: A | B
      {{21, 22, 23, 24}, {22, 23, 24, 25}, {0, 1, 2, 3}},         // 4..8: B cut by the start
      {{25, 30, 40, 41}, {kIgn, kIgn, 41, 42}, {0, 0, 0, 1}},     // 8..12: B | C | D | E
  };
  for (std::int64_t epoch = 0; epoch < 2; ++epoch) {
    const auto order = token_window_order(3, seed, epoch);
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(get(*src, epoch * 3 + k, T), want[order[k]]) << "epoch " << epoch << " k " << k;
    }
  }
}

TEST_F(TokenPacking, PaddedChunksByHand) {
  const int T = 4;
  const std::string path = small_file();
  const std::uint64_t seed = rng_();
  auto src = open_token_file(path, 50, T, seed, Packing::kPadded);
  EXPECT_NE(src->describe().find("4 chunks"), std::string::npos) << src->describe();
  const Row p = {0, 1, 2, 3};
  const std::int32_t pad = kPadToken;
  // A: one chunk; B (6 tokens): [20..24] and [24 25]; C, D: no target, no chunk; E: one chunk.
  const std::vector<Sample> want = {
      {{10, 11, 12, pad}, {11, 12, kIgn, kIgn}, p},
      {{20, 21, 22, 23}, {21, 22, 23, 24}, p},
      {{24, 25, pad, pad}, {25, kIgn, kIgn, kIgn}, p},
      {{40, 41, 42, pad}, {41, 42, kIgn, kIgn}, p},
  };
  for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
    const auto order = token_window_order(4, seed, epoch);
    for (int k = 0; k < 4; ++k) {
      EXPECT_EQ(get(*src, epoch * 4 + k, T), want[order[k]]) << "epoch " << epoch << " k " << k;
    }
  }
  // A document shorter than T + 1 is enough for padded (concat needs N >= T + 1).
  const std::string one = dir_ + "/one.h5";
  write_token_file(one, {5, 6, 7}, {0, 3}, {}, 10);
  auto s1 = open_token_file(one, 10, 8, seed, Packing::kPadded);
  const Sample a = get(*s1, 17, 8);
  EXPECT_EQ(a.in, (Row{5, 6, 7, pad, pad, pad, pad, pad}));
  EXPECT_EQ(a.tg, (Row{6, 7, kIgn, kIgn, kIgn, kIgn, kIgn, kIgn}));
  EXPECT_THROW(open_token_file(one, 10, 8, seed, Packing::kPacked), UserError);
  // No document of two tokens: no chunk at all.
  const std::string tiny = dir_ + "/tiny.h5";
  write_token_file(tiny, {1, 2, 3}, {0, 1, 1, 2, 3}, {}, 10);
  try {
    open_token_file(tiny, 10, 2, seed, Packing::kPadded);
    ADD_FAILURE() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("at least 2 tokens"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(tiny), std::string::npos) << e.what();
  }
}

// Random documents (token i has id i, so a target names its token) and a random loss mask: over
// one epoch, every target that should count counts exactly once, and nothing else does.
TEST_F(TokenPacking, EveryTargetOnceAndNeverAcrossDocuments) {
  for (int trial = 0; trial < 6; ++trial) {
    const int T = 3 + static_cast<int>(rng_() % 14);
    const std::int64_t N = T + 1 + static_cast<std::int64_t>(rng_() % 400);
    Row tokens(N);
    std::vector<std::uint8_t> mask(N);
    std::vector<std::int64_t> off = {0};
    while (off.back() < N) {  // lengths 0 .. 2.5 T, some empty, some longer than a window
      const auto len = static_cast<std::int64_t>(rng_() % (5 * T / 2 + 1));
      off.push_back(std::min(N, off.back() + len));
    }
    std::vector<int> doc_of(N);
    for (std::size_t d = 0; d + 1 < off.size(); ++d)
      for (auto i = off[d]; i < off[d + 1]; ++i) doc_of[i] = static_cast<int>(d);
    for (std::int64_t i = 0; i < N; ++i) {
      tokens[i] = static_cast<std::int32_t>(i);
      mask[i] = rng_() % 5 != 0;
    }
    const std::string path = dir_ + "/r" + std::to_string(trial) + ".h5";
    write_token_file(path, tokens, off, mask, N);
    const std::uint64_t seed = rng_();

    // packed: the concat windows with document boundaries cut.
    auto packed = open_token_file(path, N, T, seed, Packing::kPacked);
    auto concat = open_token_file(path, N, T, seed);
    const std::int64_t W = (N - 1) / T;
    std::map<std::int32_t, int> seen;
    for (const Sample& s : epoch_samples(*packed, W, 1, T)) {
      expect_valid_positions(s.pos);
      const std::int64_t start = s.in[0];
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(s.in[t], start + t);
        // position = distance to the document start, or to the window start if nearer
        const std::int64_t doc_start = std::max<std::int64_t>(off[doc_of[start + t]], start);
        ASSERT_EQ(s.pos[t], start + t - doc_start);
        const bool same_doc = doc_of[start + t + 1] == doc_of[start + t];
        ASSERT_EQ(s.tg[t], same_doc && mask[start + t + 1] ? start + t + 1 : kIgn);
        if (s.tg[t] != kIgn) ++seen[s.tg[t]];
      }
    }
    for (std::int64_t g = W; g < 2 * W; ++g) {
      const Sample c = get(*concat, g, T), p = get(*packed, g, T);
      ASSERT_EQ(c.in, p.in) << "packed keeps the windows and their order";
      for (int t = 0; t < T; ++t) ASSERT_EQ(c.pos[t], t) << "concat positions are 0..T-1";
    }
    for (std::int64_t i = 1; i <= W * T; ++i) {
      const int want = doc_of[i] == doc_of[i - 1] && mask[i] ? 1 : 0;
      ASSERT_EQ(seen.count(static_cast<std::int32_t>(i)) ? seen[i] : 0, want) << "token " << i;
    }

    // padded: chunks of up to T + 1 tokens of one document, stepping by T.
    auto padded = open_token_file(path, N, T, seed, Packing::kPadded);
    std::int64_t chunks = 0;
    for (std::size_t d = 0; d + 1 < off.size(); ++d)
      if (off[d + 1] - off[d] >= 2) chunks += (off[d + 1] - off[d] - 2) / T + 1;
    seen.clear();
    for (const Sample& s : epoch_samples(*padded, chunks, 2, T)) {
      const std::int64_t start = s.in[0];
      const std::int64_t end = off[doc_of[start] + 1];  // end of its document
      const std::int64_t len = std::min<std::int64_t>(T + 1, end - start);
      ASSERT_GE(len, 2);
      ASSERT_EQ((start - off[doc_of[start]]) % T, 0) << "chunks start at multiples of T";
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(s.pos[t], t);
        ASSERT_EQ(s.in[t], t < len ? start + t : kPadToken);
        ASSERT_EQ(s.tg[t], t + 1 < len && mask[start + t + 1] ? start + t + 1 : kIgn);
        if (s.tg[t] != kIgn) ++seen[s.tg[t]];
      }
    }
    for (std::int64_t i = 1; i < N; ++i) {
      const int want = doc_of[i] == doc_of[i - 1] && mask[i] ? 1 : 0;
      ASSERT_EQ(seen.count(static_cast<std::int32_t>(i)) ? seen[i] : 0, want) << "token " << i;
    }
  }
}

// The sample index (and the seed) alone fix a sample: reopened files, on-demand reads, and data
// parallel ranks that each open the file and take their share of every global batch agree.
TEST_F(TokenPacking, DeterministicAcrossReopenAndRankCounts) {
  const int T = 5;
  const std::int64_t N = 300;
  Row tokens(N);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng_() % 97);
  std::vector<std::int64_t> off = {0};
  while (off.back() < N) off.push_back(std::min<std::int64_t>(N, off.back() + rng_() % 13));
  const std::string path = dir_ + "/det.h5";
  write_token_file(path, tokens, off, {}, 97);
  const std::uint64_t seed = rng_();
  for (Packing mode : {Packing::kConcat, Packing::kPacked, Packing::kPadded}) {
    auto ref = open_token_file(path, 97, T, seed, mode);
    auto reopened = open_token_file(path, 97, T, seed, mode);
    auto lazy = open_token_file_limited(path, 97, T, seed, 0, mode);
    auto other_seed = open_token_file(path, 97, T, seed + 1, mode);
    const int global_batch = 8, steps = 40;  // several epochs
    std::vector<Sample> want;
    for (std::int64_t g = 0; g < global_batch * steps; ++g) want.push_back(get(*ref, g, T));
    int differ = 0;
    for (std::int64_t g = global_batch * steps - 1; g >= 0; --g) {  // backwards: cold caches
      ASSERT_EQ(get(*reopened, g, T), want[g]);
      ASSERT_EQ(get(*lazy, g, T), want[g]);
      differ += !(get(*other_seed, g, T) == want[g]);
    }
    EXPECT_GT(differ, 0) << "the seed should change the order";
    for (int dp : {2, 4}) {
      std::vector<std::unique_ptr<DataSource>> ranks;
      for (int r = 0; r < dp; ++r) ranks.push_back(open_token_file(path, 97, T, seed, mode));
      const int local = global_batch / dp;
      for (int step = 0; step < steps; ++step)
        for (int r = 0; r < dp; ++r)
          for (int s = 0; s < local; ++s) {
            const std::int64_t g = std::int64_t{step} * global_batch + r * local + s;
            ASSERT_EQ(get(*ranks[r], g, T), want[g]) << "dp " << dp << " sample " << g;
          }
    }
  }
}

}  // namespace
}  // namespace qt
