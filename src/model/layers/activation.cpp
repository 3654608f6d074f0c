#include "model/layers/activation.h"

#include <cmath>

#include "kernels/cpu/fast_math.h"

namespace origami {

namespace {
constexpr double kGeluScale = 0.7978845608028654;  // √(2/π)
}

template <typename T>
void gelu_forward(T* y, const T* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T v = x[i];
    y[i] = T(0.5) * v * (T(1) + tanh_fast(T(kGeluScale) * (v + T(0.044715) * v * v * v)));
  }
}

template <typename T>
void gelu_backward(T* dx, const T* dy, const T* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T v = x[i];
    const T u = T(kGeluScale) * (v + T(0.044715) * v * v * v);
    const T t = tanh_fast(u);
    const T du = T(kGeluScale) * (T(1) + T(3 * 0.044715) * v * v);
    dx[i] = dy[i] * (T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * du);
  }
}

template <typename T>
void swiglu_forward(T* h, const T* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const T *g = gu + r * 2 * F, *u = g + F;
    T* hr = h + r * F;
    for (int64_t i = 0; i < F; ++i) hr[i] = g[i] / (T(1) + exp_fast(-g[i])) * u[i];
  }
}

template <typename T>
void swiglu_backward(T* dgu, const T* dh, const T* gu, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const T *g = gu + r * 2 * F, *u = g + F, *d = dh + r * F;
    T *dg = dgu + r * 2 * F, *du = dg + F;
    for (int64_t i = 0; i < F; ++i) {  // read before written: dgu may be gu (in place)
      const T gi = g[i], ui = u[i], di = d[i];
      const T sig = T(1) / (T(1) + exp_fast(-gi));
      du[i] = di * gi * sig;
      dg[i] = di * ui * sig * (T(1) + gi * (T(1) - sig));
    }
  }
}

#define INSTANTIATE(T)                                                     \
  template void gelu_forward<T>(T*, const T*, int64_t);                    \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t);         \
  template void swiglu_forward<T>(T*, const T*, int64_t, int64_t);         \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
