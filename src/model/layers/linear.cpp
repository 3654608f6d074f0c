#include "model/layers/linear.h"

#include "kernels/cpu/gemm.h"

namespace origami {

template <typename T>
void linear_forward(T* y, const T* x, const T* w, const T* b, int64_t N, int64_t in, int64_t out,
                    WeightLayout layout) {
  if (b) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < out; ++o) y[n * out + o] = b[o];
  }
  const bool wt = layout == WeightLayout::out_in;
  gemm<T>(false, wt, N, out, in, T(1), x, in, w, wt ? in : out, b ? T(1) : T(0), y, out);
}

template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, int64_t N, int64_t in,
                     int64_t out, WeightLayout layout, bool accumulate_dx) {
  const bool oi = layout == WeightLayout::out_in;
  if (dx) gemm<T>(false, !oi, N, in, out, T(1), dy, out, w, oi ? in : out, accumulate_dx ? T(1) : T(0), dx, in);
  if (dw) {
    if (oi) gemm<T>(true, false, out, in, N, T(1), dy, out, x, in, T(1), dw, in);   // dW[out,in] += dyᵀ·x
    else gemm<T>(true, false, in, out, N, T(1), x, in, dy, out, T(1), dw, out);     // dW[in,out] += xᵀ·dy
  }
  if (db) {
    // Column sums over rows; a thread owns a block of 64 columns and walks the rows in order
    // (contiguous reads, a fixed summation order).
#pragma omp parallel for schedule(static)
    for (int64_t o0 = 0; o0 < out; o0 += 64) {
      const int64_t o1 = o0 + 64 < out ? o0 + 64 : out;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t o = o0; o < o1; ++o) db[o] += dy[n * out + o];
    }
  }
}

template void linear_forward<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t, WeightLayout);
template void linear_forward<double>(double*, const double*, const double*, const double*, int64_t, int64_t, int64_t, WeightLayout);
template void linear_backward<float>(float*, float*, float*, const float*, const float*, const float*, int64_t, int64_t, int64_t, WeightLayout, bool);
template void linear_backward<double>(double*, double*, double*, const double*, const double*, const double*, int64_t, int64_t, int64_t, WeightLayout, bool);

}  // namespace origami
