// Routed experts (ops/moe_experts.h): (token, slot) pairs grouped by expert, each expert's rows
// gathered into one matrix for its GEMMs (ops/linear.h), the outputs scattered back weighted.
#include "ops/moe_experts.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "ops/linear.h"
#include "qtrain/error.h"

namespace qt::cpu {
namespace {

// The kept (token, slot) pairs of each expert, tokens ascending: pairs[e] holds t * k + j.
std::vector<std::vector<int>> pairs_by_expert(const int* idx, int N, int E, int k,
                                              const std::uint8_t* keep) {
  std::vector<std::vector<int>> pairs(static_cast<std::size_t>(E));
  for (int p = 0; p < N * k; ++p) {
    QT_CHECK(idx[p] >= 0 && idx[p] < E, "token {} routed to expert {} of {}", p / k, idx[p], E);
    if (keep && !keep[p]) continue;
    pairs[static_cast<std::size_t>(idx[p])].push_back(p);
  }
  return pairs;
}

template <typename T>
T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

// One expert over its n gathered rows: gu [n, 2 Im] = xe gate_up^T, h [n, Im] = silu(gate) * up,
// ye [n, H] = h down^T.
template <typename T>
struct ExpertRun {
  std::vector<T> xe, gu, h, ye;
  ExpertRun(const T* x, const std::vector<int>& pairs, const T* gate_up, const T* down, int H,
            int Im, int k)
      : xe(pairs.size() * H), gu(pairs.size() * 2 * Im), h(pairs.size() * Im),
        ye(pairs.size() * H) {
    const int n = static_cast<int>(pairs.size());
    for (int i = 0; i < n; ++i)
      std::copy_n(x + static_cast<std::size_t>(pairs[i] / k) * H, H, xe.begin() + std::size_t(i) * H);
    linear_forward(gu.data(), xe.data(), gate_up, n, H, 2 * Im);
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < Im; ++c) {
        const T g = gu[std::size_t(i) * 2 * Im + c], u = gu[std::size_t(i) * 2 * Im + Im + c];
        h[std::size_t(i) * Im + c] = g * sigmoid(g) * u;
      }
    linear_forward(ye.data(), h.data(), down, n, Im, H);
  }
};

}  // namespace

template <typename T>
void moe_experts_forward(T* y, const T* x, const int* idx, const T* w, const T* gate_up,
                         const T* down, int N, int H, int Im, int E, int k,
                         const std::uint8_t* keep) {
  std::fill(y, y + static_cast<std::size_t>(N) * H, T(0));
  const auto pairs = pairs_by_expert(idx, N, E, k, keep);
  for (int e = 0; e < E; ++e) {
    const std::vector<int>& pe = pairs[static_cast<std::size_t>(e)];
    if (pe.empty()) continue;
    const ExpertRun<T> r(x, pe, gate_up + std::size_t(e) * 2 * Im * H,
                         down + std::size_t(e) * H * Im, H, Im, k);
    for (std::size_t i = 0; i < pe.size(); ++i) {
      T* yt = y + static_cast<std::size_t>(pe[i] / k) * H;
      for (int c = 0; c < H; ++c) yt[c] += w[pe[i]] * r.ye[i * H + c];
    }
  }
}

template <typename T>
void moe_experts_backward(T* dx, T* dw, T* dgate_up, T* ddown, const T* dy, const T* x,
                          const int* idx, const T* w, const T* gate_up, const T* down, int N,
                          int H, int Im, int E, int k, const std::uint8_t* keep) {
  QT_CHECK((dgate_up == nullptr) == (ddown == nullptr),
           "the experts' gradients: both or neither (frozen)");
  const bool frozen = dgate_up == nullptr;
  std::fill(dx, dx + static_cast<std::size_t>(N) * H, T(0));
  std::fill(dw, dw + static_cast<std::size_t>(N) * k, T(0));  // a dropped pair's stays 0
  const auto pairs = pairs_by_expert(idx, N, E, k, keep);
  for (int e = 0; e < E; ++e) {
    const std::vector<int>& pe = pairs[static_cast<std::size_t>(e)];
    if (pe.empty()) continue;
    // Expert e's weight gradients, or null (linear_backward skips a null one).
    T* dgu_w = frozen ? nullptr : dgate_up + std::size_t(e) * 2 * Im * H;
    T* ddown_w = frozen ? nullptr : ddown + std::size_t(e) * H * Im;
    const int n = static_cast<int>(pe.size());
    const T* gu_w = gate_up + std::size_t(e) * 2 * Im * H;
    const T* down_w = down + std::size_t(e) * H * Im;
    const ExpertRun<T> r(x, pe, gu_w, down_w, H, Im, k);
    // d ye = w dy (each pair's row); d w = dy . ye.
    std::vector<T> dye(std::size_t(n) * H), dh(std::size_t(n) * Im), dgu(std::size_t(n) * 2 * Im),
        dxe(std::size_t(n) * H);
    for (int i = 0; i < n; ++i) {
      const T* dyt = dy + static_cast<std::size_t>(pe[i] / k) * H;
      T dot = 0;
      for (int c = 0; c < H; ++c) {
        dye[std::size_t(i) * H + c] = w[pe[i]] * dyt[c];
        dot += dyt[c] * r.ye[std::size_t(i) * H + c];
      }
      dw[pe[i]] = dot;
    }
    linear_backward(dh.data(), ddown_w, dye.data(), r.h.data(), down_w, n,
                    Im, H);
    // SwiGLU: d gate = dh u s (1 + g (1 - s)), d up = dh g s.
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < Im; ++c) {
        const std::size_t a = std::size_t(i) * 2 * Im + c, b = a + Im;
        const T g = r.gu[a], u = r.gu[b], s = sigmoid(g), d = dh[std::size_t(i) * Im + c];
        dgu[a] = d * u * s * (T(1) + g * (T(1) - s));
        dgu[b] = d * g * s;
      }
    linear_backward(dxe.data(), dgu_w, dgu.data(), r.xe.data(),
                    gu_w, n, H, 2 * Im);
    for (int i = 0; i < n; ++i) {
      T* dxt = dx + static_cast<std::size_t>(pe[i] / k) * H;
      for (int c = 0; c < H; ++c) dxt[c] += dxe[std::size_t(i) * H + c];
    }
  }
}

template void moe_experts_forward<float>(float*, const float*, const int*, const float*,
                                         const float*, const float*, int, int, int, int, int,
                                         const std::uint8_t*);
template void moe_experts_forward<double>(double*, const double*, const int*, const double*,
                                          const double*, const double*, int, int, int, int, int,
                                          const std::uint8_t*);
template void moe_experts_backward<float>(float*, float*, float*, float*, const float*,
                                          const float*, const int*, const float*, const float*,
                                          const float*, int, int, int, int, int,
                                          const std::uint8_t*);
template void moe_experts_backward<double>(double*, double*, double*, double*, const double*,
                                           const double*, const int*, const double*,
                                           const double*, const double*, int, int, int, int, int,
                                           const std::uint8_t*);

}  // namespace qt::cpu
