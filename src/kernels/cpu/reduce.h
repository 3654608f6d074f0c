// The reductions the element-wise kernels share (norm statistics, softmax and cross-entropy rows,
// the clipping norm). Each keeps eight partial results: element i goes to partial i mod 8, in index
// order, and the eight are combined in order at the end. The compiler keeps the eight in vector
// lanes, where a single running sum waits on each addition (4 cycles an element: how those loops
// compiled before, at a quarter of memory speed or less). The result depends on n and the values
// only: the same on every CPU and thread count.
#pragma once
#include <cstdint>

namespace origami {

constexpr int kReduceLanes = 8;

// Σ_{i<n} f(i), accumulated in A.
template <typename A, typename F>
inline A lane_sum(int64_t n, F&& f) {
  A part[kReduceLanes] = {};
  int64_t i = 0;
  for (; i + kReduceLanes <= n; i += kReduceLanes)
    for (int k = 0; k < kReduceLanes; ++k) part[k] += A(f(i + k));
  for (int k = 0; i < n; ++i, ++k) part[k] += A(f(i));
  A sum = 0;
  for (A p : part) sum += p;
  return sum;
}

// max_{i<n} x[i] for n ≥ 1. A NaN element after x[0] is passed over (as std::max passes over its
// second argument; a NaN x[0] stays in its lanes): callers that must see one find it in a sum.
template <typename T>
inline T lane_max(const T* x, int64_t n) {
  T part[kReduceLanes];
  for (T& p : part) p = x[0];
  int64_t i = 0;
  for (; i + kReduceLanes <= n; i += kReduceLanes)
    for (int k = 0; k < kReduceLanes; ++k) part[k] = x[i + k] > part[k] ? x[i + k] : part[k];
  for (int k = 0; i < n; ++i, ++k) part[k] = x[i] > part[k] ? x[i] : part[k];
  T m = part[0];
  for (T p : part) m = p > m ? p : m;
  return m;
}

}  // namespace origami
