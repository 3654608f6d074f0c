#include "kernels/cpu/matmul.h"

#include <omp.h>

#include <vector>

#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"

namespace origami {

Precision parse_precision(const std::string& s) {
  if (s == "fp32") return Precision::fp32;
  if (s == "bf16") return Precision::bf16;
  throw Error(cat("precision '", s, "' is not one of fp32, bf16"));
}

const char* precision_name(Precision p) { return p == Precision::bf16 ? "bf16" : "fp32"; }

int64_t matmul_scratch_bytes(int64_t a_elements, int64_t b_elements) {
  return int64_t(sizeof(bf16)) * (a_elements + b_elements);
}

namespace {

// An operand's bf16 values: its copy, or its rows × cols values (row stride m.ld) rounded compactly
// into this thread's scratch `slot` (0: A, 1: B), kept for the next calls. Returns the row stride.
const bf16* low_values(const Mat<float>& m, int64_t rows, int64_t cols, int slot, int64_t* ld) {
  if (m.low) {
    *ld = m.ld;
    return m.low;
  }
  thread_local std::vector<bf16> scratch[2];
  std::vector<bf16>& s = scratch[slot];
  if (s.size() < size_t(rows * cols)) s.resize(size_t(rows * cols));
  if (m.ld == cols) {
    round_to_bf16(s.data(), m.v, rows * cols);
  } else {
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t(1) << 16) && !omp_in_parallel())
    for (int64_t r = 0; r < rows; ++r) to_bf16(s.data() + r * cols, m.v + r * m.ld, cols);
  }
  *ld = cols;
  return s.data();
}

}  // namespace

template <>
void matmul<float>(Precision p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Mat<float> A,
                   Mat<float> B, float beta, float* C, int64_t ldc, Sizes sizes) {
  if (p == Precision::fp32) return gemm<float>(ta, tb, M, N, K, alpha, A.v, A.ld, B.v, B.ld, beta, C, ldc);
  if (M == 0 || N == 0) return;
  int64_t lda = 0, ldb = 0;
  // Stored shapes: A is [M, K] (or [K, M] transposed), B is [K, N] (or [N, K]).
  const bf16* a = low_values(A, ta ? K : M, ta ? M : K, 0, &lda);
  const bf16* b = low_values(B, tb ? N : K, tb ? K : N, 1, &ldb);
  if (sizes == Sizes::varying) gemm_bf16_varying(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, C, ldc);
  else gemm_bf16(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, C, ldc);
}

template <>
Mat<float> operand(Precision p, const float* v, int64_t rows, int64_t cols, std::vector<bf16>& buffer) {
  if (p == Precision::fp32) return {v, cols};
  if (buffer.size() < size_t(rows * cols)) buffer.resize(size_t(rows * cols));
  round_to_bf16(buffer.data(), v, rows * cols);
  return {v, cols, buffer.data()};
}

template <>
Mat<double> operand(Precision p, const double* v, int64_t, int64_t cols, std::vector<bf16>&) {
  ORIGAMI_ASSERT(p == Precision::fp32);
  return {v, cols};
}

template <>
void matmul<double>(Precision p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, Mat<double> A,
                    Mat<double> B, double beta, double* C, int64_t ldc, Sizes) {
  ORIGAMI_ASSERT(p == Precision::fp32);  // fp64 is the finite-difference tests' precision
  gemm<double>(ta, tb, M, N, K, alpha, A.v, A.ld, B.v, B.ld, beta, C, ldc);
}

}  // namespace origami
