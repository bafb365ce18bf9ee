// Sampler (src/generate/sampler.h): greedy, the top-p nucleus on crafted distributions, seeded
// determinism, temperature -> 0 equal to greedy; and the UTF-8 streaming rule of generate.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "generate/generate.h"
#include "generate/sampler.h"
#include "support/random.h"

namespace qt {
namespace {

// Logits whose softmax is `probs`, placed at a random permutation of ids; returns the ids.
std::vector<float> logits_for(const std::vector<double>& probs, std::mt19937_64& rng,
                              std::vector<int>& id_of) {
  const int n = static_cast<int>(probs.size());
  id_of.resize(n);
  for (int i = 0; i < n; ++i) id_of[i] = i;
  std::shuffle(id_of.begin(), id_of.end(), rng);
  std::vector<float> logits(n);
  for (int i = 0; i < n; ++i) logits[id_of[i]] = static_cast<float>(std::log(probs[i]) + 3.0);
  return logits;
}

TEST(Sampler, ArgmaxTakesTheLowestIdOnTies) {
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(gen::argmax(l.data(), 4), 1);
  gen::Sampler greedy(0.0, 0.5, 7);
  EXPECT_EQ(greedy.next(l.data(), 4), 1);
  EXPECT_EQ(greedy.draws(), 0u);
}

TEST(Sampler, NucleusIsTheShortestPrefixReachingTopP) {
  std::mt19937_64 rng(test::test_seed());
  // Sorted probabilities; cumulative 0.40 0.65 0.80 0.90 0.96 1.00 (no ties).
  const std::vector<double> probs = {0.40, 0.25, 0.15, 0.10, 0.06, 0.04};
  std::vector<int> id;
  const std::vector<float> logits = logits_for(probs, rng, id);
  const std::map<double, int> expect_size = {{0.3, 1},  {0.45, 2}, {0.7, 3},
                                             {0.85, 4}, {0.92, 5}, {1.0, 6}};
  for (const auto& [top_p, size] : expect_size) {
    const auto nuc = gen::nucleus(logits.data(), 6, 1.0, top_p);
    ASSERT_EQ(static_cast<int>(nuc.size()), size) << "top_p " << top_p;
    if (top_p < 1)  // in decreasing probability (top_p = 1 keeps every token, in id order)
      for (int k = 0; k < size; ++k) {
        EXPECT_EQ(nuc[k].first, id[k]) << "top_p " << top_p;
        EXPECT_NEAR(nuc[k].second, probs[k], 1e-6);
      }
  }
  // Temperature sharpens before the cut: at T = 0.5 the weights are p^2 / sum p^2, so
  // 0.16 / 0.26 = 0.62 alone reaches 0.5.
  EXPECT_EQ(gen::nucleus(logits.data(), 6, 0.5, 0.5).size(), 1u);
}

TEST(Sampler, NucleusOfALargeVocabularyEqualsAFullSort) {
  // nucleus() sorts only as many tokens as it needs; against a full sort, with nuclei of a few
  // tokens to thousands (flat logits over 20000 ids).
  std::mt19937_64 rng(test::test_seed() + 4);
  const int n = 20000;
  const std::vector<float> logits = test::random_vector<float>(n, rng, 1.0);
  const double T = 0.7;
  const double m = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += (p[i] = std::exp((double(logits[i]) - m) / T));
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  for (double top_p : {0.001, 0.1, 0.5, 0.9, 0.999}) {
    std::vector<std::pair<std::int32_t, double>> want;
    double before = 0;
    for (int id : order) {
      if (before >= top_p) break;
      want.emplace_back(id, p[id] / sum);
      before += p[id] / sum;
    }
    const auto got = gen::nucleus(logits.data(), n, T, top_p);
    EXPECT_EQ(got, want) << "top_p " << top_p << ": " << got.size() << " vs " << want.size();
  }
}

TEST(Sampler, DrawsOnlyInsideTheNucleusInProportion) {
  std::mt19937_64 rng(test::test_seed() + 1);
  const std::vector<double> probs = {0.40, 0.25, 0.15, 0.10, 0.06, 0.04};
  std::vector<int> id;
  const std::vector<float> logits = logits_for(probs, rng, id);
  const double top_p = 0.7;  // nucleus: the first three (0.80 of the mass)
  const std::set<int> inside = {id[0], id[1], id[2]};
  gen::Sampler s(1.0, top_p, test::test_seed());
  const int draws = 4000;
  std::map<int, int> count;
  for (int i = 0; i < draws; ++i) {
    const int t = s.next(logits.data(), 6);
    ASSERT_TRUE(inside.count(t)) << "draw " << i << " picked id " << t << " outside the nucleus";
    ++count[t];
  }
  // Renormalised inside the nucleus: 0.5, 0.3125, 0.1875; within 5 standard deviations.
  for (int k = 0; k < 3; ++k) {
    const double p = probs[k] / 0.80, sd = std::sqrt(draws * p * (1 - p));
    EXPECT_NEAR(count[id[k]], draws * p, 5 * sd) << "token of probability " << probs[k];
  }
}

TEST(Sampler, SameSeedSameDrawsOtherSeedOtherDraws) {
  std::mt19937_64 rng(test::test_seed() + 2);
  const int n = 50, steps = 64;
  std::vector<std::vector<float>> logits;
  for (int i = 0; i < steps; ++i) logits.push_back(test::random_vector<float>(n, rng, 1.0));
  auto run = [&](std::uint64_t seed) {
    gen::Sampler s(0.9, 0.95, seed);
    std::vector<int> out;
    for (const auto& l : logits) out.push_back(s.next(l.data(), n));
    return out;
  };
  const std::uint64_t seed = test::test_seed();
  EXPECT_EQ(run(seed), run(seed));
  EXPECT_NE(run(seed), run(seed + 1));  // 64 draws over ~40 plausible tokens: never all equal
}

TEST(Sampler, TemperatureToZeroIsGreedy) {
  std::mt19937_64 rng(test::test_seed() + 3);
  gen::Sampler cold(1e-6, 0.9, test::test_seed());
  for (int i = 0; i < 200; ++i) {
    const auto l = test::random_vector<float>(1000, rng, 3.0);
    EXPECT_EQ(cold.next(l.data(), 1000), gen::argmax(l.data(), 1000));
  }
}

TEST(Sampler, RestrictedToTheFirstNIds) {
  // Only logits[0, n) count: a huge logit beyond n is never drawn (the padding rows of an
  // embedding larger than the tokenizer's vocabulary).
  std::vector<float> l = {0.1f, 0.2f, 0.3f, 100.0f};
  gen::Sampler s(2.0, 1.0, 5);
  for (int i = 0; i < 100; ++i) EXPECT_LT(s.next(l.data(), 3), 3);
  EXPECT_EQ(gen::argmax(l.data(), 3), 2);
}

TEST(Utf8Stream, HoldsBackOnlyAnIncompleteLastSequence) {
  using gen::utf8_complete_prefix;
  EXPECT_EQ(utf8_complete_prefix(""), 0u);
  EXPECT_EQ(utf8_complete_prefix("abc"), 3u);
  const std::string euro = "\xE2\x82\xAC";       // U+20AC, 3 bytes
  const std::string emoji = "\xF0\x9F\x98\x80";  // U+1F600, 4 bytes
  EXPECT_EQ(utf8_complete_prefix("a" + euro), 4u);
  EXPECT_EQ(utf8_complete_prefix("a" + euro.substr(0, 1)), 1u);
  EXPECT_EQ(utf8_complete_prefix("a" + euro.substr(0, 2)), 1u);
  EXPECT_EQ(utf8_complete_prefix(emoji), 4u);
  for (int k = 1; k < 4; ++k) EXPECT_EQ(utf8_complete_prefix("x" + emoji.substr(0, k)), 1u) << k;
  EXPECT_EQ(utf8_complete_prefix("\xC3\xA9"), 2u);  // é
  EXPECT_EQ(utf8_complete_prefix("\xC3"), 0u);
  // Invalid bytes are never held back: stray continuation bytes, a lead byte cut by ASCII,
  // bytes that lead nothing.
  EXPECT_EQ(utf8_complete_prefix("a\x80\x80"), 3u);
  EXPECT_EQ(utf8_complete_prefix("\xE2"
                                 "A"),
            2u);
  EXPECT_EQ(utf8_complete_prefix("a\xFF"), 2u);
  // Streaming a text cut at every byte gives the text back, each piece whole UTF-8.
  const std::string text = "h\xC3\xA9llo " + euro + emoji + " ok";
  std::string pending, out;
  for (char ch : text) {
    pending += ch;
    const std::size_t n = utf8_complete_prefix(pending);
    out += pending.substr(0, n);
    pending.erase(0, n);
  }
  EXPECT_EQ(out, text);
  EXPECT_TRUE(pending.empty());
}

}  // namespace
}  // namespace qt
