// LayerNorm (gpt2) and RMSNorm (llama, mixtral) over the last dim.
// Legend: N rows, C channels. Forward saves per-row statistics for backward:
// LayerNorm mean_N and rstd_N, RMSNorm rstd_N. dx is accumulated (+=) into the residual
// stream's gradient; dw, db accumulate (+=).
#pragma once
#include <cstdint>

namespace origami {

template <typename T>
void layernorm_forward(T* y_NC, T* mean_N, T* rstd_N, const T* x_NC, const T* w, const T* b,
                       int64_t N, int64_t C, double eps);
template <typename T>
void layernorm_backward(T* dx_NC, T* dw, T* db, const T* dy_NC, const T* x_NC, const T* w,
                        const T* mean_N, const T* rstd_N, int64_t N, int64_t C);

template <typename T>
void rmsnorm_forward(T* y_NC, T* rstd_N, const T* x_NC, const T* w, int64_t N, int64_t C, double eps);
template <typename T>
void rmsnorm_backward(T* dx_NC, T* dw, const T* dy_NC, const T* x_NC, const T* w, const T* rstd_N,
                      int64_t N, int64_t C);

}  // namespace origami
