#include "kernels/cpu/optimizer.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/reduce.h"

namespace origami {

void adamw_update(float* w, bf16* low, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
  // Blocks small enough that the bf16 copy reads the block's new values from L1.
  constexpr int64_t kBlock = 2048;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
#pragma omp simd
    for (int64_t j = b; j < e; ++j) {
      const float gj = g[j] * s.grad_scale;
      m[j] = s.b1 * m[j] + (1.f - s.b1) * gj;
      v[j] = s.b2 * v[j] + (1.f - s.b2) * gj * gj;
      w[j] = w[j] * s.keep - s.step_size * m[j] / (std::sqrt(v[j]) * s.inv_sqrt_bc2 + s.eps);
    }
    if (low != nullptr) to_bf16(low + b, w + b, e - b);
  }
}

void zero_streaming(float* x, int64_t n) {
  int64_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(x + i) % 32 != 0; ++i) x[i] = 0.f;
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(x + i, _mm256_setzero_ps());
  for (; i < n; ++i) x[i] = 0.f;
  _mm_sfence();  // (streaming stores are weakly ordered: visible to the other threads past the caller's barrier)
}

double sum_squares(const float* x, int64_t n) {
  constexpr int kParts = 8;                          // read in lockstep (optimizer.h)
  constexpr int64_t kInParts = int64_t(1) << 16;     // from this many elements on
  auto square = [x](int64_t i) { return double(x[i]) * double(x[i]); };
  if (n < kInParts) return lane_sum<double>(n, square);
  const int64_t q = n / kParts / kReduceLanes * kReduceLanes;  // each part's elements, whole lane groups
  double part[kParts][kReduceLanes] = {};
  for (int64_t i = 0; i < q; i += kReduceLanes)
    for (int p = 0; p < kParts; ++p)
      for (int k = 0; k < kReduceLanes; ++k) part[p][k] += square(p * q + i + k);
  double sum = 0;
  for (const auto& lanes : part)
    for (double v : lanes) sum += v;
  return sum + lane_sum<double>(n - kParts * q, [&](int64_t i) { return square(kParts * q + i); });
}

}  // namespace origami
