// Causal GQA attention on the CPU. Per (batch, query head) the scores S = scale * Q K^T [T, T]
// are formed with one GEMM in a scratch buffer, softmaxed row by row (sums in double), and
// multiplied by V with a second GEMM. The backward recomputes P from the saved log-sum-exp.
// With pos (packed documents) row i keeps only the keys [i - pos[i], i]; the GEMMs still form the
// whole [T, T] block (this is the reference op, not a fast one), the masking is in the row loops.
#include "ops/attention.h"

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

// First key of each query row of batch row b: lo[i] = i - pos[b, i] (0 without pos). [T]
std::vector<int> doc_starts(const std::int32_t* pos, int b, int Tn) {
  std::vector<int> lo(static_cast<std::size_t>(Tn), 0);
  if (pos == nullptr) return lo;
  const std::int32_t* p = pos + static_cast<std::size_t>(b) * Tn;
  for (int i = 0; i < Tn; ++i) {
    QT_CHECK(p[i] >= 0 && p[i] <= i, "attention: pos[{}, {}] = {} outside [0, {}]", b, i, p[i], i);
    lo[i] = i - p[i];
  }
  return lo;
}

// P[i, j] = exp(S[i, j] - lse[i]) for lo[i] <= j <= i, 0 elsewhere. S is overwritten by P.
template <typename T>
void probs_from_lse(T* S, const T* lse, const std::vector<int>& lo, int Tn) {
  for (int i = 0; i < Tn; ++i) {
    T* row = S + static_cast<std::size_t>(i) * Tn;
    const double l = lse[i];
    std::fill(row, row + lo[i], T(0));
    for (int j = lo[i]; j <= i; ++j) row[j] = static_cast<T>(std::exp(double(row[j]) - l));
    std::fill(row + i + 1, row + Tn, T(0));
  }
}

}  // namespace

template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, int B, int Tn, int nh,
                       int nkv, int hd, const std::int32_t* pos) {
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  std::vector<T> S(static_cast<std::size_t>(Tn) * Tn);  // [T, T] scores, then probabilities
  for (int b = 0; b < B; ++b) {
    const std::vector<int> lo = doc_starts(pos, b, Tn);  // [T] first key of each query row
    for (int h = 0; h < nh; ++h) {
      const HeadView hv = head_view(b, h, Tn, Tn, nh, nkv, hd);
      T* lse_bh = lse + (static_cast<std::size_t>(b) * nh + h) * Tn;  // [T]
      // S = scale * Q K^T; only the band lo[i] <= j <= i is used.
      gemm<T>(false, true, Tn, Tn, hd, scale, q + hv.q_off, hv.ldq, k + hv.kv_off, hv.ldkv, T(0),
              S.data(), Tn);
      for (int i = 0; i < Tn; ++i) {
        const T* row = S.data() + static_cast<std::size_t>(i) * Tn;
        double m = -std::numeric_limits<double>::infinity();
        for (int j = lo[i]; j <= i; ++j) m = std::max(m, double(row[j]));
        double sum = 0.0;
        for (int j = lo[i]; j <= i; ++j) sum += std::exp(double(row[j]) - m);
        lse_bh[i] = static_cast<T>(m + std::log(sum));  // sum >= 1 (the diagonal is unmasked)
      }
      probs_from_lse(S.data(), lse_bh, lo, Tn);
      // O[T, hd] = P[T, T] V[T, hd]
      gemm<T>(false, false, Tn, hd, Tn, T(1), S.data(), Tn, v + hv.kv_off, hv.ldkv, T(0),
              out + hv.q_off, hv.ldq);
    }
  }
}

// Flash-attention backward: D_i = sum_d dO[i, d] O[i, d];  dS = P * (dP - D),  dP = dO V^T;
// dQ = scale dS K;  dK += scale dS^T Q;  dV += P^T dO  (sums over the query heads of a group).
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, int B, int Tn, int nh, int nkv, int hd,
                        const std::int32_t* pos) {
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hd)));
  const std::size_t kv_size = static_cast<std::size_t>(B) * Tn * nkv * hd;
  std::fill(dk, dk + kv_size, T(0));
  std::fill(dv, dv + kv_size, T(0));
  std::vector<T> P(static_cast<std::size_t>(Tn) * Tn);   // [T, T]
  std::vector<T> dP(static_cast<std::size_t>(Tn) * Tn);  // [T, T], then dS
  for (int b = 0; b < B; ++b) {
    const std::vector<int> lo = doc_starts(pos, b, Tn);  // [T] first key of each query row
    for (int h = 0; h < nh; ++h) {
      const HeadView hv = head_view(b, h, Tn, Tn, nh, nkv, hd);
      const T* lse_bh = lse + (static_cast<std::size_t>(b) * nh + h) * Tn;
      const T* Q = q + hv.q_off;
      const T* K = k + hv.kv_off;
      const T* V = v + hv.kv_off;
      const T* O = out + hv.q_off;
      const T* dO = dout + hv.q_off;
      gemm<T>(false, true, Tn, Tn, hd, scale, Q, hv.ldq, K, hv.ldkv, T(0), P.data(), Tn);
      probs_from_lse(P.data(), lse_bh, lo, Tn);
      // dV[T, hd] += P^T dO
      gemm<T>(true, false, Tn, hd, Tn, T(1), P.data(), Tn, dO, hv.ldq, T(1), dv + hv.kv_off,
              hv.ldkv);
      // dP[T, T] = dO V^T
      gemm<T>(false, true, Tn, Tn, hd, T(1), dO, hv.ldq, V, hv.ldkv, T(0), dP.data(), Tn);
      for (int i = 0; i < Tn; ++i) {
        const T* o_i = O + static_cast<std::size_t>(i) * hv.ldq;
        const T* do_i = dO + static_cast<std::size_t>(i) * hv.ldq;
        double D = 0.0;
        for (int d = 0; d < hd; ++d) D += double(do_i[d]) * double(o_i[d]);
        const T* p_i = P.data() + static_cast<std::size_t>(i) * Tn;
        T* ds_i = dP.data() + static_cast<std::size_t>(i) * Tn;
        std::fill(ds_i, ds_i + lo[i], T(0));
        for (int j = lo[i]; j <= i; ++j) ds_i[j] = static_cast<T>(p_i[j] * (ds_i[j] - D));
        std::fill(ds_i + i + 1, ds_i + Tn, T(0));
      }
      // dQ[T, hd] = scale dS K   (written: each query head is visited once)
      gemm<T>(false, false, Tn, hd, Tn, scale, dP.data(), Tn, K, hv.ldkv, T(0), dq + hv.q_off,
              hv.ldq);
      // dK[T, hd] += scale dS^T Q
      gemm<T>(true, false, Tn, hd, Tn, scale, dP.data(), Tn, Q, hv.ldq, T(1), dk + hv.kv_off,
              hv.ldkv);
    }
  }
}

template void attention_forward<float>(float*, float*, const float*, const float*, const float*,
                                       int, int, int, int, int, const std::int32_t*);
template void attention_forward<double>(double*, double*, const double*, const double*,
                                        const double*, int, int, int, int, int,
                                        const std::int32_t*);
template void attention_backward<float>(float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*, const float*, int,
                                        int, int, int, int, const std::int32_t*);
template void attention_backward<double>(double*, double*, double*, const double*, const double*,
                                         const double*, const double*, const double*, const double*,
                                         int, int, int, int, int, const std::int32_t*);

}  // namespace qt::cpu
