// Counter-based random numbers: value i of stream s is a pure function of (s, i), so any rank can
// produce any part of a tensor or data set without communication, and results never depend on the
// mesh or on the C++ library's distributions.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace qt::rng {

// splitmix64 finaliser: a bijective 64-bit mix.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline std::uint64_t hash_combine(std::uint64_t a, std::uint64_t b) {
  return mix(a ^ mix(b + 0x632BE59BD9B4E019ull));
}

// FNV-1a, then mixed.
inline std::uint64_t hash_string(std::string_view s) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return mix(h);
}

// Draw i of stream s as 64 random bits.
inline std::uint64_t bits(std::uint64_t stream, std::uint64_t i) { return hash_combine(stream, i); }

// Uniform in (0, 1): 53 random bits, never 0.
inline double uniform(std::uint64_t stream, std::uint64_t i) {
  return (static_cast<double>(bits(stream, i) >> 11) + 0.5) * 0x1.0p-53;
}

// Standard normal by Box-Muller from two uniforms of the pair (2i, 2i+1) of a derived stream.
inline double normal(std::uint64_t stream, std::uint64_t i) {
  const std::uint64_t s = mix(stream ^ 0xA5A5A5A5A5A5A5A5ull);
  const double u1 = uniform(s, 2 * i), u2 = uniform(s, 2 * i + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace qt::rng
