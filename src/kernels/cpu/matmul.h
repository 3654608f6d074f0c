// The kernel seam's GEMM: every layer GEMM (linear layers, the LM head, the MoE experts) multiplies
// through `matmul` in the run's precision, so model assembly chooses an element type and nothing else.
//
// Precision::fp32: gemm<T> (fp64 for double: the finite-difference tests).
// Precision::bf16 (mixed precision, float only): both operands rounded to bf16 — a weight through its
//   bf16 copy (refreshed after each optimizer update, ParamSet's job), an activation or a gradient
//   rounded by gemm_bf16 the way its path reads it, or once beforehand where only GEMMs read it
//   (operand_in_place: into its copy alone, or in place, an `exact` operand) — products exact in fp32,
//   accumulation in fp32, C in fp32. The rounding points are the operands of the GEMM, nothing else:
//   a bias is added in fp32 (matmul_bias), and a backward rounds dy once for both of its GEMMs (the PyTorch
//   oracle's bf16 mode rounds at the same points, tests/reference/origami_ref.py). Rounding is
//   idempotent, so where it happens changes no value; in place it saves the portable path a copy.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/bf16.h"

namespace origami {

enum class Precision { fp32, bf16 };
Precision parse_precision(const std::string& s);  // "fp32" | "bf16"; else an Error naming the value
const char* precision_name(Precision p);

// A GEMM operand as gemm.h passes it (values, row stride), and where it has one its bf16 copy in the
// same layout (a weight's; null: the values are rounded at the call). `exact`: the values are at bf16
// precision already (round_in_place), so a bf16 GEMM may read them as they are.
template <typename T>
struct Mat {
  const T* v;
  int64_t ld;
  const bf16* low = nullptr;
  bool exact = false;
};

// Values as a layer passes them to its GEMMs, with their bf16 copy where one is kept (a weight's, or
// an activation kept for backward as the GEMM reads it; then the values may be null, as a bf16
// matmul reads only the copy). A bare pointer is values without a copy.
template <typename T>
struct Operand {
  const T* v = nullptr;
  const bf16* low = nullptr;
  bool exact = false;  // as Mat's
  Operand() = default;
  Operand(const T* values) : v(values) {}  // NOLINT: implicit, a bare pointer is values alone
  Operand(const T* values, const bf16* copy) : v(values), low(copy) {}
  Mat<T> mat(int64_t ld) const { return {v, ld, low, exact}; }
};

// Values that a bf16 run has rounded to bf16 precision where `rounded` (round_in_place, or widened
// from a bf16 copy), else plain values.
template <typename T>
Operand<T> rounded_values(const T* v, bool rounded) {
  Operand<T> o(v);
  o.exact = rounded;
  return o;
}

// A weight (or a block of them) as a layer reads it: an Operand with the precision its GEMMs run in
// (in bf16, with its copy). A bare pointer is an fp32 (fp64) weight.
template <typename T>
struct Weights : Operand<T> {
  Precision p = Precision::fp32;
  Weights() = default;
  Weights(const T* values) : Operand<T>(values) {}  // NOLINT: implicit, a bare pointer is an fp32 weight
  Weights(const T* values, const bf16* copy, Precision precision) : Operand<T>(values, copy), p(precision) {}
  Weights at(int64_t offset) const {  // (a side that is absent stays null: FSSDP's bf16 staging has no values)
    return {this->v ? this->v + offset : nullptr, this->low ? this->low + offset : nullptr, p};
  }
};

// A parameter type that template deduction skips, so a bare pointer converts to Weights<T>.
template <typename X>
using Id = std::type_identity_t<X>;

// How the sizes of a call arise: `fixed` by the batch and the model (one gemm_bf16 path choice and
// oneDNN primitive per shape, kept); `varying` with the data (an MoE expert's rows, as M or K):
// gemm_bf16_varying, whose primitives leave M and K to the call.
enum class Sizes { fixed, varying };

// C = alpha·op(A)·op(B) + beta·C (gemm.h's meaning of the arguments) in precision p.
template <typename T>
void matmul(Precision p, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, Mat<T> A, Mat<T> B,
            T beta, T* C, int64_t ldc, Sizes sizes = Sizes::fixed);

// C = op(A)·op(B) + the bias row [N] on every row, in precision p: in bf16 gemm_bf16's bias (oneDNN
// adds it in its kernel); elsewhere C is set to the bias rows and the product added to them. The bias
// is added in fp32 either way (not a rounding point: matmul's rule).
template <typename T>
void matmul_bias(Precision p, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Mat<T> A, Mat<T> B,
                 const T* bias, T* C, int64_t ldc);

// An operand [rows, cols] (compact) used by several GEMMs of one backward and read elsewhere too (its
// values stay as they are): in bf16, rounded once into `buffer` (resized as needed) and carried as
// its copy — except where bf16 GEMMs read fp32 (bf16_gemm_reads_fp32), each of which rounds it while
// copying its blocks: the same values, without a pass through bf16 and back; in fp32 (or for double),
// the values alone.
template <typename T>
Mat<T> operand(Precision p, const T* v, int64_t rows, int64_t cols, std::vector<bf16>& buffer);

// An operand [rows, cols] (compact) that only GEMMs read from here on (a work buffer, or rows about to
// be overwritten): in bf16, its bf16 copy in `buffer` alone (the values, which nothing reads again, are
// not written back rounded: a whole pass saved) where bf16 GEMMs read bf16; else (bf16_gemm_reads_fp32:
// where they are portable) the values rounded in place to bf16 precision, which those GEMMs read where
// they are; in fp32 (or for double), the values alone.
template <typename T>
Mat<T> operand_in_place(Precision p, T* v, int64_t rows, int64_t cols, std::vector<bf16>& buffer);

// A compact operand [., ld] rounded once for its GEMMs, as operand_in_place leaves it: its bf16 copy
// alone where there is one (the values not written back), else the values rounded in place (exact).
template <typename T>
Mat<T> rounded_once(const T* v, const bf16* copy, int64_t ld) {
  return copy ? Mat<T>{nullptr, ld, copy} : Mat<T>{v, ld, nullptr, true};
}

// operand_in_place's bf16 copy of n elements: `buffer` sized for it, or null where bf16 GEMMs read
// fp32 values (for a producer that rounds its output itself as it writes it: into the copy alone where
// there is one, else in place).
bf16* in_place_copy(std::vector<bf16>& buffer, int64_t n);

// Bytes of the per-thread rounding scratch a bf16 matmul with operands of a and b elements holds
// (the memory check adds the largest such call of a step).
int64_t matmul_scratch_bytes(int64_t a_elements, int64_t b_elements);

}  // namespace origami
