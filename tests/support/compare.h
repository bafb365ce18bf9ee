// Relative error of a result against a reference, ||got - want|| / ||want||, accumulated in
// double. Any non-finite value in `got` gives infinity, so NaN never passes a tolerance.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace qt::test {

template <typename A, typename B>
double rel_error(const A* got, const B* want, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
    num += (g - w) * (g - w);
    den += w * w;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

template <typename A, typename B>
double rel_error(const std::vector<A>& got, const std::vector<B>& want) {
  return rel_error(got.data(), want.data(), want.size());
}

}  // namespace qt::test
