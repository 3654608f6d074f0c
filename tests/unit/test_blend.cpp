// Dataset blends (data/blend.h): the greedy rule, its guarantees, the spec parser's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"
#include "data/blend.h"

using namespace origami;

namespace {

// Every prefix of n samples holds within one sample of w_d·n from each dataset, and each dataset's
// samples are read in order 0, 1, 2, ...
TEST(DataBlend, EveryPrefixWithinOneSampleOfTheWeights) {
  const std::vector<std::vector<double>> cases = {
      {0.7, 0.3}, {1, 1, 1}, {0.5, 0.25, 0.125, 0.125}, {0.01, 0.99}, {3, 1, 2, 7, 5}, {1}, {1e-3, 1, 1e3}};
  for (const std::vector<double>& raw : cases) {
    double total = 0;
    for (double w : raw) total += w;
    BlendRule rule(raw);
    std::vector<int64_t> given(raw.size(), 0);
    for (int64_t n = 1; n <= 20000; ++n) {
      const BlendChoice c = rule.next();
      ASSERT_EQ(c.index, given[size_t(c.dataset)]) << "datasets are read in order";
      ++given[size_t(c.dataset)];
      for (size_t d = 0; d < raw.size(); ++d)
        ASSERT_LE(std::abs(double(given[d]) - raw[d] / total * double(n)), 1.0 + 1e-9)
            << "weights " << ::testing::PrintToString(raw) << ", dataset " << d << " after " << n << " samples";
    }
    EXPECT_EQ(rule.given(), given);
    EXPECT_EQ(rule.samples(), 20000);
  }
}

// The rule itself, written out for 0.75 / 0.25 (exact in binary, so the ties are exact too):
// the argmax of w·(i+1) − n, the first on ties.
TEST(DataBlend, ChoosesTheLargestShortfallFirstOnTies) {
  BlendRule rule({3, 1});
  std::vector<int> got;
  for (int i = 0; i < 8; ++i) got.push_back(rule.next().dataset);
  // i=0: 0.75 vs 0.25 → 0; i=1: 0.5 vs 0.5 → 0 (tie); i=2: 0.25 vs 0.75 → 1; i=3: 1 vs 0 → 0;
  // i=4: 0.75 vs 0.25 → 0; i=5: 0.5 vs 0.5 → 0 (tie); i=6: 0.25 vs 0.75 → 1; i=7: 1 vs 0 → 0.
  EXPECT_EQ(got, (std::vector<int>{0, 0, 1, 0, 0, 0, 1, 0}));
  BlendRule equal({1, 1});
  EXPECT_EQ(equal.next().dataset, 0);  // 0.5 vs 0.5: the first
  EXPECT_EQ(equal.next().dataset, 1);
}

// Ties that are exact only once each product is rounded: 0.7·15 − 10 and 0.3·15 − 4 are both 0.5
// (Megatron's helper, Python, and an unfused build), but a fused multiply-add keeps 0.7's and 0.3's
// binary errors and makes the second larger. The rule must not depend on the compiler's contraction.
TEST(DataBlend, TiesAfterRoundingGoToTheFirst) {
  BlendRule rule({0.7, 0.3});
  rule.take(0, 10), rule.take(1, 4);
  EXPECT_EQ(rule.choose(), 0);
  EXPECT_EQ(rule.next().dataset, 0);  // the same through next()
}

TEST(DataBlend, ParsesSpecsAndNamesMistakes) {
  const std::vector<BlendPart> one = parse_blend("data/web");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].prefix, "data/web");
  EXPECT_DOUBLE_EQ(one[0].weight, 1.0);
  const std::vector<BlendPart> two = parse_blend("  0.7 a\t0.3   b ");
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[1].prefix, "b");
  EXPECT_DOUBLE_EQ(two[0].weight, 0.7);
  const std::vector<BlendPart> norm = parse_blend("2 a 6 b");
  EXPECT_DOUBLE_EQ(norm[0].weight, 0.25);
  EXPECT_DOUBLE_EQ(parse_blend("1 a")[0].weight, 1.0);
  auto error_of = [](const char* spec) {
    try {
      parse_blend(spec);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("0.7 a 0.3").find("3 fields"), std::string::npos) << error_of("0.7 a 0.3");
  EXPECT_NE(error_of("x a 0.3 b").find("weight 'x'"), std::string::npos);
  EXPECT_NE(error_of("-1 a 2 b").find("weight '-1'"), std::string::npos);
  EXPECT_NE(error_of("0 a 2 b").find("must be a positive number"), std::string::npos);
  EXPECT_NE(error_of("1 a 2 a").find("'a' is given twice"), std::string::npos);
  // The same dataset spelled another way (each window would be read twice in a row) is the same.
  EXPECT_NE(error_of("1 a 2 ./a").find("'./a' is given twice (also as 'a')"), std::string::npos) << error_of("1 a 2 ./a");
  EXPECT_NE(error_of("1 d/../a 2 a").find("'a' is given twice (also as 'd/../a')"), std::string::npos);
  EXPECT_NE(error_of("  ").find("is empty"), std::string::npos);
  // An existing dataset whose prefix holds whitespace is that dataset, not a blend.
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "origami_blend_spaces";
  std::filesystem::create_directories(dir);
  const std::string spaced = (dir / "my data").string();
  std::ofstream(spaced + ".idx") << "x";
  const std::vector<BlendPart> whole = parse_blend(spaced);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_EQ(whole[0].prefix, spaced);
}

}  // namespace
