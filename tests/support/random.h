// Fresh random inputs for tests: a new seed every run unless QT_TEST_SEED is set; the seed is
// printed so a failure can be reproduced.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>
#include <vector>

namespace qt::test {

inline std::uint64_t test_seed() {
  static const std::uint64_t seed = []() -> std::uint64_t {
    if (const char* s = std::getenv("QT_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    std::uint64_t v = std::random_device{}();
    std::cerr << "[qtrain test] QT_TEST_SEED=" << v << "\n";
    return v;
  }();
  return seed;
}

template <typename T>
std::vector<T> random_vector(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(dist(rng));
  return v;
}

}  // namespace qt::test
