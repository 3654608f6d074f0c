#include "model/layers/linear.h"

#include <vector>

namespace origami {

template <typename T>
void linear_forward(T* y, Id<Operand<T>> x, Id<Weights<T>> w, const T* b, int64_t N, int64_t in, int64_t out,
                    WeightLayout layout) {
  if (b) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < out; ++o) y[n * out + o] = b[o];
  }
  const bool wt = layout == WeightLayout::out_in;
  matmul<T>(w.p, false, wt, N, out, in, T(1), x.mat(in), w.mat(wt ? in : out), b ? T(1) : T(0), y, out);
}

namespace {

// db += column sums of dy [N, out]. A thread owns a block of 64 columns and walks the rows in order
// (contiguous reads, a fixed summation order).
template <typename T>
void bias_backward(T* db, const T* dy, int64_t N, int64_t out) {
#pragma omp parallel for schedule(static)
  for (int64_t o0 = 0; o0 < out; o0 += 64) {
    const int64_t o1 = o0 + 64 < out ? o0 + 64 : out;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = o0; o < o1; ++o) db[o] += dy[n * out + o];
  }
}

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

// This thread's bf16 copy of a backward's dy, for both its GEMMs: one buffer for both entry points
// below (the memory check counts one).
std::vector<bf16>& dy_copy() {
  thread_local std::vector<bf16> low;
  return low;
}

}  // namespace

template <typename T>
void linear_backward(T* dx, T* dw, T* db, const T* dy, Id<Operand<T>> x, Id<Weights<T>> w, int64_t N, int64_t in,
                     int64_t out, WeightLayout layout, bool accumulate_dx) {
  backward_gemms(dx, dw, operand(w.p, dy, N, out, dy_copy()), x, w, N, in, out, layout, accumulate_dx);
  if (db) bias_backward(db, dy, N, out);
}

template <typename T>
void linear_backward_consuming(T* dx, T* dw, T* db, T* dy, Id<Operand<T>> x, Id<Weights<T>> w, int64_t N, int64_t in,
                               int64_t out, WeightLayout layout) {
  if (db) bias_backward(db, static_cast<const T*>(dy), N, out);
  backward_gemms(dx, dw, operand_in_place(w.p, dy, N, out, dy_copy()), x, w, N, in, out, layout, false);
}

#define INSTANTIATE(T)                                                                                          \
  template void linear_forward<T>(T*, Operand<T>, Weights<T>, const T*, int64_t, int64_t, int64_t, WeightLayout); \
  template void linear_backward<T>(T*, T*, T*, const T*, Operand<T>, Weights<T>, int64_t, int64_t, int64_t,      \
                                   WeightLayout, bool);                                                          \
  template void linear_backward_consuming<T>(T*, T*, T*, T*, Operand<T>, Weights<T>, int64_t, int64_t, int64_t,  \
                                             WeightLayout);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
