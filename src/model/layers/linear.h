// Linear layer: y[N, out] = x[N, in]·W (+ b).
// Legend: N rows (tokens), in/out features. W in Hugging Face layout: Linear is [out, in]
// (y = x·Wᵀ), GPT-2's Conv1D is [in, out] (y = x·W).
// Backward: dx is overwritten (or accumulated with accumulate_dx), dW and db accumulate (+=).
// The GEMMs run in W's precision (kernels/cpu/matmul.h): in bf16, x, dy and W rounded (W through its
// bf16 copy), accumulation and dW in fp32; the bias and db use fp32 values.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/cpu/matmul.h"

namespace origami {

enum class WeightLayout { out_in, in_out };

// x: its values, or (bf16) its copy as kept for backward (Operand).
template <typename T>
void linear_forward(T* y, Id<Operand<T>> x, Id<Weights<T>> w, const T* b, int64_t N, int64_t in, int64_t out,
                    WeightLayout layout);

// dy is read, not written: in bf16 its rounding for the two GEMMs is a copy.
template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, Id<Operand<T>> x, Id<Weights<T>> w, int64_t N, int64_t in,
                     int64_t out, WeightLayout layout, bool accumulate_dx = false);

// The same for a dy nothing reads after the call (a work buffer): in bf16 it is rounded in place for
// the two GEMMs (operand_in_place), after db has read its fp32 values.
template <typename T>
void linear_backward_consuming(T* dx, T* dw, T* db, T* dy, Id<Operand<T>> x, Id<Weights<T>> w, int64_t N, int64_t in,
                               int64_t out, WeightLayout layout);

// linear_backward_consuming's three steps, for a caller that produces dy and can do the first two
// as it writes it (mlp_activation_backward's GELU):
// db += dy's column sums, each column's fp32 adds in row order (the same bits under any thread count);
template <typename T>
void bias_backward(T* db, const T* dy, int64_t N, int64_t out);
// dy rounded for the GEMMs (operand_in_place) with its bf16 copy in this buffer: this thread's, one
// for every linear backward (the memory check counts one);
std::vector<bf16>& linear_dy_copy();
// and the two GEMMs, on dy as they read it.
template <typename T>
void linear_backward_gemms(T* dx, T* dw, Mat<T> dy, Id<Operand<T>> x, Id<Weights<T>> w, int64_t N, int64_t in,
                           int64_t out, WeightLayout layout);

}  // namespace origami
