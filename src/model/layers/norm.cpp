#include "model/layers/norm.h"

#include <cmath>
#include <vector>

#include <omp.h>

#include "kernels/cpu/reduce.h"

namespace origami {

// dw/db are reduced over rows: each thread sums into its own row of a [threads, C] scratch,
// then the rows are added in a fixed order (deterministic for a fixed thread count).
template <typename T>
static void reduce_thread_partials(T* out, std::vector<T>& partial, int threads, int64_t C) {
  for (int t = 0; t < threads; ++t)
    for (int64_t c = 0; c < C; ++c) out[c] += partial[size_t(t * C + c)];
}

template <typename T>
void layernorm_forward(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    const double m = lane_sum<double>(C, [xr](int64_t c) { return xr[c]; }) / double(C);
    const double v = lane_sum<double>(C, [xr, m](int64_t c) { return (xr[c] - m) * (xr[c] - m); }) / double(C);
    const T s = T(1.0 / std::sqrt(v + eps)), mt = T(m);
    T* yr = y + n * C;
    for (int64_t c = 0; c < C; ++c) yr[c] = (xr[c] - mt) * s * w[c] + b[c];
    mean[n] = mt;
    rstd[n] = s;
  }
}

template <typename T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const T* mean,
                        const T* rstd, int64_t N, int64_t C) {
  const int threads = omp_get_max_threads();
  std::vector<T> pw(size_t(threads * C), T(0)), pb(size_t(threads * C), T(0));
#pragma omp parallel
  {
    T* mw = pw.data() + omp_get_thread_num() * C;
    T* mb = pb.data() + omp_get_thread_num() * C;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const T *xr = x + n * C, *dyr = dy + n * C;
      const T m = mean[n], s = rstd[n];
      // xhat = (x-m)·s; dxhat = dy·w; dx = s·(dxhat − mean(dxhat) − xhat·mean(dxhat·xhat))
      const T sum_d = lane_sum<T>(C, [&](int64_t c) { return dyr[c] * w[c]; }) / T(C);
      const T sum_dx = lane_sum<T>(C, [&](int64_t c) { return dyr[c] * w[c] * ((xr[c] - m) * s); }) / T(C);
      for (int64_t c = 0; c < C; ++c) {
        mw[c] += dyr[c] * ((xr[c] - m) * s);
        mb[c] += dyr[c];
      }
      T* dxr = dx + n * C;
      for (int64_t c = 0; c < C; ++c) {
        const T xh = (xr[c] - m) * s;
        dxr[c] += s * (dyr[c] * w[c] - sum_d - xh * sum_dx);
      }
    }
  }
  reduce_thread_partials(dw, pw, threads, C);
  reduce_thread_partials(db, pb, threads, C);
}

template <typename T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* w, int64_t N, int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    const double ss = lane_sum<double>(C, [xr](int64_t c) { return double(xr[c]) * xr[c]; });
    const T s = T(1.0 / std::sqrt(ss / double(C) + eps));
    T* yr = y + n * C;
    for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * s * w[c];
    rstd[n] = s;
  }
}

template <typename T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd, int64_t N,
                      int64_t C) {
  const int threads = omp_get_max_threads();
  std::vector<T> pw(size_t(threads * C), T(0));
#pragma omp parallel
  {
    T* mw = pw.data() + omp_get_thread_num() * C;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const T *xr = x + n * C, *dyr = dy + n * C;
      const T s = rstd[n];
      // y = x·s·w, s = (mean(x²)+eps)^-½ ; dx = s·(dy·w) − x·s³·mean(dy·w·x)
      const T dot = lane_sum<T>(C, [&](int64_t c) { return dyr[c] * w[c] * xr[c]; });
      for (int64_t c = 0; c < C; ++c) mw[c] += dyr[c] * xr[c] * s;
      const T k = s * s * s * dot / T(C);
      T* dxr = dx + n * C;
      for (int64_t c = 0; c < C; ++c) dxr[c] += s * dyr[c] * w[c] - xr[c] * k;
    }
  }
  reduce_thread_partials(dw, pw, threads, C);
}

#define INSTANTIATE(T)                                                                                    \
  template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, double); \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*,      \
                                      int64_t, int64_t);                                                  \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double);                 \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
