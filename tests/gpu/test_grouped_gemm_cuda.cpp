// The experts' grouped GEMMs on the GPU (ops/cuda/grouped_gemm.cuh, behind cuda/grouped_gemm.h)
// against a double-precision host reference on the same bf16 inputs: forward, input gradient and
// weight gradient (written and accumulated; scaled and added to old outputs), with the groups'
// offsets only on the device. Uneven
// groups: empty ones, single rows, counts that are no multiple of any tile, more groups than a
// warp scans at once, and in / out that are no multiple of 128 (or of 8) (the tiny models' H = 128,
// Im = 64; the real H = 2048, Im = 768, 2 Im = 1536). Every output starts as NaN; each group's
// rows are compared on their own (an empty group's weight gradient must be exactly zero).
#include <gtest/gtest.h>

#include <cstdio>
#include <numeric>
#include <vector>

#include "cuda/grouped_gemm.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/grouped_gemm.cuh"
#include "cuda_op_check.h"

namespace qt::test {
namespace {

struct GroupedCase {
  int in, out;
  std::vector<int> counts;
};

std::vector<int> offsets_of(const std::vector<int>& counts) {
  std::vector<int> off(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), off.begin() + 1);
  return off;
}

// Relative error of rows [r0, r1) (row length n) of got against want.
double rows_err(const Vec& got, const Vec& want, std::size_t r0, std::size_t r1, std::size_t n) {
  return rel_err(Vec(got.begin() + r0 * n, got.begin() + r1 * n),
                 Vec(want.begin() + r0 * n, want.begin() + r1 * n));
}

void check_case(const GroupedCase& c) {
  const int G = static_cast<int>(c.counts.size()), in = c.in, out = c.out;
  const std::vector<int> off = offsets_of(c.counts);
  const int rows = off.back();
  const std::size_t R = rows, I = in, O = out;
  std::printf("[ seed ] %llu  groups %d rows %d in %d out %d\n",
              static_cast<unsigned long long>(test_seed()), G, rows, in, out);
  auto rng = test_rng();
  const Bf16Input x = random_bf16(R * I, rng), w = random_bf16(G * O * I, rng, 0.05),
                  dy = random_bf16(R * O, rng), dw0 = random_bf16(G * O * I, rng);

  // The reference in double.
  Vec y(R * O, 0.0), dx(R * I, 0.0), dw(G * O * I, 0.0);
  for (int g = 0; g < G; ++g) {
    const double* wg = w.value.data() + g * O * I;
    for (int r = off[g]; r < off[g + 1]; ++r) {
      const double* xr = x.value.data() + r * I;
      const double* dyr = dy.value.data() + r * O;
      for (std::size_t o = 0; o < O; ++o) {
        double s = 0;
        for (std::size_t i = 0; i < I; ++i) s += xr[i] * wg[o * I + i];
        y[r * O + o] = s;
        double* dwo = dw.data() + (g * O + o) * I;
        for (std::size_t i = 0; i < I; ++i) {
          dx[r * I + i] += dyr[o] * wg[o * I + i];
          dwo[i] += dyr[o] * xr[i];
        }
      }
    }
  }

  GuardedBuffer<int> d_off(off);
  GuardedBuffer<bf16> d_x(x.bits), d_w(w.bits), d_dy(dy.bits), d_y(R * O), d_dx(R * I);
  GuardedBuffer<float> d_dw(G * O * I);
  fill_nan(d_y);
  fill_nan(d_dx);
  fill_nan(d_dw);
  cuda::grouped_linear(d_y.get(), d_x.get(), d_w.get(), d_off.get(), G, rows, in, out, nullptr);
  cuda::grouped_linear_backward(d_dx.get(), d_dw.get(), d_dy.get(), d_x.get(), d_w.get(),
                                d_off.get(), G, rows, in, out, nullptr, false);
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  QT_EXPECT_GPU_CLOSE(d_y, y, kTolBf16Once);
  QT_EXPECT_GPU_CLOSE(d_dx, dx, kTolBf16Once);
  QT_EXPECT_GPU_CLOSE(d_dw, dw, 1e-4);
  const Vec gy = download(d_y), gdx = download(d_dx), gdw = download(d_dw);
  for (int g = 0; g < G; ++g) {
    if (c.counts[g] > 0) {
      EXPECT_LT(rows_err(gy, y, off[g], off[g + 1], O), kTolBf16Once) << "y of group " << g;
      EXPECT_LT(rows_err(gdx, dx, off[g], off[g + 1], I), kTolBf16Once) << "dx of group " << g;
    }
    EXPECT_LT(rows_err(gdw, dw, g * O, (g + 1) * O, I), 1e-4)
        << "dw of group " << g << " (" << c.counts[g] << " rows)";
  }

  // Accumulated onto a random gradient: empty groups keep theirs.
  std::vector<float> dw0_f(dw0.value.begin(), dw0.value.end());
  d_dw.upload(dw0_f);
  cuda::grouped_linear_backward(nullptr, d_dw.get(), d_dy.get(), d_x.get(), d_w.get(),
                                d_off.get(), G, rows, in, out, nullptr, true);
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  Vec dw_acc(dw.size());
  for (std::size_t i = 0; i < dw.size(); ++i)
    dw_acc[i] = static_cast<double>(dw0_f[i]) + dw[i];
  QT_EXPECT_GPU_CLOSE(d_dw, dw_acc, 1e-4);

  // Scaled and accumulated (LoRA's terms on the experts, cuda_ops_moe.cpp): y0 + alpha x w^T,
  // dx0 + alpha dy w and dw0 + alpha dy^T x, onto random bf16 outputs; rows outside every group
  // keep their old value.
  const double alpha = 0.37;
  const Bf16Input y0 = random_bf16(R * O, rng), dx0 = random_bf16(R * I, rng);
  d_y.upload(y0.bits);
  d_dx.upload(dx0.bits);
  d_dw.upload(dw0_f);
  cuda::grouped_linear(d_y.get(), d_x.get(), d_w.get(), d_off.get(), G, rows, in, out, nullptr,
                       static_cast<float>(alpha), true);
  cuda::grouped_linear_backward(d_dx.get(), d_dw.get(), d_dy.get(), d_x.get(), d_w.get(),
                                d_off.get(), G, rows, in, out, nullptr, true,
                                static_cast<float>(alpha), true);
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  Vec y_add(y.size()), dx_add(dx.size()), dw_add(dw.size());
  for (std::size_t i = 0; i < y.size(); ++i) y_add[i] = y0.value[i] + alpha * y[i];
  for (std::size_t i = 0; i < dx.size(); ++i) dx_add[i] = dx0.value[i] + alpha * dx[i];
  for (std::size_t i = 0; i < dw.size(); ++i) dw_add[i] = double(dw0_f[i]) + alpha * dw[i];
  QT_EXPECT_GPU_CLOSE(d_y, y_add, kTolBf16Once);
  QT_EXPECT_GPU_CLOSE(d_dx, dx_add, kTolBf16Once);
  QT_EXPECT_GPU_CLOSE(d_dw, dw_add, 1e-4);
}

class CudaGroupedGemm : public ::testing::TestWithParam<GroupedCase> {};

// Each case on the mma.sync kernel and, where the GPU, the build and the shapes allow it (in, out
// multiples of 8), on the sm_90a wgmma kernel.
TEST_P(CudaGroupedGemm, MatchesDoubleReference) {
  QT_REQUIRE_GPU();
  const GroupedCase& c = GetParam();
  struct Restore {
    ~Restore() { cuda::set_grouped_gemm_kernel(cuda::GroupedGemmKernel::kAuto); }
  } restore;
  cuda::set_grouped_gemm_kernel(cuda::GroupedGemmKernel::kMma);
  {
    SCOPED_TRACE("mma.sync kernel");
    check_case(c);
  }
  if (cuda::attention_wgmma_available() && c.in % 8 == 0 && c.out % 8 == 0) {
    cuda::set_grouped_gemm_kernel(cuda::GroupedGemmKernel::kWgmma);
    SCOPED_TRACE("wgmma kernel");
    check_case(c);
  } else {
    std::printf("[ note ] wgmma kernel not run: %s\n",
                cuda::attention_wgmma_available() ? "in or out no multiple of 8"
                                                  : "no sm_90a kernel for this GPU");
  }
}

// Counts for G groups: a deterministic uneven mix (0, 1, small, tile-crossing, large).
std::vector<int> uneven(int G, int scale) {
  static const int pattern[] = {0, 1, 37, 128, 129, 0, 255, 5, 64, 300, 0, 17, 1, 131, 2, 90};
  std::vector<int> c(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g) c[g] = pattern[g % 16] * scale / 4;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaGroupedGemm,
    ::testing::Values(
        GroupedCase{128, 128, {0, 1, 37, 128, 129, 0, 300, 5}},  // tiny model gate_up (2 Im)
        GroupedCase{64, 128, {3, 0, 0, 200, 1, 64, 65, 127}},    // tiny model down (Im -> H)
        GroupedCase{128, 64, {1, 1, 1, 1, 0, 250}},              // out of 64
        GroupedCase{72, 200, {0, 33, 129, 7, 0, 256}},           // no multiple of 16 / 128
        GroupedCase{60, 44, {5, 0, 140, 1, 66}},                 // no multiple of 8
        GroupedCase{13, 7, {3, 129, 0, 1}},                      // odd widths
        GroupedCase{128, 64, uneven(70, 4)},                     // > 32 groups, some empty
        GroupedCase{128, 64, {0, 0, 0, 0}},                      // no rows at all
        GroupedCase{2048, 1536, uneven(6, 8)},                   // 30B-A3B gate_up
        GroupedCase{768, 2048, uneven(6, 8)},                    // 30B-A3B down
        GroupedCase{2048, 16, uneven(5, 8)},                     // a rank-16 adapter's A
        GroupedCase{16, 1536, uneven(5, 8)},                     // and its B
        GroupedCase{264, 392, uneven(9, 12)}),                   // wide tiles, partly filled
    [](const ::testing::TestParamInfo<GroupedCase>& info) {
      return "in" + std::to_string(info.param.in) + "_out" + std::to_string(info.param.out) +
             "_g" + std::to_string(info.param.counts.size()) + "_" + std::to_string(info.index);
    });

}  // namespace
}  // namespace qt::test
