// One loop over rows, spread over the OpenMP threads only where that pays.
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

}  // namespace origami
