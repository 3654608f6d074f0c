// The vectorisable exp of the float hot loops (kernels/cpu/fast_math.h): within 2e-7 of exp over its
// clamped range, and finite up to the top of it (it returned +inf on [88.376, 88.7], where n rounded
// to 128 and 2^128 is infinity).
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu/fast_math.h"

namespace origami {

TEST(FastMath, ExpWithinItsBoundAndFinite) {
  double worst = 0;
  for (double x = -87.3; x <= 88.37; x += 0.0137) {
    const double want = std::exp(double(float(x)));
    const double e = std::abs(double(exp_fast(float(x))) - want) / want;
    if (!(e <= worst)) worst = e;  // (a NaN becomes the worst: std::max would drop it)
  }
  EXPECT_LE(worst, 2e-7);
  for (const float x : {88.3f, 88.38f, 88.5f, 88.7f, 1e4f}) {
    SCOPED_TRACE(x);
    EXPECT_TRUE(std::isfinite(exp_fast(x)));
  }
}

}  // namespace origami
