// Choosing the next token from logits (docs/generate.md): greedy (temperature 0), or sampling
// from softmax(logits / temperature) restricted to the top-p nucleus, as transformers' generate
// does with do_sample (temperature applied first, then top-p). Draws come from the counter-based
// RNG (src/runtime/rng.h): draw k of a run with seed s is a pure function of (s, k).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace qt::gen {

// The id of the largest logit among logits[0, n) (the lowest such id on ties).
std::int32_t argmax(const float* logits, int n);

// The top-p nucleus of softmax(logits[0, n) / temperature): (id, probability) in decreasing
// probability (lower id first on ties), the shortest prefix whose probabilities sum to at least
// top_p, i.e. every token whose predecessors sum to less than top_p (at least one token).
// temperature > 0; top_p in (0, 1]. Probabilities are those of the full distribution.
std::vector<std::pair<std::int32_t, double>> nucleus(const float* logits, int n, double temperature,
                                                     double top_p);

class Sampler {
 public:
  // temperature 0: greedy (top_p and seed unused); > 0: sampling.
  Sampler(double temperature, double top_p, std::uint64_t seed);

  // The next token among logits[0, n); each call with temperature > 0 takes one draw.
  std::int32_t next(const float* logits, int n);
  std::uint64_t draws() const { return draws_; }

 private:
  double temperature_, top_p_;
  std::uint64_t stream_, draws_ = 0;
};

}  // namespace qt::gen
