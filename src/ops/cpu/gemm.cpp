// Row-major GEMM through CBLAS (OpenBLAS).
#include "ops/gemm.h"

#include <cblas.h>

namespace qt::cpu {
namespace {

CBLAS_TRANSPOSE blas_op(bool trans) { return trans ? CblasTrans : CblasNoTrans; }

void blas_gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
               const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, blas_op(ta), blas_op(tb), M, N, K, alpha, A, lda, B, ldb, beta, C,
              ldc);
}

void blas_gemm(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda,
               const double* B, int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, blas_op(ta), blas_op(tb), M, N, K, alpha, A, lda, B, ldb, beta, C,
              ldc);
}

}  // namespace

template <typename T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda, const T* B,
          int ldb, T beta, T* C, int ldc) {
  if (M == 0 || N == 0) return;
  blas_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template void gemm<float>(bool, bool, int, int, int, float, const float*, int, const float*, int,
                          float, float*, int);
template void gemm<double>(bool, bool, int, int, int, double, const double*, int, const double*,
                           int, double, double*, int);

}  // namespace qt::cpu
