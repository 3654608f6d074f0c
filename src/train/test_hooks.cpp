#include "train/test_hooks.h"

#include <cstdio>
#include <cstdlib>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace origami {

TestHooks TestHooks::from_env(int world_rank, bool moe) {
  TestHooks h;
  h.rank_ = world_rank;
  if (const char* e = std::getenv("ORIGAMI_TEST_NAN_GRAD"))
    ORIGAMI_CHECK(std::sscanf(e, "%lld:%d", &h.nan_step_, &h.nan_rank_) == 2 && h.nan_step_ >= 1 && h.nan_rank_ >= 0,
                  "ORIGAMI_TEST_NAN_GRAD must be STEP:RANK (a step from 1, a world rank), got '", e, "'");
  if (const char* dir = std::getenv("ORIGAMI_TEST_ROUTING"); dir && moe)
    h.routing_log_ = std::make_shared<std::ofstream>(cat(dir, "/routing.", world_rank, ".jsonl"), std::ios::app);
  return h;
}

std::string TestHooks::describe() const {
  if (nan_step_ < 1) return "";
  return cat("test fault injection: a NaN in rank ", nan_rank_, "'s gradient at step ", nan_step_,
             " (ORIGAMI_TEST_NAN_GRAD)");
}

void TestHooks::poison_gradient(int64_t step, float* grad) {
  if (step != nan_step_ || nan_rank_ != rank_ || injected_) return;
  *grad = std::numeric_limits<float>::quiet_NaN();
  injected_ = true;
}

void TestHooks::log_routing(int64_t step, const std::vector<std::vector<int64_t>>& counts) {
  if (routing_log_) *routing_log_ << nlohmann::json({{"step", step}, {"expert_counts", counts}}).dump() << std::endl;
}

}  // namespace origami
