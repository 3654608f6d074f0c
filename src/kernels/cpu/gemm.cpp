#include "kernels/cpu/gemm.h"

#include <vector>

#include <cblas.h>
#include <dnnl.h>
#include <omp.h>

#include "core/error.h"

namespace origami {

static CBLAS_TRANSPOSE op(bool t) { return t ? CblasTrans : CblasNoTrans; }

template <>
void gemm<float>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (omp_in_parallel()) {  // a per-thread tile (attention): OpenBLAS's small-matrix kernels
    cblas_sgemm(CblasRowMajor, op(ta), op(tb), int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb),
                beta, C, int(ldc));
    return;
  }
  // dnnl_sgemm reports bad arguments (a leading dimension too small, ...) by its status alone and
  // leaves C untouched: a silent wrong result unless checked.
  const dnnl_status_t status = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  ORIGAMI_ASSERT(status == dnnl_success);
}

template <>
void gemm<double>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                  int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_dgemm(CblasRowMajor, op(ta), op(tb), int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb),
              beta, C, int(ldc));
}

void set_num_threads(int n) {
  omp_set_num_threads(n);  // our loops and oneDNN (OpenMP build)
  openblas_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

void warm_up_gemm() {
  constexpr int64_t n = 512, tile = 64;
  std::vector<float> a(size_t(n * n), 1.f), b(size_t(n * n), 1.f), c(size_t(n * n));
  gemm<float>(false, true, n, n, n, 1.f, a.data(), n, b.data(), n, 0.f, c.data(), n);
#pragma omp parallel
  {
    std::vector<float> t(size_t(3 * tile * tile), 1.f);
    gemm<float>(false, true, tile, tile, tile, 1.f, t.data(), tile, t.data() + tile * tile, tile, 0.f,
                t.data() + 2 * tile * tile, tile);
  }
}

}  // namespace origami
