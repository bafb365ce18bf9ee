// Routed experts (ops/moe_experts.h): (token, slot) pairs grouped by expert, each expert's rows
// gathered into one matrix for its GEMMs (ops/linear.h), the outputs scattered back weighted.
#include "ops/moe_experts.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

#include "ops/gemm.h"
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

// The adapter of expert e on one projection [in -> out]: A [r, in], B [out, r] (null: none).
template <typename T>
struct ExpertAdapter {
  const T *a = nullptr, *b = nullptr;
  T *ga = nullptr, *gb = nullptr;
};

// y[n, out] += scale * xa B^T with xa[n, r] = x[n, in] A^T written (kept for the backward).
template <typename T>
void adapter_forward(T* y, std::vector<T>& xa, const T* x, const ExpertAdapter<T>& ad, int n,
                     int in, int out, int r, T scale) {
  xa.assign(std::size_t(n) * r, T(0));
  gemm<T>(false, true, n, r, in, T(1), x, in, ad.a, in, T(0), xa.data(), r);
  gemm<T>(false, true, n, out, r, scale, xa.data(), r, ad.b, r, T(1), y, out);
}

// From dy [n, out]: dB += scale dy^T xa, dA += scale (dy B)^T x, dx [n, in] += scale (dy B) A.
template <typename T>
void adapter_backward(T* dx, const T* dy, const T* x, const std::vector<T>& xa,
                      const ExpertAdapter<T>& ad, int n, int in, int out, int r, T scale) {
  std::vector<T> g(std::size_t(n) * r);  // [n, r] dy B
  gemm<T>(true, false, out, r, n, scale, dy, out, xa.data(), r, T(1), ad.gb, r);
  gemm<T>(false, false, n, r, out, T(1), dy, out, ad.b, r, T(0), g.data(), r);
  gemm<T>(true, false, r, in, n, scale, g.data(), r, x, in, T(1), ad.ga, in);
  gemm<T>(false, false, n, in, r, scale, g.data(), r, ad.a, in, T(1), dx, in);
}

// Expert e's two adapters of `lora` (none when null).
template <typename T>
std::pair<ExpertAdapter<T>, ExpertAdapter<T>> expert_adapters(const ExpertLora<T>* lora, int e,
                                                              int H, int Im) {
  std::pair<ExpertAdapter<T>, ExpertAdapter<T>> p;
  if (!lora) return p;
  const std::size_t r = lora->r, gu_a = r * H * e, gu_b = 2 * std::size_t(Im) * r * e,
                    dn_a = r * Im * e, dn_b = std::size_t(H) * r * e;
  if (lora->gu_a)
    p.first = {lora->gu_a + gu_a, lora->gu_b + gu_b, lora->g_gu_a ? lora->g_gu_a + gu_a : nullptr,
               lora->g_gu_b ? lora->g_gu_b + gu_b : nullptr};
  if (lora->dn_a)
    p.second = {lora->dn_a + dn_a, lora->dn_b + dn_b, lora->g_dn_a ? lora->g_dn_a + dn_a : nullptr,
                lora->g_dn_b ? lora->g_dn_b + dn_b : nullptr};
  return p;
}

// One expert over its n gathered rows: gu [n, 2 Im] = xe gate_up^T (+ its adapter),
// h [n, Im] = silu(gate) * up, ye [n, H] = h down^T (+ its adapter); xa_gu [n, r], xa_dn [n, r]
// the adapters' x A^T.
template <typename T>
struct ExpertRun {
  std::vector<T> xe, gu, h, ye, xa_gu, xa_dn;
  ExpertRun(const T* x, const std::vector<int>& pairs, const T* gate_up, const T* down, int H,
            int Im, int k, const ExpertLora<T>* lora = nullptr, int e = 0)
      : xe(pairs.size() * H), gu(pairs.size() * 2 * Im), h(pairs.size() * Im),
        ye(pairs.size() * H) {
    const int n = static_cast<int>(pairs.size());
    const auto [ad_gu, ad_dn] = expert_adapters(lora, e, H, Im);
    for (int i = 0; i < n; ++i)
      std::copy_n(x + static_cast<std::size_t>(pairs[i] / k) * H, H, xe.begin() + std::size_t(i) * H);
    linear_forward(gu.data(), xe.data(), gate_up, n, H, 2 * Im);
    if (ad_gu.a) adapter_forward(gu.data(), xa_gu, xe.data(), ad_gu, n, H, 2 * Im, lora->r, lora->scale);
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < Im; ++c) {
        const T g = gu[std::size_t(i) * 2 * Im + c], u = gu[std::size_t(i) * 2 * Im + Im + c];
        h[std::size_t(i) * Im + c] = g * sigmoid(g) * u;
      }
    linear_forward(ye.data(), h.data(), down, n, Im, H);
    if (ad_dn.a) adapter_forward(ye.data(), xa_dn, h.data(), ad_dn, n, Im, H, lora->r, lora->scale);
  }
};

}  // namespace

template <typename T>
void moe_experts_forward(T* y, const T* x, const int* idx, const T* w, const T* gate_up,
                         const T* down, int N, int H, int Im, int E, int k,
                         const std::uint8_t* keep, const ExpertLora<T>* lora) {
  std::fill(y, y + static_cast<std::size_t>(N) * H, T(0));
  const auto pairs = pairs_by_expert(idx, N, E, k, keep);
  for (int e = 0; e < E; ++e) {
    const std::vector<int>& pe = pairs[static_cast<std::size_t>(e)];
    if (pe.empty()) continue;
    const ExpertRun<T> r(x, pe, gate_up + std::size_t(e) * 2 * Im * H,
                         down + std::size_t(e) * H * Im, H, Im, k, lora, e);
    for (std::size_t i = 0; i < pe.size(); ++i) {
      T* yt = y + static_cast<std::size_t>(pe[i] / k) * H;
      for (int c = 0; c < H; ++c) yt[c] += w[pe[i]] * r.ye[i * H + c];
    }
  }
}

template <typename T>
void moe_experts_backward(T* dx, T* dw, T* dgate_up, T* ddown, const T* dy, const T* x,
                          const int* idx, const T* w, const T* gate_up, const T* down, int N,
                          int H, int Im, int E, int k, const std::uint8_t* keep,
                          const ExpertLora<T>* lora) {
  QT_CHECK((dgate_up == nullptr) == (ddown == nullptr),
           "the experts' gradients: both or neither (frozen)");
  const bool frozen = dgate_up == nullptr;
  QT_CHECK(!lora || ((!lora->gu_a || (lora->g_gu_a && lora->g_gu_b)) &&
                     (!lora->dn_a || (lora->g_dn_a && lora->g_dn_b))),
           "the experts' adapters' backward without their gradients");
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
    const ExpertRun<T> r(x, pe, gu_w, down_w, H, Im, k, lora, e);
    const auto [ad_gu, ad_dn] = expert_adapters(lora, e, H, Im);
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
    linear_backward(dh.data(), ddown_w, dye.data(), r.h.data(), down_w, n, Im, H);
    if (ad_dn.a)
      adapter_backward(dh.data(), dye.data(), r.h.data(), r.xa_dn, ad_dn, n, Im, H, lora->r,
                       lora->scale);
    // SwiGLU: d gate = dh u s (1 + g (1 - s)), d up = dh g s.
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < Im; ++c) {
        const std::size_t a = std::size_t(i) * 2 * Im + c, b = a + Im;
        const T g = r.gu[a], u = r.gu[b], s = sigmoid(g), d = dh[std::size_t(i) * Im + c];
        dgu[a] = d * u * s * (T(1) + g * (T(1) - s));
        dgu[b] = d * g * s;
      }
    linear_backward(dxe.data(), dgu_w, dgu.data(), r.xe.data(), gu_w, n, H, 2 * Im);
    if (ad_gu.a)
      adapter_backward(dxe.data(), dgu.data(), r.xe.data(), r.xa_gu, ad_gu, n, H, 2 * Im, lora->r,
                       lora->scale);
    for (int i = 0; i < n; ++i) {
      T* dxt = dx + static_cast<std::size_t>(pe[i] / k) * H;
      for (int c = 0; c < H; ++c) dxt[c] += dxe[std::size_t(i) * H + c];
    }
  }
}

template void moe_experts_forward<float>(float*, const float*, const int*, const float*,
                                         const float*, const float*, int, int, int, int, int,
                                         const std::uint8_t*, const ExpertLora<float>*);
template void moe_experts_forward<double>(double*, const double*, const int*, const double*,
                                          const double*, const double*, int, int, int, int, int,
                                          const std::uint8_t*, const ExpertLora<double>*);
template void moe_experts_backward<float>(float*, float*, float*, float*, const float*,
                                          const float*, const int*, const float*, const float*,
                                          const float*, int, int, int, int, int,
                                          const std::uint8_t*, const ExpertLora<float>*);
template void moe_experts_backward<double>(double*, double*, double*, double*, const double*,
                                           const double*, const int*, const double*,
                                           const double*, const double*, int, int, int, int, int,
                                           const std::uint8_t*, const ExpertLora<double>*);

}  // namespace qt::cpu
