// eval.split (TokenSplit, include/qtrain/data.h): a token file's windows (chunks when padded) in
// a held-out part and a training part that are disjoint, cover the file, do not depend on the
// seed, and of which training draws only its own, epoch after epoch. Serial.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "data/token_file.h"
#include "qtrain/data.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "support/random.h"

namespace fs = std::filesystem;

namespace qt {
namespace {

class TokenSplitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qtrain_split_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    rng_.seed(test::test_seed());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Tokens 0 .. N-1 (token i is i, so a sample's first input names where it starts) in
  // documents of random lengths.
  std::string write_file(std::int64_t N) {
    std::vector<std::int32_t> tokens(N);
    for (std::int64_t i = 0; i < N; ++i) tokens[i] = static_cast<std::int32_t>(i);
    std::vector<std::int64_t> off = {0};
    while (off.back() < N) off.push_back(std::min<std::int64_t>(N, off.back() + 1 + rng_() % 30));
    const std::string path = dir_ + "/t.h5";
    write_token_file(path, tokens, off, {}, N);
    return path;
  }

  std::string dir_;
  std::mt19937_64 rng_;
};

constexpr int kT = 7;

// The first input of samples [0, epochs x epoch_size()): where each sample starts in the file.
std::vector<std::int32_t> starts(const DataSource& src, int epochs) {
  std::vector<std::int32_t> in(kT), tg(kT), out;
  for (std::int64_t g = 0; g < epochs * src.epoch_size(); ++g) {
    src.sample(g, in.data(), tg.data(), nullptr, kT);
    out.push_back(in[0]);
  }
  return out;
}

TEST_F(TokenSplitTest, PartsAreDisjointCoverTheFileAndTrainingNeverSeesTheHeldOut) {
  const std::int64_t N = 600 + static_cast<std::int64_t>(rng_() % 200);
  const std::string path = write_file(N);
  const double fraction = 0.05 + 0.4 * static_cast<double>(rng_() % 1000) / 1000.0;
  const std::uint64_t seed_a = rng_(), seed_b = rng_();
  std::printf("N = %lld, eval.split = %g\n", static_cast<long long>(N), fraction);
  for (const Packing packing : {Packing::kConcat, Packing::kPacked, Packing::kPadded}) {
    SCOPED_TRACE(static_cast<int>(packing));
    const auto all = open_token_file(path, static_cast<int>(N), kT, seed_a, packing);
    const auto train = open_token_file(path, static_cast<int>(N), kT, seed_a, packing,
                                       {TokenSplit::Part::kTrain, fraction});
    const auto held = open_token_file(path, static_cast<int>(N), kT, seed_a, packing,
                                      {TokenSplit::Part::kHeldOut, fraction});
    const auto held_b = open_token_file(path, static_cast<int>(N), kT, seed_b, packing,
                                        {TokenSplit::Part::kHeldOut, fraction});
    const std::int64_t units = all->epoch_size();
    const std::int64_t n_held = std::max<std::int64_t>(1, std::llround(fraction * units));
    ASSERT_EQ(held->epoch_size(), n_held);
    ASSERT_EQ(train->epoch_size(), units - n_held);

    const std::vector<std::int32_t> every = starts(*all, 1);
    const std::set<std::int32_t> file(every.begin(), every.end());
    ASSERT_EQ(static_cast<std::int64_t>(file.size()), units) << "a sample's start names it";
    const std::vector<std::int32_t> h = starts(*held, 1), hb = starts(*held_b, 1);
    const std::set<std::int32_t> held_set(h.begin(), h.end());
    EXPECT_EQ(static_cast<std::int64_t>(held_set.size()), n_held) << "each held-out unit once";
    EXPECT_EQ(held_set, std::set<std::int32_t>(hb.begin(), hb.end()))
        << "the held-out part depends on the file, not the seed";
    // Three epochs of training: each its part's units once, never a held-out one.
    const std::vector<std::int32_t> t = starts(*train, 3);
    for (int e = 0; e < 3; ++e) {
      const std::set<std::int32_t> epoch(t.begin() + e * train->epoch_size(),
                                         t.begin() + (e + 1) * train->epoch_size());
      EXPECT_EQ(static_cast<std::int64_t>(epoch.size()), units - n_held) << "epoch " << e;
    }
    std::set<std::int32_t> both = held_set;
    for (const std::int32_t s : t) {
      EXPECT_EQ(held_set.count(s), 0u) << "training drew held-out sample starting at " << s;
      EXPECT_EQ(file.count(s), 1u);
      both.insert(s);
    }
    EXPECT_EQ(both, file) << "the two parts cover the file";
  }
}

TEST_F(TokenSplitTest, TheDeckTrainsOnTheTrainingPart) {
  const std::int64_t N = 400;
  const std::string path = write_file(N);
  const Deck d = parse_deck_text("[model]\nvocab_size = 512\n[train]\nseq_len = 7\n[data]\n"
                                 "source = file\npath = " + path + "\n[eval]\nsplit = 0.25\n",
                                 "deck.ini", {}, 1);
  const auto src = make_data_source(d);
  const std::int64_t units = (N - 1) / kT;
  EXPECT_EQ(src->epoch_size(), units - std::llround(0.25 * units));
  EXPECT_NE(src->describe().find("held out (eval.split = 0.25)"), std::string::npos)
      << src->describe();
}

TEST_F(TokenSplitTest, ASplitThatLeavesNothingToTrainOnIsRefused) {
  const std::string path = write_file(2 * kT + 1);  // two windows
  try {
    open_token_file(path, 100, kT, 1, Packing::kConcat, {TokenSplit::Part::kTrain, 0.8});
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("eval.split = 0.8 holds out 2 of its 2 windows, which "
                                         "leaves none to train on"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(open_token_file(path, 100, kT, 1, Packing::kConcat, {TokenSplit::Part::kHeldOut, 0.2})
                ->epoch_size(),
            1);  // at least one window held out
}

}  // namespace
}  // namespace qt
