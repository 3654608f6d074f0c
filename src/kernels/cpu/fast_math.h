// Vectorisable exp for the float hot loops (softmax, GELU's tanh, SiLU's sigmoid). libm's expf
// and tanhf are scalar calls; this branch-free version lets the compiler use SIMD lanes.
// Accuracy: relative error below 2e-7 over the clamped range (Cephes' expf polynomial on
// r = x − n·ln2, |r| ≤ ln2/2, then scaling by 2ⁿ through the exponent bits). Inputs are clamped
// to [−87.3, 88.37], so exp(−∞) gives ~1e-38 rather than 0 — harmless where it is used.
// The double versions are plain libm, so finite-difference tests see exact math.
#pragma once
#include <cmath>
#include <cstdint>

namespace origami {

// 2ⁿ for an integer-valued n in [−127, 128] (−127: 0) from the exponent bits, without converting n to
// an integer (undefined for a NaN input): n + 127 lands exactly in the low mantissa bits of
// 1.5·2²³ + n + 127, and a shift by 23 keeps just those 9 bits, moved into the exponent field.
inline float pow2(float n) {
  const float biased = n + (12582912.0f + 127.0f);
  uint32_t low;
  __builtin_memcpy(&low, &biased, sizeof low);
  const uint32_t bits = low << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);  // std::bit_cast blocks vectorisation in GCC 12
  return scale;
}

inline float exp_fast(float x) {
  // (above 127.5·ln2 = 88.376, n would round to 128, whose 2^n is infinity: clamped below it)
  x = x < -87.3f ? -87.3f : (x > 88.37f ? 88.37f : x);
  // Round to nearest by the 1.5·2²³ trick: plain arithmetic, so the loop vectorises
  // (std::floor does not without -fno-trapping-math).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x − n·ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return y * pow2(n);  // n ∈ [−126, 127]; a NaN x gives NaN through y
}
inline double exp_fast(double x) { return std::exp(x); }

// tanh(u) = 1 − 2/(1 + e^{2u}): saturates cleanly to ±1; absolute error ~1e-7.
inline float tanh_fast(float u) { return 1.0f - 2.0f / (1.0f + exp_fast(2.0f * u)); }
inline double tanh_fast(double u) { return std::tanh(u); }

}  // namespace origami
