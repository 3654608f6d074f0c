// The pipeline's message tags (parallel/pipeline.h): among the messages one rank sends another in a
// step, no two share a tag, and every tag fits the 32767 MPI guarantees whenever check_tags accepts
// the step — for every stage count, so that deep pipelines (35 stages of 280 micro-batches, as
// published GPT runs have) are not refused for tags they do not need.
#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "core/error.h"
#include "parallel/pipeline.h"

using namespace origami;

TEST(PipelineTags, UniqueBetweenEachPairOfRanks) {
  for (int stages : {2, 3, 4, 7})
    for (int chunks : {1, 2, 3})
      for (int micro : {1, 5}) {
        std::set<std::tuple<int, int, int>> seen;  // (sender, receiver, tag)
        const int virtual_stages = stages * chunks;
        for (int m = 0; m < micro; ++m)
          for (int b = 0; b + 1 < virtual_stages; ++b) {
            // Forward: virtual stage b sends to b + 1; backward: b + 1 sends to b.
            const int lower = b % stages, upper = (b + 1) % stages;
            const int fwd = Pipeline::message_tag(m, b, false, stages, chunks);
            const int bwd = Pipeline::message_tag(m, b, true, stages, chunks);
            EXPECT_TRUE(seen.insert({lower, upper, fwd}).second) << stages << "x" << chunks << " m" << m << " b" << b;
            EXPECT_TRUE(seen.insert({upper, lower, bwd}).second) << stages << "x" << chunks << " m" << m << " b" << b;
            EXPECT_LT(std::max(fwd, bwd), 2 * micro * chunks);
          }
      }
}

TEST(PipelineTags, CheckedAgainstMpisLimitWhateverTheStages) {
  Pipeline::check_tags(35, 280, 3);  // 35 stages or 350: 2 · 280 · 3 tags
  Pipeline::check_tags(350, 280, 3);
  Pipeline::check_tags(2, 16383, 1);
  EXPECT_THROW(Pipeline::check_tags(2, 16384, 1), Error);
  EXPECT_THROW(Pipeline::check_tags(4, 5462, 3), Error);
  Pipeline::check_tags(1, 100000, 1);  // one stage: no messages, any accumulation
}
