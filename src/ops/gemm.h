// Dense matrix multiply on the CPU through BLAS (row-major), float and double.
#pragma once

namespace qt::cpu {

// C[M,N] = alpha * op(A) * op(B) + beta * C, row-major; op(X) = X or X^T.
// A is [M,K] (or [K,M] if trans_a), B is [K,N] (or [N,K] if trans_b).
template <typename T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda,
          const T* B, int ldb, T beta, T* C, int ldc);

}  // namespace qt::cpu
