// Helpers for the op tests: tolerances (one table), relative error, finite differences, guarded
// output buffers, per-test random generators.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/random.h"

namespace qt::test {

// Relative error bounds, ||got - want|| / ||want|| over a whole tensor.
inline constexpr double kTolF64 = 1e-12;  // double op against a naive double reference
inline constexpr double kTolFd = 1e-6;    // double gradient against central differences
inline constexpr double kTolF32 = 1e-5;   // float instantiation against double
inline constexpr double kFdStep = 1e-5;   // relative step of the central differences

using Vec = std::vector<double>;

// A generator per test: the run's seed mixed with the test's name, so a failure reproduces with
// QT_TEST_SEED alone, whatever tests ran before.
inline std::mt19937_64 test_rng() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  return std::mt19937_64(test_seed() ^ std::hash<std::string>{}(name));
}

// Inputs exactly representable in float, so the float and double runs see the same numbers.
inline Vec random_f32_exact(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  Vec v = random_vector<double>(n, rng, scale);
  for (auto& x : v) x = static_cast<float>(x);
  return v;
}

template <typename To, typename From>
std::vector<To> cast(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// ||got - want|| / ||want||; infinite when got or want holds a NaN or Inf, so NaN never passes.
template <typename A, typename B>
double rel_err(const A& got, const B& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    if (!std::isfinite(g) || !std::isfinite(w)) return std::numeric_limits<double>::infinity();
    num += (g - w) * (g - w);
    den += w * w;
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

#define QT_EXPECT_CLOSE(got, want, tol) \
  EXPECT_LT(::qt::test::rel_err(got, want), tol) << #got " vs " #want

inline double dot(const Vec& a, const Vec& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of f() with respect to every entry of x (perturbed in place, restored).
// Step kFdStep * max(|x|, floor): lower the floor for inputs much smaller than 1.
inline Vec fd_grad(Vec& x, const std::function<double()>& f, double floor = 1.0) {
  Vec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    const double h = kFdStep * std::max(floor, std::abs(x0));
    x[i] = x0 + h;
    const double fp = f();
    const double xp = x[i];
    x[i] = x0 - h;
    const double fm = f();
    const double xm = x[i];
    x[i] = x0;
    g[i] = (fp - fm) / (xp - xm);
  }
  return g;
}

// Output buffer with sentinel guards on both sides; the body starts as NaN (or a given value)
// so an entry the op forgets to write fails the comparison.
template <typename T>
class Guarded {
 public:
  static constexpr std::size_t kGuard = 16;
  static constexpr T kSentinel = T(-12345.75);

  explicit Guarded(std::size_t n, T fill = std::numeric_limits<T>::quiet_NaN())
      : v_(n + 2 * kGuard, kSentinel), n_(n) {
    std::fill(v_.begin() + kGuard, v_.end() - kGuard, fill);
  }
  explicit Guarded(const std::vector<T>& init)
      : v_(init.size() + 2 * kGuard, kSentinel), n_(init.size()) {
    std::copy(init.begin(), init.end(), v_.begin() + kGuard);
  }
  T* data() { return v_.data() + kGuard; }
  const T* data() const { return v_.data() + kGuard; }
  std::size_t size() const { return n_; }
  T operator[](std::size_t i) const { return v_[kGuard + i]; }
  std::vector<T> values() const { return std::vector<T>(data(), data() + n_); }
  bool guards_intact() const {
    for (std::size_t i = 0; i < kGuard; ++i)
      if (v_[i] != kSentinel || v_[kGuard + n_ + i] != kSentinel) return false;
    return true;
  }

 private:
  std::vector<T> v_;
  std::size_t n_;
};

}  // namespace qt::test
