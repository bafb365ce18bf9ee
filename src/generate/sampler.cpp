// Greedy and top-p sampling (sampler.h).
#include "generate/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "qtrain/error.h"
#include "runtime/rng.h"

namespace qt::gen {

std::int32_t argmax(const float* logits, int n) {
  QT_CHECK(n >= 1, "argmax over {} logits", n);
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  QT_CHECK(std::isfinite(logits[best]), "the largest logit is {} (NaN or infinite logits)",
           logits[best]);
  return best;
}

std::vector<std::pair<std::int32_t, double>> nucleus(const float* logits, int n, double temperature,
                                                     double top_p) {
  QT_CHECK(temperature > 0 && top_p > 0 && top_p <= 1, "temperature {} top_p {}", temperature,
           top_p);
  const double m = logits[argmax(logits, n)];
  std::vector<double> p(static_cast<std::size_t>(n));
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    // NaN logits never win argmax; give them no weight rather than poison the sum.
    const double z = (static_cast<double>(logits[i]) - m) / temperature;
    p[i] = std::isnan(z) ? 0.0 : std::exp(z);
    sum += p[i];
  }
  std::vector<std::pair<std::int32_t, double>> out;
  if (top_p >= 1) {  // every token with weight; no sort needed
    for (int i = 0; i < n; ++i)
      if (p[i] > 0) out.emplace_back(i, p[i] / sum);
    return out;
  }
  // The most probable k tokens in order (partial sort; k grows until they hold top_p), so a
  // 151936-token vocabulary is not sorted in full at every step.
  const auto first = [&](std::int32_t a, std::int32_t b) {
    return p[a] > p[b] || (p[a] == p[b] && a < b);
  };
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t k = std::min<std::size_t>(order.size(), 256);;
       k = std::min(order.size(), 8 * k)) {
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                      first);
    out.clear();
    double before = 0;  // probability of the tokens ahead of this one
    for (std::size_t i = 0; i < k && before < top_p && p[order[i]] > 0; ++i) {
      out.emplace_back(order[i], p[order[i]] / sum);
      before += p[order[i]] / sum;
    }
    if (before >= top_p || k == order.size() || (k > 0 && p[order[k - 1]] == 0)) return out;
  }
}

Sampler::Sampler(double temperature, double top_p, std::uint64_t seed)
    : temperature_(temperature),
      top_p_(top_p),
      stream_(rng::hash_combine(seed, 0x6E6578745F746F6Bull)) {
  QT_CHECK(temperature >= 0 && top_p > 0 && top_p <= 1, "temperature {} top_p {}", temperature,
           top_p);
}

std::int32_t Sampler::next(const float* logits, int n) {
  if (temperature_ == 0) return argmax(logits, n);
  const auto nuc = nucleus(logits, n, temperature_, top_p_);
  double total = 0;
  for (const auto& [id, prob] : nuc) total += prob;
  // u in (0, total): the first token whose cumulative probability passes u.
  const double u = rng::uniform(stream_, draws_++) * total;
  double c = 0;
  for (const auto& [id, prob] : nuc) {
    c += prob;
    if (u < c) return id;
  }
  return nuc.back().first;  // rounding at the very end
}

}  // namespace qt::gen
