// The optimizer's kernels (kernels/cpu/optimizer.h) against their definitions, AdamW's bf16 copy, and
// the reductions the element-wise kernels share (kernels/cpu/reduce.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/reduce.h"
#include "model/params.h"
#include "train/optimizer.h"

namespace origami {
namespace {

std::vector<float> random_floats(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> x(n);
  for (float& e : x) e = u(rng);
  return x;
}

// 5000 elements: two whole 2048-element blocks of the kernel and a tail.
TEST(AdamWUpdate, MatchesItsFormulaInDoubleAndCopiesTheNewValues) {
  const int64_t n = 5000;
  const std::vector<float> w0 = random_floats(n, -1, 1, 1), g = random_floats(n, -3, 3, 2),
                           m0 = random_floats(n, -0.1f, 0.1f, 3), v0 = random_floats(n, 0, 0.01f, 4);
  const AdamWScalars s{0.9f, 0.95f, 3e-3f, 1.7f, 1e-8f, 0.999f, 0.25f};
  std::vector<float> w = w0, m = m0, v = v0;
  std::vector<bf16> low(n, bf16{0});
  adamw_update(w.data(), low.data(), g.data(), m.data(), v.data(), n, s);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = double(g[i]) * s.grad_scale, mi = s.b1 * double(m0[i]) + (1 - double(s.b1)) * gi,
                 vi = s.b2 * double(v0[i]) + (1 - double(s.b2)) * gi * gi,
                 wi = double(w0[i]) * s.keep - s.step_size * mi / (std::sqrt(vi) * s.inv_sqrt_bc2 + s.eps);
    // fp32 arithmetic: a few roundings of 2^-24 each, relative to the terms' size.
    ASSERT_NEAR(m[i], mi, 1e-6 * (std::fabs(mi) + std::fabs(gi))) << i;
    ASSERT_NEAR(v[i], vi, 1e-6 * (vi + gi * gi)) << i;
    ASSERT_NEAR(w[i], wi, 1e-6 * (std::fabs(wi) + s.step_size * std::fabs(mi) / std::sqrt(vi))) << i;
    ASSERT_EQ(low[i].bits, to_bf16(w[i]).bits) << i;  // the copy is exactly the rounded new value
  }
  // Without a copy the update is the same, bit for bit.
  std::vector<float> w2 = w0, m2 = m0, v2 = v0;
  adamw_update(w2.data(), nullptr, g.data(), m2.data(), v2.data(), n, s);
  EXPECT_EQ(w2, w);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
}

TEST(SumSquares, IsTheExactSumRoundedToDouble) {
  // (1 << 16 on: read as 8 parts in lockstep, and the rest)
  for (size_t n : {size_t(0), size_t(7), size_t(8), size_t(65535), size_t(65536), size_t(1000003)}) {
    std::vector<float> x = random_floats(n, -2, 2, uint32_t(n));
    for (size_t i = 0; i < n; i += 97) x[i] *= 1e4f;  // magnitudes far apart
    long double exact = 0;
    for (float e : x) exact += (long double)e * e;
    EXPECT_NEAR(sum_squares(x.data(), int64_t(n)), double(exact), 1e-14 * double(exact)) << n;
  }
  // A non-finite element makes the sum non-finite: how the clipping norm detects one.
  std::vector<float> x(100, 1.f);
  x[37] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(sum_squares(x.data(), 100)));
  x[37] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(sum_squares(x.data(), 100)));
  // ... in any of the parts or the rest of a long one.
  for (size_t at : {size_t(0), size_t(70000), size_t(999999), size_t(1000002)}) {
    std::vector<float> y(1000003, 1.f);
    y[at] = std::numeric_limits<float>::infinity();
    EXPECT_TRUE(std::isinf(sum_squares(y.data(), int64_t(y.size())))) << at;
  }
}

// Exactly x[0..n) is cleared, from any alignment (the head and tail before and after the streaming
// stores' 32-byte lines), and no neighbour; Params::zero_grad, which splits it over the threads, too.
TEST(ZeroStreaming, ClearsExactlyItsRange) {
  std::vector<float> x(300);
  for (int64_t start : {0, 1, 3, 7, 8, 9}) {
    for (int64_t n : {0, 1, 5, 8, 15, 16, 17, 100, 255}) {
      std::fill(x.begin(), x.end(), 2.f);
      zero_streaming(x.data() + start, n);
      for (int64_t i = 0; i < int64_t(x.size()); ++i)
        ASSERT_EQ(x[size_t(i)], i >= start && i < start + n ? 0.f : 2.f) << "start " << start << " n " << n << " i " << i;
    }
  }
  std::vector<ParamSpec> table(1);
  table[0].name = "wte.weight", table[0].shape = {1001, 3};  // 3003 floats: odd shares over the threads
  Params p(table);
  p.init(1, 1, 0.02);
  std::fill(p.grad(), p.grad() + p.size(), -1.f);
  p.zero_grad();
  EXPECT_EQ(std::count(p.grad(), p.grad() + p.size(), 0.f), p.size());
}

// The update writes the bf16 copy of the segments inside its copy ranges, and no other.
TEST(AdamW, WritesTheBf16CopyOfItsCopyRangesOnly) {
  std::vector<ParamSpec> table(2);
  table[0].name = "h.0.mlp.c_fc.weight", table[0].shape = {30, 70};
  table[1].name = "h.0.mlp.c_fc.bias", table[1].shape = {70};
  Params p(table);
  p.init(7, 1, 0.02);
  p.keep_bf16_copy();
  const std::vector<float> g = random_floats(size_t(p.size()), -1, 1, 9);
  std::copy(g.begin(), g.end(), p.grad());
  const std::vector<bf16> before(p.bf16_copy(), p.bf16_copy() + p.size());
  const Range first{p.offset(0), p.offset(0) + p.local_numel(0)}, second{p.offset(1), p.offset(1) + p.local_numel(1)};
  AdamW opt(p, AdamWConfig{}, {}, {first});
  opt.step(p, 1e-2);
  for (int64_t i = first.begin; i < first.end; ++i) ASSERT_EQ(p.bf16_copy()[i].bits, to_bf16(p.data()[i]).bits) << i;
  int64_t changed = 0;
  for (int64_t i = second.begin; i < second.end; ++i) {
    ASSERT_EQ(p.bf16_copy()[i].bits, before[size_t(i)].bits) << i;
    changed += to_bf16(p.data()[i]).bits != before[size_t(i)].bits;
  }
  EXPECT_GT(changed, 0);  // the values did change: the copy's staying put is the range's doing
}

// lane_sum's order is its definition: partial k sums the elements i ≡ k (mod 8) in index order, then
// the eight partials are added in order — in float, where the order shows in the last bits.
TEST(LaneSum, AddsInItsStatedOrder) {
  for (int64_t n : {0, 1, 7, 8, 9, 1001}) {
    const std::vector<float> x = random_floats(size_t(n), -1, 1, uint32_t(n + 11));
    float part[8] = {};
    for (int64_t i = 0; i < n; ++i) part[i % 8] += x[size_t(i)];
    float want = 0;
    for (float p : part) want += p;
    EXPECT_EQ(lane_sum<float>(n, [&](int64_t i) { return x[size_t(i)]; }), want) << n;
  }
}

TEST(LaneMax, IsTheMaximumAndPassesOverNaN) {
  for (int64_t n : {1, 5, 8, 17, 1000}) {
    std::vector<float> x = random_floats(size_t(n), -5, -1, uint32_t(n));
    x[size_t(n / 2)] = 3.f;
    EXPECT_EQ(lane_max(x.data(), n), 3.f) << n;
    if (n > 1) {
      x[size_t(n - 1)] = std::numeric_limits<float>::quiet_NaN();
      EXPECT_EQ(lane_max(x.data(), n), 3.f) << n;
    }
  }
}

}  // namespace
}  // namespace origami
