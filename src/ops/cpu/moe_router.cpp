// Qwen3-MoE router and load-balancing loss (ops/moe_router.h): softmax in the input's precision
// with the row maximum subtracted, top-k by a stable partial sort.
#include "ops/moe_router.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>

#include "qtrain/error.h"

namespace qt::cpu {
namespace {

// d logits of one row from d probs: p (dp - sum p dp), the softmax's backward; adds when acc.
template <typename T>
void softmax_row_backward(T* dlogits, const T* dp, const T* p, int E, bool acc) {
  T dot = 0;
  for (int e = 0; e < E; ++e) dot += p[e] * dp[e];
  for (int e = 0; e < E; ++e) {
    const T g = p[e] * (dp[e] - dot);
    dlogits[e] = acc ? dlogits[e] + g : g;
  }
}

}  // namespace

template <typename T>
void router_forward(T* probs, int* idx, T* weight, const T* logits, int N, int E, int k,
                    bool norm_topk, const T* bias) {
  QT_CHECK(E >= 1 && k >= 1 && k <= E, "top-{} of {} experts", k, E);
  std::vector<int> order(static_cast<std::size_t>(E));
  std::vector<T> score(bias ? static_cast<std::size_t>(E) : 0);  // p + bias: the choice's key
  for (int t = 0; t < N; ++t) {
    const T* x = logits + static_cast<std::size_t>(t) * E;
    T* p = probs + static_cast<std::size_t>(t) * E;
    const T m = *std::max_element(x, x + E);
    T sum = 0;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(x[e] - m));
    for (int e = 0; e < E; ++e) p[e] /= sum;
    const T* c = p;  // what the top-k ranks
    if (bias) {
      for (int e = 0; e < E; ++e) score[e] = p[e] + bias[e];
      c = score.data();
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [c](int a, int b) { return c[a] > c[b] || (c[a] == c[b] && a < b); });
    int* ix = idx + static_cast<std::size_t>(t) * k;
    T* w = weight + static_cast<std::size_t>(t) * k;
    T picked = 0;
    for (int j = 0; j < k; ++j) picked += (w[j] = p[ix[j] = order[j]]);
    if (norm_topk)
      for (int j = 0; j < k; ++j) w[j] /= picked;
  }
}

// With norm_topk w_j = p_j / S (S the picked probabilities' sum): dp_j = (dw_j - sum dw w) / S.
template <typename T>
void router_backward(T* dlogits, const T* dweight, const T* probs, const int* idx, int N, int E,
                     int k, bool norm_topk) {
  std::vector<T> dp(static_cast<std::size_t>(E));
  for (int t = 0; t < N; ++t) {
    const T* p = probs + static_cast<std::size_t>(t) * E;
    const int* ix = idx + static_cast<std::size_t>(t) * k;
    const T* dw = dweight + static_cast<std::size_t>(t) * k;
    std::fill(dp.begin(), dp.end(), T(0));
    if (norm_topk) {
      T picked = 0, dot = 0;
      for (int j = 0; j < k; ++j) picked += p[ix[j]];
      for (int j = 0; j < k; ++j) dot += dw[j] * p[ix[j]] / picked;
      for (int j = 0; j < k; ++j) dp[ix[j]] = (dw[j] - dot) / picked;
    } else {
      for (int j = 0; j < k; ++j) dp[ix[j]] = dw[j];
    }
    softmax_row_backward(dlogits + static_cast<std::size_t>(t) * E, dp.data(), p, E, false);
  }
}

template <typename T>
void router_balance_add(RouterBalance& b, const T* probs, const int* idx, int N, int k) {
  const int E = static_cast<int>(b.count.size());
  for (int t = 0; t < N; ++t) {
    for (int e = 0; e < E; ++e) b.psum[e] += probs[static_cast<std::size_t>(t) * E + e];
    for (int j = 0; j < k; ++j) b.count[idx[static_cast<std::size_t>(t) * k + j]] += 1;
  }
  b.tokens += N;
}

double router_aux_loss(const RouterBalance& b) {
  if (b.tokens == 0) return 0;
  double s = 0;
  for (std::size_t e = 0; e < b.count.size(); ++e) s += b.count[e] * b.psum[e];
  return static_cast<double>(b.count.size()) * s / (b.tokens * b.tokens);
}

// d aux / d p[t, e] = E f[e] / tokens for every token of every layer.
template <typename T>
void router_aux_backward(T* dlogits, const RouterBalance& b, const T* probs, int N, T coef) {
  const int E = static_cast<int>(b.count.size());
  if (b.tokens == 0) return;
  std::vector<T> dp(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e)
    dp[e] = static_cast<T>(coef * E * b.count[e] / (b.tokens * b.tokens));
  for (int t = 0; t < N; ++t)
    softmax_row_backward(dlogits + static_cast<std::size_t>(t) * E, dp.data(),
                         probs + static_cast<std::size_t>(t) * E, E, true);
}

void router_bias_update(float* bias, const double* load, int layers, int E, double rate) {
  for (int l = 0; l < layers; ++l) {
    const double* n = load + static_cast<std::size_t>(l) * E;
    float* b = bias + static_cast<std::size_t>(l) * E;
    // load < mean as E load < sum: whole token-slot counts, exact in double (below 2^53), so the
    // signs have no rounding and every rank, holding the same loads, takes the same ones.
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += n[e];
    for (int e = 0; e < E; ++e) {
      const double en = E * n[e];
      b[e] += static_cast<float>(rate * ((en < sum) - (en > sum)));
    }
  }
}

#define QT_ROUTER(T)                                                                         \
  template void router_forward<T>(T*, int*, T*, const T*, int, int, int, bool, const T*);    \
  template void router_backward<T>(T*, const T*, const T*, const int*, int, int, int, bool); \
  template void router_balance_add<T>(RouterBalance&, const T*, const int*, int, int);       \
  template void router_aux_backward<T>(T*, const RouterBalance&, const T*, int, T);
QT_ROUTER(float)
QT_ROUTER(double)
#undef QT_ROUTER

}  // namespace qt::cpu
