// Pointwise MLP activations.
// GELU (tanh approximation, HF "gelu_new"): y = ½x(1 + tanh(√(2/π)(x + 0.044715x³))).
// SwiGLU: gu_NF2 holds per row [gate(F) | up(F)]; h_NF = silu(gate)·up.
// Backward overwrites dx / dgu, which may be the input x / gu itself (in place).
#pragma once
#include <cstdint>

namespace origami {

template <typename T>
void gelu_forward(T* y, const T* x, int64_t n);
template <typename T>
void gelu_backward(T* dx, const T* dy, const T* x, int64_t n);

template <typename T>
void swiglu_forward(T* h_NF, const T* gu_NF2, int64_t N, int64_t F);
template <typename T>
void swiglu_backward(T* dgu_NF2, const T* dh_NF, const T* gu_NF2, int64_t N, int64_t F);

}  // namespace origami
