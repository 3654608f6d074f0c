// The planner's routing imbalance from a run (plan/routing_skew.h): each EP degree's figure is the
// step's busiest EP rank over the mean, summed over the MoE layers (the experts grouped as EP places
// them), and the median over the file's steps; the file's mistakes are errors naming it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "core/error.h"
#include "plan/routing_skew.h"

using namespace origami;

namespace {

std::string write_metrics(const std::string& name, const std::string& text) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("origami_routing_skew_" + std::to_string(::getpid()) + "_" + name + ".jsonl")).string();
  std::ofstream(path) << text;
  return path;
}

std::string error_of(const std::string& path, int64_t layers, int64_t experts) {
  try {
    routing_skew_from_metrics(path, layers, experts);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(RoutingSkew, GroupsExpertsAsExpertParallelismPlacesThem) {
  // Layer 0: experts 0-3 got 30 rows, 4-7 got 10: EP2 ranks 30 and 10 (max 30, mean 20); EP4 ranks
  // (experts in pairs) 20, 10, 5, 5 (max 20, mean 10). Layer 1 is even (EP2: 8 and 8; EP4: 4 each).
  const std::vector<std::vector<int64_t>> tokens = {{15, 5, 5, 5, 5, 0, 5, 0}, {2, 2, 2, 2, 2, 2, 2, 2}};
  EXPECT_DOUBLE_EQ(grouped_imbalance(tokens, 1), 1.0);
  EXPECT_DOUBLE_EQ(grouped_imbalance(tokens, 2), (30.0 + 8) / (20 + 8));
  EXPECT_DOUBLE_EQ(grouped_imbalance(tokens, 4), (20.0 + 4) / (10 + 4));
  EXPECT_DOUBLE_EQ(grouped_imbalance(tokens, 8), (15.0 + 2) / (5 + 2));
}

TEST(RoutingSkew, MedianOverStepsForEveryDivisor) {
  // Three steps of one layer of four experts, EP2 figures 1.5, 1.0 and 1.25 (median 1.25); a blank
  // line, a row without expert_tokens (a dense field only) and a last line cut short are passed over.
  const std::string path = write_metrics("median",
      "{\"step\":1,\"expert_tokens\":[[3,3,1,1]]}\n\n{\"step\":2,\"expert_tokens\":[[2,2,2,2]]}\n"
      "{\"step\":3,\"loss\":1.0}\n{\"step\":4,\"expert_tokens\":[[5,0,1,2]]}\n{\"step\":5,\"expert_to");
  const RoutingSkew skew = routing_skew_from_metrics(path, 1, 4);
  EXPECT_EQ(skew.steps, 3);
  ASSERT_EQ(skew.by_ep.size(), 2u);  // EP2 and EP4
  EXPECT_DOUBLE_EQ(skew.at(2), 1.25);
  EXPECT_DOUBLE_EQ(skew.at(4), 1.5);  // steps: 1.5, 1.0, 2.5
  EXPECT_DOUBLE_EQ(skew.at(1), 1.0);
  EXPECT_NE(skew.describe().find("EP2 1.250, EP4 1.500 (from " + path + ", median of 3 steps)"), std::string::npos);
  EXPECT_DOUBLE_EQ(RoutingSkew{1.3}.at(4), 1.3);
  EXPECT_DOUBLE_EQ(RoutingSkew{1.3}.at(1), 1.0);
  EXPECT_DOUBLE_EQ(RoutingSkew{3.0}.at(2), 2.0);  // all of a layer's rows on one of two ranks: twice the mean
  EXPECT_DOUBLE_EQ(RoutingSkew{3.0}.at(4), 3.0);
  // With the model known: a rank's E/ep experts get at most min(k, E/ep) of a token's k assignments.
  RoutingSkew mixtral{8.0};  // 8 experts, top-2
  mixtral.experts = 8, mixtral.top_k = 2;
  EXPECT_DOUBLE_EQ(mixtral.at(8), 4.0);  // one expert a rank: at most one of a token's 2 assignments
  EXPECT_DOUBLE_EQ(mixtral.at(4), 4.0);  // two experts a rank: both, all the rows over 4 ranks
  EXPECT_DOUBLE_EQ(mixtral.at(2), 2.0);
  EXPECT_EQ(RoutingSkew{}.describe(), "1 (even routing; --imbalance X or FILE prices a skew)");
  EXPECT_EQ(RoutingSkew{1.25}.describe(), "1.25 (stated)");
  EXPECT_EQ(RoutingSkew{9}.describe(), "9 (stated; EPd at most d·min(k, E/d)/k: every row its experts can get)");  // the cap said
  std::filesystem::remove(path);
}

TEST(RoutingSkew, MistakesNameTheFile) {
  const std::string none = write_metrics("none", "{\"step\":1,\"loss\":2.5}\n");
  EXPECT_NE(error_of(none, 1, 8).find("--imbalance " + none + ": no step has \"expert_tokens\""), std::string::npos);
  const std::string other = write_metrics("other", "{\"step\":1,\"expert_tokens\":[[1,2,3,4]]}\n");
  EXPECT_NE(error_of(other, 1, 8).find(other + ":1: field 'expert_tokens[0]': 4 experts, where the model has 8"),
            std::string::npos);
  const std::string empty = write_metrics("empty", "{\"step\":1,\"expert_tokens\":[[0,0],[0,0]]}\n");
  EXPECT_NE(error_of(empty, 2, 2).find("no token routed to any expert"), std::string::npos);
  const std::string negative = write_metrics("negative", "{\"step\":1,\"expert_tokens\":[[1,-2]]}\n");
  EXPECT_NE(error_of(negative, 1, 2).find("field 'expert_tokens[0][1]': expected"), std::string::npos);
  const std::string text = write_metrics("text", "\n\nnot json\n{\"step\":1}\n");  // (its third line)
  EXPECT_NE(error_of(text, 1, 2).find(text + ":3 is not a JSON object"), std::string::npos);
  EXPECT_NE(error_of("/nonexistent/m.jsonl", 1, 2).find("/nonexistent/m.jsonl"), std::string::npos);
  EXPECT_NE(error_of(other, 2, 4).find(other + ":1: field 'expert_tokens': 1 layer, where the model has 2"),
            std::string::npos);
  const RoutingSkew four = routing_skew_from_metrics(other, 1, 4);
  try {  // an EP degree that does not divide the experts has no figure: an error naming it
    four.at(3);
    ADD_FAILURE() << "EP3 of 4 experts: no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no figure for EP3, which does not divide the experts"), std::string::npos);
  }
  for (const std::string& p : {none, other, empty, negative, text}) std::filesystem::remove(p);
}
