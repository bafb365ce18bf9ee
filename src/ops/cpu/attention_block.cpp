// Block attention on the CPU (ops/attention_block.h), the reference for context parallelism: per
// (batch row, query head) the scores of the block [Tq, Tk] by one GEMM, masked by the rows'
// global indices, exponentials and sums in double, as ops/cpu/attention.cpp.
#include "ops/attention_block.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "ops/cpu/attention_head.h"
#include "ops/gemm.h"
#include "qtrain/error.h"

namespace qt::cpu {
namespace {

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

// visible[i * Tk + j]: query row i of batch row b sees key row j. [Tq, Tk]
std::vector<char> visibility(const AttentionBlockRows& rows, int b, int Tq, int Tk) {
  QT_CHECK(rows.q_index != nullptr && rows.k_index != nullptr, "attention block without indices");
  std::vector<char> vis(static_cast<std::size_t>(Tq) * Tk);
  for (int i = 0; i < Tq; ++i) {
    const std::int32_t qi = rows.q_index[i];
    const std::int32_t first =
        rows.q_first ? rows.q_first[static_cast<std::size_t>(b) * Tq + i] : 0;
    QT_CHECK(first >= 0 && first <= qi, "attention block: query {} sees from {}", qi, first);
    for (int j = 0; j < Tk; ++j) {
      const std::int32_t kj = rows.k_index[j];
      vis[static_cast<std::size_t>(i) * Tk + j] = first <= kj && kj <= qi;
    }
  }
  return vis;
}

// S [Tq, Tk] = exp(S - lse[i]) where visible (lse finite), else 0.
template <typename T>
void probs(T* S, const T* lse, const std::vector<char>& vis, int Tq, int Tk) {
  for (int i = 0; i < Tq; ++i) {
    T* row = S + static_cast<std::size_t>(i) * Tk;
    const double l = lse[i];
    for (int j = 0; j < Tk; ++j) {
      const bool on = vis[static_cast<std::size_t>(i) * Tk + j] && std::isfinite(l);
      row[j] = on ? static_cast<T>(std::exp(double(row[j]) - l)) : T(0);
    }
  }
}

}  // namespace

template <typename T>
void attention_block_forward(T* out, T* lse, const T* q, const T* k, const T* v, int B, int Tq,
                             int Tk, int nh, int nkv, int hd, const AttentionBlockRows& rows) {
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  std::vector<T> S(static_cast<std::size_t>(Tq) * Tk);  // [Tq, Tk] scores, then probabilities
  for (int b = 0; b < B; ++b) {
    const std::vector<char> vis = visibility(rows, b, Tq, Tk);
    for (int h = 0; h < nh; ++h) {
      const HeadView bv = head_view(b, h, Tq, Tk, nh, nkv, hd);
      T* lse_bh = lse + (static_cast<std::size_t>(b) * nh + h) * Tq;  // [Tq]
      gemm<T>(false, true, Tq, Tk, hd, scale, q + bv.q_off, bv.ldq, k + bv.kv_off, bv.ldkv, T(0),
              S.data(), Tk);
      for (int i = 0; i < Tq; ++i) {
        const T* row = S.data() + static_cast<std::size_t>(i) * Tk;
        const char* on = vis.data() + static_cast<std::size_t>(i) * Tk;
        double m = kMinusInf;
        for (int j = 0; j < Tk; ++j)
          if (on[j]) m = std::max(m, double(row[j]));
        double sum = 0.0;
        for (int j = 0; j < Tk; ++j)
          if (on[j]) sum += std::exp(double(row[j]) - m);
        lse_bh[i] = static_cast<T>(sum > 0 ? m + std::log(sum) : kMinusInf);
      }
      probs(S.data(), lse_bh, vis, Tq, Tk);
      // O [Tq, hd] = P [Tq, Tk] V [Tk, hd]: zero rows where nothing is visible
      gemm<T>(false, false, Tq, hd, Tk, T(1), S.data(), Tk, v + bv.kv_off, bv.ldkv, T(0),
              out + bv.q_off, bv.ldq);
    }
  }
}

template <typename T>
void attention_merge(T* out, T* lse, const T* out_b, const T* lse_b, int B, int Tq, int nh,
                     int hd) {
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < nh; ++h)
      for (int i = 0; i < Tq; ++i) {
        T& l = lse[(static_cast<std::size_t>(b) * nh + h) * Tq + i];
        const double la = l, lb = lse_b[(static_cast<std::size_t>(b) * nh + h) * Tq + i];
        if (lb == kMinusInf) continue;  // the block adds nothing to this row
        const double m = std::max(la, lb);
        const double merged = m + std::log(std::exp(la - m) + std::exp(lb - m));
        const double wa = la == kMinusInf ? 0.0 : std::exp(la - merged);
        const double wb = std::exp(lb - merged);
        const std::size_t at = ((static_cast<std::size_t>(b) * Tq + i) * nh + h) * hd;
        for (int d = 0; d < hd; ++d)
          out[at + d] = static_cast<T>(wa * double(out[at + d]) + wb * double(out_b[at + d]));
        l = static_cast<T>(merged);
      }
}

template <typename T>
void attention_block_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                              const T* v, const T* out, const T* lse, int B, int Tq, int Tk, int nh,
                              int nkv, int hd, const AttentionBlockRows& rows) {
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  std::vector<T> P(static_cast<std::size_t>(Tq) * Tk);   // [Tq, Tk]
  std::vector<T> dP(static_cast<std::size_t>(Tq) * Tk);  // [Tq, Tk], then dS
  for (int b = 0; b < B; ++b) {
    const std::vector<char> vis = visibility(rows, b, Tq, Tk);
    for (int h = 0; h < nh; ++h) {
      const HeadView bv = head_view(b, h, Tq, Tk, nh, nkv, hd);
      const T* lse_bh = lse + (static_cast<std::size_t>(b) * nh + h) * Tq;
      const T* Q = q + bv.q_off;
      const T* K = k + bv.kv_off;
      const T* V = v + bv.kv_off;
      const T* O = out + bv.q_off;
      const T* dO = dout + bv.q_off;
      gemm<T>(false, true, Tq, Tk, hd, scale, Q, bv.ldq, K, bv.ldkv, T(0), P.data(), Tk);
      probs(P.data(), lse_bh, vis, Tq, Tk);
      // dV [Tk, hd] += P^T dO
      gemm<T>(true, false, Tk, hd, Tq, T(1), P.data(), Tk, dO, bv.ldq, T(1), dv + bv.kv_off,
              bv.ldkv);
      // dP [Tq, Tk] = dO V^T, then dS = P (dP - D), D = rowsum(dO * O) of the merged output
      gemm<T>(false, true, Tq, Tk, hd, T(1), dO, bv.ldq, V, bv.ldkv, T(0), dP.data(), Tk);
      for (int i = 0; i < Tq; ++i) {
        const T* o_i = O + static_cast<std::size_t>(i) * bv.ldq;
        const T* do_i = dO + static_cast<std::size_t>(i) * bv.ldq;
        double D = 0.0;
        for (int d = 0; d < hd; ++d) D += double(do_i[d]) * double(o_i[d]);
        const T* p_i = P.data() + static_cast<std::size_t>(i) * Tk;
        T* ds_i = dP.data() + static_cast<std::size_t>(i) * Tk;
        for (int j = 0; j < Tk; ++j) ds_i[j] = static_cast<T>(p_i[j] * (double(ds_i[j]) - D));
      }
      // dQ [Tq, hd] += scale dS K;  dK [Tk, hd] += scale dS^T Q
      gemm<T>(false, false, Tq, hd, Tk, scale, dP.data(), Tk, K, bv.ldkv, T(1), dq + bv.q_off,
              bv.ldq);
      gemm<T>(true, false, Tk, hd, Tq, scale, dP.data(), Tk, Q, bv.ldq, T(1), dk + bv.kv_off,
              bv.ldkv);
    }
  }
}

#define QT_INSTANTIATE(T)                                                                       \
  template void attention_block_forward<T>(T*, T*, const T*, const T*, const T*, int, int, int, \
                                           int, int, int, const AttentionBlockRows&);           \
  template void attention_merge<T>(T*, T*, const T*, const T*, int, int, int, int);             \
  template void attention_block_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, \
                                            const T*, const T*, int, int, int, int, int, int,   \
                                            const AttentionBlockRows&);
QT_INSTANTIATE(float)
QT_INSTANTIATE(double)
#undef QT_INSTANTIATE

}  // namespace qt::cpu
