#include "model/layers/activation.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/parallel.h"
#include "model/layers/linear.h"

namespace origami {

namespace {

constexpr double kGeluScale = 0.7978845608028654;  // √(2/π)

template <typename T>
inline T gelu_of(T v) {
  return T(0.5) * v * (T(1) + tanh_fast(T(kGeluScale) * (v + T(0.044715) * v * v * v)));
}

template <typename T>
inline T gelu_slope(T v) {  // d gelu(v) / dv
  const T t = tanh_fast(T(kGeluScale) * (v + T(0.044715) * v * v * v));
  const T du = T(kGeluScale) * (T(1) + T(3 * 0.044715) * v * v);
  return T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * du;
}

// The activations' arithmetic, element by element, for the fp32 kernels and the bf16 ones alike.
// One row of SwiGLU: h = silu(g)·u.
template <typename T>
inline void swiglu_row(T* h, const T* g, const T* u, int64_t F) {
  for (int64_t i = 0; i < F; ++i) h[i] = g[i] / (T(1) + exp_fast(-g[i])) * u[i];
}

// Its backward: dg, du from dh. (Reading g and u into locals first, to allow writing in place, made
// GCC generate code with other last bits; an EP2 routing test sits close enough to a tie to see it.)
template <typename T>
inline void swiglu_row_backward(T* dg, T* du, const T* d, const T* g, const T* u, int64_t F) {
  for (int64_t i = 0; i < F; ++i) {
    const T sig = T(1) / (T(1) + exp_fast(-g[i]));
    du[i] = d[i] * g[i] * sig;
    dg[i] = d[i] * u[i] * sig * (T(1) + g[i] * (T(1) - sig));
  }
}

// Elements a thread converts and computes at a time in the bf16 kernels, while they are in cache.
constexpr int64_t kBlock = 2048;

// A thread's fp32 scratch of n floats (the bf16 kernels' widened values), kept for its next calls.
float* thread_floats(int64_t n) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < size_t(n)) buffer.resize(size_t(n));
  return buffer.data();
}

// Row r of an output [., n] rounded, on this thread inside the caller's parallel loop: `out` is null
// or the output, `copy` null or its bf16 copy (not both null). The row is computed into out's row, or
// where out is null into this thread's scratch (this function's result); done() then rounds it into
// copy's row and to bf16 precision in place in out — a copy alone is written once, rounded.
struct RoundedRow {
  float* out;
  bf16* copy;
  int64_t r, n;
  float* values() const { return out ? out + r * n : thread_floats(n); }
  void done(float* v) const {
    if (copy) to_bf16(copy + r * n, v, n);
    if (out) to_bf16_precision(v, v, n);
  }
};

}  // namespace

template <typename T>
void gelu_forward(T* y, const T* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = gelu_of(x[i]);
}

template <typename T>
void gelu_backward(T* dx, const T* dy, const T* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * gelu_slope(x[i]);
}

template <typename T>
void swiglu_forward(T* h, const T* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) swiglu_row(h + r * F, gu + r * 2 * F, gu + r * 2 * F + F, F);
}

template <typename T>
void swiglu_backward(T* dgu, const T* dh, const T* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    T* dg = dgu + r * 2 * F;
    swiglu_row_backward(dg, dg + F, dh + r * F, gu + r * 2 * F, gu + r * 2 * F + F, F);
  }
}

void gelu_forward_bf16(bf16* y_low, bf16* x_low, const float* x, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t k = std::min(kBlock, n - b);
    float* v = thread_floats(kBlock);
    to_bf16(x_low + b, x + b, k);
    to_float(v, x_low + b, k);
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) v[i] = gelu_of(v[i]);
    to_bf16(y_low + b, v, k);
  }
}

void gelu_backward_rounded(float* dx, bf16* copy, float* db, const float* dy, const bf16* x_low, int64_t N,
                           int64_t F) {
  constexpr int64_t kRun = 512;
#pragma omp parallel
  {
    const Share mine = my_share(F);
    float acc[kRun], d[kRun];
    for (int64_t c0 = mine.begin, end = mine.end; c0 < end; c0 += kRun) {
      const int64_t k = std::min(kRun, end - c0);
      if (db) std::copy(db + c0, db + c0 + k, acc);
      for (int64_t r = 0; r < N; ++r) {
        const int64_t at = r * F + c0;
#pragma omp simd  // (x widened in the lanes: no pass through a buffer)
        for (int64_t i = 0; i < k; ++i) d[i] = dy[at + i] * gelu_slope(to_float(x_low[at + i]));
        if (db) {
#pragma omp simd
          for (int64_t i = 0; i < k; ++i) acc[i] += d[i];
        }
        if (copy) to_bf16(copy + at, d, k);
        else to_bf16_precision(dx + at, d, k);
      }
      if (db) std::copy(acc, acc + k, db + c0);
    }
  }
}

void swiglu_forward_bf16(bf16* h_low, bf16* gu_low, const float* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    float* v = thread_floats(3 * F);  // the rounded gate|up, then h
    to_bf16(gu_low + r * 2 * F, gu + r * 2 * F, 2 * F);
    to_float(v, gu_low + r * 2 * F, 2 * F);
    swiglu_row(v + 2 * F, v, v + F, F);
    to_bf16(h_low + r * F, v + 2 * F, F);
  }
}

void swiglu_backward_bf16(float* dgu, const float* dh, const bf16* gu_low, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    float* v = thread_floats(2 * F);
    to_float(v, gu_low + r * 2 * F, 2 * F);
    float* dg = dgu + r * 2 * F;
    swiglu_row_backward(dg, dg + F, dh + r * F, v, v + F, F);
  }
}

void swiglu_forward_rounded(float* h, bf16* copy, const float* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const RoundedRow row{h, copy, r, F};
    float* v = row.values();
    swiglu_row(v, gu + r * 2 * F, gu + r * 2 * F + F, F);
    row.done(v);
  }
}

void swiglu_backward_rounded(float* dgu, bf16* copy, const float* dh, const float* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const RoundedRow row{dgu, copy, r, 2 * F};
    float* dg = row.values();
    swiglu_row_backward(dg, dg + F, dh + r * F, gu + r * 2 * F, gu + r * 2 * F + F, F);
    row.done(dg);
  }
}

void mlp_activation_forward(bool gelu, const MlpActivations& a, int64_t N, int64_t F) {
  if (a.pre_low) {
    if (gelu) gelu_forward_bf16(a.act_low, a.pre_low, a.pre, N * F);
    else swiglu_forward_bf16(a.act_low, a.pre_low, a.pre, N, F);
  } else {
    if (gelu) gelu_forward(a.act, a.pre, N * F);
    else swiglu_forward(a.act, a.pre, N, F);
  }
}

Mat<float> mlp_activation_backward(bool gelu, float* d_pre, float* db, const float* d_act, const MlpActivations& a,
                                   int64_t N, int64_t F) {
  if (a.pre_low && gelu) {
    bf16* copy = in_place_copy(linear_dy_copy(), N * F);
    gelu_backward_rounded(d_pre, copy, db, d_act, a.pre_low, N, F);
    return rounded_once<float>(d_pre, copy, F);
  }
  if (a.pre_low) swiglu_backward_bf16(d_pre, d_act, a.pre_low, N, F);
  else if (gelu) gelu_backward(d_pre, d_act, a.pre, N * F);
  else swiglu_backward(d_pre, d_act, a.pre, N, F);
  const int64_t Fa = gelu ? F : 2 * F;
  if (db) bias_backward(db, static_cast<const float*>(d_pre), N, Fa);
  return operand_in_place(a.pre_low ? Precision::bf16 : Precision::fp32, d_pre, N, Fa, linear_dy_copy());
}

#define INSTANTIATE(T)                                                     \
  template void gelu_forward<T>(T*, const T*, int64_t);                    \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t);         \
  template void swiglu_forward<T>(T*, const T*, int64_t, int64_t);         \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
