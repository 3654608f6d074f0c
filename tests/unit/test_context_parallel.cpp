// ContextParallel's counters on one rank (a document batching micro-batch at CP degree 1 runs there):
// its forward counts the whole sequence's causal (query, key) pairs, as the ring's blocks do over
// C ranks, so a rank running a sequence alone shows that work in the metrics' cp.pairs.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "parallel/context_parallel.h"

namespace origami {
namespace {

TEST(ContextParallelCounters, OneRankCountsTheCausalPairs) {
  ContextParallel cp;
  const int64_t B = 2, T = 12, H = 4, KV = 2, D = 8;
  const CpShape s = cp.shape(B, T, H, KV, D);
  std::vector<float> qkv(size_t(B * T * (H + 2 * KV) * D), 0.1f), out(size_t(B * T * H * D)), lse(size_t(B * H * T));
  cp.forward(out.data(), lse.data(), nullptr, nullptr, qkv.data(), s, nullptr);
  EXPECT_EQ(cp.counters().pairs, B * H * T * (T + 1) / 2);
  cp.forward(out.data(), lse.data(), nullptr, nullptr, qkv.data(), s, nullptr);
  EXPECT_EQ(cp.counters().pairs, 2 * B * H * T * (T + 1) / 2);
  cp.reset_counters();
  EXPECT_EQ(cp.counters().pairs, 0);
}

}  // namespace
}  // namespace origami
