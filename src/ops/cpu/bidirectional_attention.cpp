// Non-causal attention within segments, plain loops accumulating in double (the reference).
#include "ops/bidirectional_attention.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace qt::cpu {
namespace {

// Row i, head h of a [N, heads, hd] tensor.
template <typename T>
T* row(T* x, int i, int h, int heads, int hd) {
  return x + (static_cast<std::size_t>(i) * heads + h) * hd;
}

template <typename T>
double dot(const T* a, const T* b, int n) {
  double s = 0;
  for (int d = 0; d < n; ++d) s += double(a[d]) * b[d];
  return s;
}

}  // namespace

template <typename T>
void bidirectional_attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                                     const int* seg, int num_segments, int heads, int hd) {
  const int N = seg[num_segments];
  const double scale = 1.0 / std::sqrt(double(hd));
  std::vector<double> s, acc(hd);
  for (int g = 0; g < num_segments; ++g) {
    const int lo = seg[g], hi = seg[g + 1];
    s.resize(hi - lo);
    for (int h = 0; h < heads; ++h) {
      for (int i = lo; i < hi; ++i) {
        const T* qi = row(q, i, h, heads, hd);
        double mx = -INFINITY;
        for (int j = lo; j < hi; ++j) {
          s[j - lo] = dot(qi, row(k, j, h, heads, hd), hd) * scale;
          mx = std::max(mx, s[j - lo]);
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = lo; j < hi; ++j) {
          const T* vj = row(v, j, h, heads, hd);
          for (int d = 0; d < hd; ++d) acc[d] += s[j - lo] / sum * vj[d];
        }
        T* oi = row(out, i, h, heads, hd);
        for (int d = 0; d < hd; ++d) oi[d] = static_cast<T>(acc[d]);
        lse[static_cast<std::size_t>(h) * N + i] = static_cast<T>(mx + std::log(sum));
      }
    }
  }
}

// P = exp(S - lse); dV = P^T dO; dP = dO V^T; dS = P (dP - rowsum(dO * O)); dQ = dS K scale,
// dK = dS^T Q scale.
template <typename T>
void bidirectional_attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                                      const T* v, const T* out, const T* lse, const int* seg,
                                      int num_segments, int heads, int hd) {
  const int N = seg[num_segments];
  const std::size_t total = static_cast<std::size_t>(N) * heads * hd;
  std::vector<double> gq(total, 0.0), gk(total, 0.0), gv(total, 0.0);
  const double scale = 1.0 / std::sqrt(double(hd));
  for (int g = 0; g < num_segments; ++g) {
    const int lo = seg[g], hi = seg[g + 1];
    for (int h = 0; h < heads; ++h) {
      for (int i = lo; i < hi; ++i) {
        const T* qi = row(q, i, h, heads, hd);
        const T* doi = row(dout, i, h, heads, hd);
        const double Di = dot(doi, row(out, i, h, heads, hd), hd);
        const double li = lse[static_cast<std::size_t>(h) * N + i];
        double* gqi = row(gq.data(), i, h, heads, hd);
        for (int j = lo; j < hi; ++j) {
          const T* kj = row(k, j, h, heads, hd);
          const double p = std::exp(dot(qi, kj, hd) * scale - li);
          const double ds = p * (dot(doi, row(v, j, h, heads, hd), hd) - Di);
          double* gkj = row(gk.data(), j, h, heads, hd);
          double* gvj = row(gv.data(), j, h, heads, hd);
          for (int d = 0; d < hd; ++d) {
            gvj[d] += p * doi[d];
            gqi[d] += ds * kj[d] * scale;
            gkj[d] += ds * qi[d] * scale;
          }
        }
      }
    }
  }
  for (std::size_t e = 0; e < total; ++e) {
    dq[e] = static_cast<T>(gq[e]);
    dk[e] = static_cast<T>(gk[e]);
    dv[e] = static_cast<T>(gv[e]);
  }
}

template void bidirectional_attention_forward<float>(float*, float*, const float*, const float*,
                                                     const float*, const int*, int, int, int);
template void bidirectional_attention_forward<double>(double*, double*, const double*,
                                                      const double*, const double*, const int*,
                                                      int, int, int);
template void bidirectional_attention_backward<float>(float*, float*, float*, const float*,
                                                      const float*, const float*, const float*,
                                                      const float*, const float*, const int*, int,
                                                      int, int);
template void bidirectional_attention_backward<double>(double*, double*, double*, const double*,
                                                       const double*, const double*,
                                                       const double*, const double*,
                                                       const double*, const int*, int, int, int);

}  // namespace qt::cpu
