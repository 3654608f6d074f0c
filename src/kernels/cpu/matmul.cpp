#include "kernels/cpu/matmul.h"

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

template <>
void matmul<float>(Precision p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Mat<float> A,
                   Mat<float> B, float beta, float* C, int64_t ldc, Sizes sizes) {
  if (p == Precision::fp32) return gemm<float>(ta, tb, M, N, K, alpha, A.v, A.ld, B.v, B.ld, beta, C, ldc);
  // An operand without its bf16 copy is rounded by gemm_bf16, as its path reads it.
  const Bf16Operand a(A.v, A.low, A.ld, A.exact), b(B.v, B.low, B.ld, B.exact);
  if (sizes == Sizes::varying) gemm_bf16_varying(ta, tb, M, N, K, alpha, a, b, beta, C, ldc);
  else gemm_bf16(ta, tb, M, N, K, alpha, a, b, beta, C, ldc);
}

namespace {

template <typename T>
void bias_rows_then_matmul(Precision p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, Mat<T> A, Mat<T> B,
                           const T* bias, T* C, int64_t ldc) {
  fill_rows(M, N, bias, C, ldc);
  matmul<T>(p, ta, tb, M, N, K, T(1), A, B, T(1), C, ldc);
}

}  // namespace

template <>
void matmul_bias<float>(Precision p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, Mat<float> A, Mat<float> B,
                        const float* bias, float* C, int64_t ldc) {
  if (p == Precision::fp32) return bias_rows_then_matmul<float>(p, ta, tb, M, N, K, A, B, bias, C, ldc);
  gemm_bf16(ta, tb, M, N, K, 1.f, {A.v, A.low, A.ld, A.exact}, {B.v, B.low, B.ld, B.exact}, 0.f, C, ldc, bias);
}

template <>
Mat<float> operand(Precision p, const float* v, int64_t rows, int64_t cols, std::vector<bf16>& buffer) {
  if (p == Precision::fp32 || bf16_gemm_reads_fp32()) return {v, cols};  // each GEMM rounds it
  if (buffer.size() < size_t(rows * cols)) buffer.resize(size_t(rows * cols));
  round_to_bf16(buffer.data(), v, rows * cols);
  return {v, cols, buffer.data()};
}

template <>
Mat<double> operand(Precision p, const double* v, int64_t, int64_t cols, std::vector<bf16>&) {
  ORIGAMI_ASSERT(p == Precision::fp32);
  return {v, cols};
}

bf16* in_place_copy(std::vector<bf16>& buffer, int64_t n) {
  if (bf16_gemm_reads_fp32()) return nullptr;
  if (buffer.size() < size_t(n)) buffer.resize(size_t(n));
  return buffer.data();
}

template <>
Mat<float> operand_in_place(Precision p, float* v, int64_t rows, int64_t cols, std::vector<bf16>& buffer) {
  if (p == Precision::fp32) return {v, cols};
  bf16* copy = in_place_copy(buffer, rows * cols);
  if (copy) round_to_bf16(copy, v, rows * cols);
  else round_in_place(v, nullptr, rows * cols);
  return rounded_once<float>(v, copy, cols);
}

template <>
Mat<double> operand_in_place(Precision p, double* v, int64_t, int64_t cols, std::vector<bf16>&) {
  ORIGAMI_ASSERT(p == Precision::fp32);
  return {v, cols};
}

template <>
void matmul<double>(Precision p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, Mat<double> A,
                    Mat<double> B, double beta, double* C, int64_t ldc, Sizes) {
  ORIGAMI_ASSERT(p == Precision::fp32);  // fp64 is the finite-difference tests' precision
  gemm<double>(ta, tb, M, N, K, alpha, A.v, A.ld, B.v, B.ld, beta, C, ldc);
}

template <>
void matmul_bias<double>(Precision p, bool ta, bool tb, int64_t M, int64_t N, int64_t K, Mat<double> A,
                         Mat<double> B, const double* bias, double* C, int64_t ldc) {
  bias_rows_then_matmul<double>(p, ta, tb, M, N, K, A, B, bias, C, ldc);
}

}  // namespace origami
