// Pointwise MLP activations.
// GELU (tanh approximation, HF "gelu_new"): y = ½x(1 + tanh(√(2/π)(x + 0.044715x³))).
// SwiGLU: gu_NF2 holds per row [gate(F) | up(F)]; h_NF = silu(gate)·up.
// Backward overwrites dx / dgu.
#pragma once
#include <cstdint>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/matmul.h"

namespace origami {

template <typename T>
void gelu_forward(T* y, const T* x, int64_t n);
template <typename T>
void gelu_backward(T* dx, const T* dy, const T* x, int64_t n);

template <typename T>
void swiglu_forward(T* h_NF, const T* gu_NF2, int64_t N, int64_t F);
template <typename T>
void swiglu_backward(T* dgu_NF2, const T* dh_NF, const T* gu_NF2, int64_t N, int64_t F);

// bf16 runs, which keep both in bf16: forward rounds the activation's input x (the up projection's
// output) into x_low, computes the activation in fp32 from the rounded values and rounds its output
// into y_low, a block at a time while the values are in cache; backward reads x_low. The results are
// those of the fp32 kernels on the rounded values.
void gelu_forward_bf16(bf16* y_low, bf16* x_low, const float* x, int64_t n);
void swiglu_forward_bf16(bf16* h_low_NF, bf16* gu_low_NF2, const float* gu_NF2, int64_t N, int64_t F);
void swiglu_backward_bf16(float* dgu_NF2, const float* dh_NF, const bf16* gu_low_NF2, int64_t N, int64_t F);
// GELU's backward [N, F] in one pass with what the up projection's backward does to its result
// first: dy·gelu'(x_low); db (where not null) += its column sums (bias_backward's sums: a thread owns
// a share of the columns, each column's adds in row order); then rounded to bf16 into the copy alone,
// or where copy is null into dx at bf16 precision (operand_in_place's result). The bits of those
// passes, in one.
void gelu_backward_rounded(float* dx_NF, bf16* copy_NF, float* db_F, const float* dy_NF, const bf16* x_low_NF,
                           int64_t N, int64_t F);

// SwiGLU in a bf16 run's MoE experts, whose outputs (forward's h, backward's dgu) only GEMMs read:
// swiglu_forward / swiglu_backward with each output row then rounded, a row at a time while it is in
// cache: into `copy` where it is not null, and to bf16 precision in place in h / dgu where they are
// not null (one of the two may be null: a copy alone is all oneDNN's GEMMs read).
void swiglu_forward_rounded(float* h_NF, bf16* copy_NF, const float* gu_NF2, int64_t N, int64_t F);
void swiglu_backward_rounded(float* dgu_NF2, bf16* copy_NF2, const float* dh_NF, const float* gu_NF2, int64_t N,
                             int64_t F);

// A dense MLP's activation as a layer keeps it: fp32 runs keep the up projection's output `pre`
// [N, F] (gelu) or [N, 2F] (swiglu) and the activation's output `act` [N, F]; bf16 runs keep both in
// bf16 (pre_low, act_low; `pre` then only brings the up projection's output in, and act is unused).
// The precision is chosen here, by which buffers the layer has.
struct MlpActivations {
  float* pre = nullptr;
  float* act = nullptr;
  bf16* pre_low = nullptr;
  bf16* act_low = nullptr;
};
void mlp_activation_forward(bool gelu, const MlpActivations& a, int64_t N, int64_t F);
// d_pre ← d_act · activation'(pre) (overwritten), then what the up projection's backward does to it
// before its GEMMs (linear_backward_consuming): db (the up projection's bias, where not null) += its
// column sums, and in bf16 it is rounded once for the GEMMs (operand_in_place: into its copy in
// linear_dy_copy alone, or in place where the bf16 GEMMs read fp32).
// Returns d_pre as those GEMMs read it (linear_backward_gemms).
Mat<float> mlp_activation_backward(bool gelu, float* d_pre, float* db, const float* d_act, const MlpActivations& a,
                                   int64_t N, int64_t F);

}  // namespace origami
