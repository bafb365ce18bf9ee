// Synthetic data with a known loss floor: a random first-order Markov chain.
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <vector>

#include "qtrain/data.h"
#include "qtrain/error.h"
#include "runtime/rng.h"

namespace qt {

namespace {

class MarkovSource final : public DataSource {
 public:
  MarkovSource(int vocab, int branching, std::uint64_t seed)
      : V_(vocab), K_(std::min(branching, vocab)), seed_(rng::hash_combine(seed, 0x4D61726B6F76ull)) {
    QT_CHECK(V_ > 0 && K_ > 0, "Markov chain needs vocab > 0 and branching > 0");
    next_.resize(static_cast<std::size_t>(V_) * K_);
    cdf_.resize(next_.size());
    const std::uint64_t s = rng::hash_combine(seed_, 1);
    std::uint64_t draw = 0;
    for (int i = 0; i < V_; ++i) {
      // K distinct successors, weights exponential(1) so the probabilities are Dirichlet(1).
      int* succ = &next_[static_cast<std::size_t>(i) * K_];
      double* cdf = &cdf_[static_cast<std::size_t>(i) * K_];
      for (int k = 0; k < K_;) {
        const int cand = static_cast<int>(rng::bits(s, draw++) % static_cast<std::uint64_t>(V_));
        if (std::find(succ, succ + k, cand) == succ + k) succ[k++] = cand;
      }
      double total = 0;
      for (int k = 0; k < K_; ++k) total += (cdf[k] = -std::log(rng::uniform(s, draw++)));
      double acc = 0;
      for (int k = 0; k < K_; ++k) cdf[k] = (acc += cdf[k] / total);
      cdf[K_ - 1] = 1.0;
    }
    compute_floor();
  }

  void sample(std::int64_t index, std::int32_t* inputs, std::int32_t* targets,
              std::int32_t* positions, int T) const override {
    const std::uint64_t s = rng::hash_combine(seed_, 2 + static_cast<std::uint64_t>(index));
    // Start uniformly, then burn in so the window starts (very nearly) from the stationary
    // distribution that the loss floor assumes.
    int x = static_cast<int>(rng::bits(s, 0) % static_cast<std::uint64_t>(V_));
    std::uint64_t draw = 1;
    for (int i = 0; i < kBurnIn; ++i) x = step(x, rng::uniform(s, draw++));
    for (int t = 0; t <= T; ++t) {
      if (t < T) inputs[t] = x;
      if (t > 0) targets[t - 1] = x;
      if (t < T) x = step(x, rng::uniform(s, draw++));
    }
    if (positions)
      for (int t = 0; t < T; ++t) positions[t] = t;  // one sequence: plain causal
  }

  double loss_floor() const override { return floor_; }

  std::string describe() const override {
    return fmt::format("synthetic Markov chain: {} tokens, {} successors each, entropy rate {:.4f} nats",
                       V_, K_, floor_);
  }

 private:
  static constexpr int kBurnIn = 256;

  int step(int x, double u) const {
    const double* cdf = &cdf_[static_cast<std::size_t>(x) * K_];
    int k = 0;
    while (k < K_ - 1 && u > cdf[k]) ++k;
    return next_[static_cast<std::size_t>(x) * K_ + k];
  }

  // Entropy rate sum_i pi_i H(P_i) with pi the Cesaro average of power iterations from the
  // uniform distribution (a stationary distribution even for a periodic chain).
  void compute_floor() {
    std::vector<double> p(V_, 1.0 / V_), q(V_), avg(V_, 0.0), h(V_, 0.0);
    for (int i = 0; i < V_; ++i) {
      double prev = 0;
      for (int k = 0; k < K_; ++k) {
        const double pk = cdf_[static_cast<std::size_t>(i) * K_ + k] - prev;
        prev = cdf_[static_cast<std::size_t>(i) * K_ + k];
        if (pk > 0) h[i] -= pk * std::log(pk);
      }
    }
    constexpr int kIters = 1000, kAverage = 500;
    for (int it = 0; it < kIters; ++it) {
      std::fill(q.begin(), q.end(), 0.0);
      for (int i = 0; i < V_; ++i) {
        double prev = 0;
        for (int k = 0; k < K_; ++k) {
          const std::size_t e = static_cast<std::size_t>(i) * K_ + k;
          q[next_[e]] += p[i] * (cdf_[e] - prev);
          prev = cdf_[e];
        }
      }
      p.swap(q);
      if (it >= kIters - kAverage)
        for (int i = 0; i < V_; ++i) avg[i] += p[i] / kAverage;
    }
    floor_ = 0;
    for (int i = 0; i < V_; ++i) floor_ += avg[i] * h[i];
  }

  int V_, K_;
  std::uint64_t seed_;
  std::vector<int> next_;      // [V, K] successors
  std::vector<double> cdf_;    // [V, K] cumulative probabilities
  double floor_ = 0;
};

}  // namespace

std::unique_ptr<DataSource> make_synthetic_source(int vocab, int branching, std::uint64_t seed) {
  return std::make_unique<MarkovSource>(vocab, branching, seed);
}

std::unique_ptr<DataSource> make_data_source(const Deck& deck) {
  if (deck.data.source == "file") {
    TokenSplit split;  // eval.split: the held-out windows are the evaluation's (train/evaluation.h)
    if (deck.eval.split > 0) split = {TokenSplit::Part::kTrain, deck.eval.split};
    return open_token_file(deck.data.path, deck.model.vocab_size, deck.train.seq_len,
                           deck.train.seed, packing_from_name(deck.data.packing), split);
  }
  return make_synthetic_source(deck.model.vocab_size, deck.data.synthetic_branching,
                               deck.train.seed);
}

}  // namespace qt
