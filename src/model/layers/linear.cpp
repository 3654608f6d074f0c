#include "model/layers/linear.h"

#include <algorithm>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace origami {

template <typename T>
void linear_forward(T* y, Id<Operand<T>> x, Id<Weights<T>> w, const T* b, int64_t N, int64_t in, int64_t out,
                    WeightLayout layout) {
  const bool wt = layout == WeightLayout::out_in;
  if (b) matmul_bias<T>(w.p, false, wt, N, out, in, x.mat(in), w.mat(wt ? in : out), b, y, out);
  else matmul<T>(w.p, false, wt, N, out, in, T(1), x.mat(in), w.mat(wt ? in : out), T(0), y, out);
}

// dy [N, out]: a thread owns an equal share of the columns and walks the rows over runs of up to
// kRun of them, summed in a local block: each row a long contiguous read. (Blocks of 64 columns read
// 256 B a row at a stride of a whole row, which the prefetchers did not follow: on an AMX host the
// column sums of a GPT-2 L6 d384 bf16 step ran at about 5 GB/s, 3.7% of its time.)
template <typename T>
void bias_backward(T* db, const T* dy, int64_t N, int64_t out) {
  constexpr int64_t kRun = 512;
#pragma omp parallel
  {
    const Share mine = my_share(out);
    T acc[kRun];
    for (int64_t c0 = mine.begin, end = mine.end; c0 < end; c0 += kRun) {
      const int64_t n_cols = std::min(kRun, end - c0);
      std::copy(db + c0, db + c0 + n_cols, acc);
      for (int64_t n = 0; n < N; ++n) {
        const T* row = dy + n * out + c0;
#pragma omp simd
        for (int64_t o = 0; o < n_cols; ++o) acc[o] += row[o];
      }
      std::copy(acc, acc + n_cols, db + c0);
    }
  }
}

namespace {

// dx and dW from dy as its GEMMs read it (g).
template <typename T>
void backward_gemms(T* dx, T* dw, Mat<T> g, Operand<T> x, Weights<T> w, int64_t N, int64_t in, int64_t out,
                    WeightLayout layout, bool accumulate_dx) {
  const bool oi = layout == WeightLayout::out_in;
  if (dx) matmul<T>(w.p, false, !oi, N, in, out, T(1), g, w.mat(oi ? in : out), accumulate_dx ? T(1) : T(0), dx, in);
  if (!dw) return;
  if (oi) matmul<T>(w.p, true, false, out, in, N, T(1), g, x.mat(in), T(1), dw, in);  // dW[out,in] += dyᵀ·x
  else matmul<T>(w.p, true, false, in, out, N, T(1), x.mat(in), g, T(1), dw, out);    // dW[in,out] += xᵀ·dy
}

}  // namespace

std::vector<bf16>& linear_dy_copy() {
  thread_local std::vector<bf16> low;
  return low;
}

template <typename T>
void linear_backward_gemms(T* dx, T* dw, Mat<T> dy, Id<Operand<T>> x, Id<Weights<T>> w, int64_t N, int64_t in,
                           int64_t out, WeightLayout layout) {
  backward_gemms(dx, dw, dy, x, w, N, in, out, layout, false);
}

template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, Id<Operand<T>> x, Id<Weights<T>> w, int64_t N, int64_t in,
                     int64_t out, WeightLayout layout, bool accumulate_dx) {
  backward_gemms(dx, dw, operand(w.p, dy, N, out, linear_dy_copy()), x, w, N, in, out, layout, accumulate_dx);
  if (db) bias_backward(db, dy, N, out);
}

template <typename T>
void linear_backward_consuming(T* dx, T* dw, T* db, T* dy, Id<Operand<T>> x, Id<Weights<T>> w, int64_t N, int64_t in,
                               int64_t out, WeightLayout layout) {
  if (db) bias_backward(db, static_cast<const T*>(dy), N, out);
  backward_gemms(dx, dw, operand_in_place(w.p, dy, N, out, linear_dy_copy()), x, w, N, in, out, layout, false);
}

#define INSTANTIATE(T)                                                                                          \
  template void linear_forward<T>(T*, Operand<T>, Weights<T>, const T*, int64_t, int64_t, int64_t, WeightLayout); \
  template void linear_backward<T>(T*, T*, T*, const T*, Operand<T>, Weights<T>, int64_t, int64_t, int64_t,      \
                                   WeightLayout, bool);                                                          \
  template void linear_backward_consuming<T>(T*, T*, T*, T*, Operand<T>, Weights<T>, int64_t, int64_t, int64_t,  \
                                             WeightLayout);                                               \
  template void bias_backward<T>(T*, const T*, int64_t, int64_t);                                               \
  template void linear_backward_gemms<T>(T*, T*, Mat<T>, Operand<T>, Weights<T>, int64_t, int64_t, int64_t,      \
                                         WeightLayout);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
