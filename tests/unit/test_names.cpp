// Parameterised tests are named by their case (AttentionFd.…/B2_T70_H6_KV2_D8), never by an index
// (…/3) or a byte dump: a failing case must say which one it is.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <string>

TEST(TestNames, ParameterisedCasesAreNamed) {
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  int parameterised = 0;
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(i);
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const ::testing::TestInfo& test = *suite.GetTestInfo(j);
      if (!test.value_param()) continue;
      ++parameterised;
      const std::string name = test.name(), last = name.substr(name.rfind('/') + 1);
      EXPECT_FALSE(std::all_of(last.begin(), last.end(), [](unsigned char c) { return std::isdigit(c); }))
          << suite.name() << "." << name << " is named by its index, not its case";
      EXPECT_EQ(std::string(test.value_param()).find("-byte object"), std::string::npos)
          << suite.name() << "." << name << " prints its parameter as bytes: " << test.value_param();
    }
  }
  EXPECT_GT(parameterised, 0);
}
