// Vocabulary-parallel embedding and cross-entropy: the serial ops of src/ops/cpu with the
// vocabulary split over tp and the row statistics reduced over it.
#include "model/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "ops/cross_entropy.h"

namespace qt::cpu {

namespace {
bool mine(std::int32_t id, int begin, int v_local) { return id >= begin && id < begin + v_local; }
}  // namespace

void embedding_lookup_vp(float* x, const std::int32_t* ids, const float* wte_local, int N, int C,
                         int begin, int v_local) {
  for (int n = 0; n < N; ++n) {
    float* out = x + static_cast<std::size_t>(n) * C;
    if (mine(ids[n], begin, v_local)) {
      const float* row = wte_local + static_cast<std::size_t>(ids[n] - begin) * C;
      std::copy(row, row + C, out);
    } else {
      std::fill(out, out + C, 0.0f);
    }
  }
}

void embedding_backward_vp(float* dwte_local, const float* dx, const std::int32_t* ids, int N,
                           int C, int begin, int v_local) {
  for (int n = 0; n < N; ++n) {
    if (!mine(ids[n], begin, v_local)) continue;
    float* row = dwte_local + static_cast<std::size_t>(ids[n] - begin) * C;
    const float* g = dx + static_cast<std::size_t>(n) * C;
    for (int c = 0; c < C; ++c) row[c] += g[c];
  }
}

double cross_entropy_forward_vp(float* losses, float* lse, const float* logits_local,
                                const std::int32_t* targets, int N, int v_local, int begin,
                                Comm& tp) {
  const std::size_t rows = static_cast<std::size_t>(N);
  std::vector<double> m(rows), s(rows), t(rows, 0.0);  // row max, sum of exp, target logit
  for (std::size_t n = 0; n < rows; ++n) {
    const float* row = logits_local + n * v_local;
    double mx = row[0];
    for (int v = 1; v < v_local; ++v) mx = row[v] > mx ? double(row[v]) : mx;
    m[n] = mx;
  }
  tp.all_reduce(m.data(), rows, DType::kF64, ReduceOp::kMax);
  for (std::size_t n = 0; n < rows; ++n) {
    const float* row = logits_local + n * v_local;
    double sum = 0.0;
    for (int v = 0; v < v_local; ++v) sum += std::exp(double(row[v]) - m[n]);
    s[n] = sum;
    if (targets[n] != kIgnoreIndex && mine(targets[n], begin, v_local))
      t[n] = row[targets[n] - begin];
  }
  tp.all_reduce(s.data(), rows, DType::kF64, ReduceOp::kSum);
  tp.all_reduce(t.data(), rows, DType::kF64, ReduceOp::kSum);
  double total = 0.0;
  for (std::size_t n = 0; n < rows; ++n) {
    const double l = m[n] + std::log(s[n]);
    lse[n] = static_cast<float>(l);
    if (targets[n] == kIgnoreIndex) {
      losses[n] = 0.0f;
      continue;
    }
    const double loss = l - t[n];
    losses[n] = static_cast<float>(loss);
    total += loss;
  }
  return total;
}

void cross_entropy_backward_vp(float* dlogits, const float* logits, const float* lse,
                               const std::int32_t* targets, float scale, int N, int v_local,
                               int begin) {
  for (int n = 0; n < N; ++n) {
    const std::size_t off = static_cast<std::size_t>(n) * v_local;
    const float* row = logits + off;
    float* drow = dlogits + off;
    const std::int32_t t = targets[n];
    if (t == kIgnoreIndex) {
      std::fill(drow, drow + v_local, 0.0f);
      continue;
    }
    const double l = lse[n], sc = scale;
    const int local_t = mine(t, begin, v_local) ? t - begin : -1;
    for (int v = 0; v < v_local; ++v) {  // row[v] is read before drow[v] is written
      const double p = std::exp(double(row[v]) - l);
      drow[v] = static_cast<float>(sc * (v == local_t ? p - 1.0 : p));
    }
  }
}

}  // namespace qt::cpu
