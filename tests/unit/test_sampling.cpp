// sample_token (train/sampling.h): the inverse-CDF draw over the top-k tokens at a temperature.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "train/sampling.h"

namespace origami {
namespace {

const float kInf = std::numeric_limits<float>::infinity(), kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(SampleToken, GreedyTakesTheFirstLargestAndSkipsNaN) {
  const std::vector<float> logits = {kNaN, 1.f, 3.f, 3.f, -kInf};
  EXPECT_EQ(sample_token(logits.data(), 5, 0.0, 0, 0.5), 2);
}

TEST(SampleToken, DrawsByTheCumulativeProbabilities) {
  const std::vector<float> logits = {0.f, std::log(3.f)};  // p = 1/4, 3/4: token 1 first (sorted by logit)
  EXPECT_EQ(sample_token(logits.data(), 2, 1.0, 0, 0.70), 1);
  EXPECT_EQ(sample_token(logits.data(), 2, 1.0, 0, 0.80), 0);
  EXPECT_EQ(sample_token(logits.data(), 2, 1.0, 1, 0.99), 1);  // top-1: token 1 whatever the draw
}

// A token the vocabulary skips (−inf) or a NaN logit is never drawn, even by a draw just below 1 that
// rounding leaves above the running sum: the draw falls back to the last token of non-zero probability.
TEST(SampleToken, NeverDrawsAZeroProbabilityToken) {
  std::vector<float> logits(1000, 0.f);
  logits[3] = -kInf, logits[7] = kNaN;
  const double u = std::nextafter(1.0, 0.0);
  for (int k : {0, 1000}) {
    const int32_t t = sample_token(logits.data(), 1000, 1.0, k, u);
    EXPECT_NE(t, 3);
    EXPECT_NE(t, 7);
  }
  std::vector<float> two = {-kInf, 2.f, kNaN};
  for (double d : {0.0, 0.5, u}) EXPECT_EQ(sample_token(two.data(), 3, 0.7, 0, d), 1);
}

}  // namespace
}  // namespace origami
