// Helpers for the CUDA op tests: the tolerance table, bf16 inputs that both back ends see alike,
// downloads to double, and the checks every output gets (relative error, NaN/Inf, guard bytes).
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "ops/check.h"  // rel_err (NaN and Inf never pass), test_rng, random_f32_exact

namespace qt::test {

using bf16 = __nv_bfloat16;

// Relative error bounds, ||gpu - cpu|| / ||cpu|| over a whole tensor, the CPU op in double on the
// same (bf16-rounded) inputs as the reference. Rounding to bf16 (8 significant bits) moves a
// value by at most 2^-8 = 3.9e-3 of itself (about 1.1e-3 RMS over many values); a tensor whose
// norm sits in a few elements (cross-entropy's target entries) can come close to that bound.
inline constexpr double kTolBf16 = 1e-2;      // bf16 outputs after up to ~5 rounding steps
inline constexpr double kTolBf16Once = 5e-3;  // bf16 outputs rounded once from fp32 math
// A whole model's outputs (logits, the total gradient) against the fp32 CPU model on the same
// bf16 weights: bf16 activations through every layer, ~15 rounding steps each. Seen on an H100:
// 0.8e-2 to 1.4e-2 for two-layer models.
inline constexpr double kTolBf16Model = 2e-2;
// fp32 outputs (statistics, weight gradients): kTolF32 = 1e-5, from ops/check.h.

inline bf16 to_bf16(double x) { return __float2bfloat16_rn(static_cast<float>(x)); }
inline double from_bf16(bf16 x) { return static_cast<double>(__bfloat162float(x)); }

// x rounded to the nearest bf16, as a double.
inline double round_bf16(double x) { return from_bf16(to_bf16(x)); }

// Random normal values rounded to bf16: `value` for the CPU, `bits` for the GPU.
struct Bf16Input {
  Vec value;
  std::vector<bf16> bits;
};
inline Bf16Input random_bf16(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  Bf16Input in{random_vector<double>(n, rng, scale), std::vector<bf16>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    in.bits[i] = to_bf16(in.value[i]);
    in.value[i] = from_bf16(in.bits[i]);
  }
  return in;
}

inline Vec to_double(const std::vector<bf16>& v) {
  Vec d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) d[i] = from_bf16(v[i]);
  return d;
}
inline Vec to_double(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

template <typename T>
Vec download(const GuardedBuffer<T>& b) {
  return to_double(b.download());
}

// A device buffer that starts as NaN (bf16 or fp32), so an element the op forgets to write fails.
template <typename T>
void fill_nan(GuardedBuffer<T>& b) {
  QT_CHECK_CUDA(cudaMemset(b.get(), 0xFF, b.bytes()));  // all-ones bits: a NaN in bf16 and fp32
  QT_CHECK_CUDA(cudaDeviceSynchronize());
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Relative error of a GPU result against the reference, with the guard bytes checked too.
#define QT_EXPECT_GPU_CLOSE(buf, want, tol)                                                     \
  do {                                                                                          \
    const double qt_err_ = ::qt::test::rel_err(::qt::test::download(buf), want);                \
    EXPECT_LT(qt_err_, tol) << #buf " vs " #want;                                               \
    EXPECT_TRUE((buf).guard_intact()) << #buf ": write past the end";                           \
    ::testing::Test::RecordProperty(#buf "_rel_err", std::to_string(qt_err_));                  \
    std::printf("[ err ] %-28s %-22s rel err %.3e (tol %.0e)\n",                                \
                ::testing::UnitTest::GetInstance()->current_test_info()->name(), #buf, qt_err_, \
                static_cast<double>(tol));                                                      \
  } while (0)

}  // namespace qt::test
