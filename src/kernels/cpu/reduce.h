// A sum in vector lanes (the clipping norm's, kernels/cpu/optimizer.h). It keeps eight partial
// results: element i goes to partial i mod 8, in index order, and the eight are combined in order at
// the end. The compiler keeps the eight in vector lanes, where a single running sum waits on each
// addition (4 cycles an element: how the norm's loop compiled, at a quarter of memory speed or less).
// The result depends on n and the values only, not on the CPU's vector width.
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

}  // namespace origami
