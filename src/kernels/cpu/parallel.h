// One loop over rows, spread over the OpenMP threads only where that pays; a thread's equal share of a range.
#pragma once

#include <omp.h>

#include <cstdint>

namespace origami {

// fn(r) for every r in [0, rows): over the threads when `worth_threads` and the caller is not already
// inside a parallel region (a row of a kernel's parallel loop); else on the calling thread without
// entering a region at all — an `if` clause that is false still makes a team of one (about 1 us with
// an allocation per call, measured per row of the MoE experts' SwiGLU).
template <typename Fn>
void over_rows(int64_t rows, bool worth_threads, Fn&& fn) {
  if (!worth_threads || rows <= 1 || omp_in_parallel()) {
    for (int64_t r = 0; r < rows; ++r) fn(r);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) fn(r);
}

// [begin, end): the calling thread's part of [0, n) inside a parallel region, the threads' parts
// equal (within one) and in thread order. A kernel whose threads each own such a part of its
// columns (or of a segment) sums in an order that no schedule changes.
struct Share {
  int64_t begin, end;
};
inline Share my_share(int64_t n) {
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  return {n * t / nt, n * (t + 1) / nt};
}

}  // namespace origami
