// Row-major GEMM on the CPU BLAS: C = alpha·op(A)·op(B) + beta·C, op(X) = X or Xᵀ.
// op(A) is [M, K], op(B) is [K, N], C is [M, N]; lda/ldb/ldc are row strides, so a block of
// rows or columns inside a wider matrix (one head inside a packed qkv row) is passed directly.
// Called outside an OpenMP parallel region, the BLAS uses all threads; inside one, a single thread.
#pragma once
#include <cstdint>

namespace origami {

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// Sets the thread count of both OpenMP and the BLAS (one pool: the OpenMP build of OpenBLAS).
void set_num_threads(int n);
int num_threads();

}  // namespace origami
