#include "train/test_hooks.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
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
  if (const char* e = std::getenv("ORIGAMI_TEST_FAIL")) {
    char file[4096] = "";
    ORIGAMI_CHECK(std::sscanf(e, "%lld:%d:%4095s", &h.fail_step_, &h.fail_rank_, file) == 3 && h.fail_step_ >= 1 &&
                      h.fail_rank_ >= 0,
                  "ORIGAMI_TEST_FAIL must be STEP:RANK:FILE (a step from 1, a world rank, a marker file), got '", e, "'");
    h.fail_file_ = file;
  }
  if (const char* e = std::getenv("ORIGAMI_TEST_FAIL_IN")) {
    ORIGAMI_CHECK(std::string(e) == "step" || std::string(e) == "validation",
                  "ORIGAMI_TEST_FAIL_IN must be step or validation, got '", e, "'");
    h.fail_in_ = std::string(e) == "validation" ? In::validation : In::step;
  }
  if (const char* e = std::getenv("ORIGAMI_TEST_SLOW_BACKWARD"))
    ORIGAMI_CHECK(std::sscanf(e, "%d:%d", &h.slow_rank_, &h.slow_ms_) == 2 && h.slow_rank_ >= 0 && h.slow_ms_ >= 0,
                  "ORIGAMI_TEST_SLOW_BACKWARD must be RANK:MS (a world rank, milliseconds), got '", e, "'");
  if (const char* e = std::getenv("ORIGAMI_TEST_ROUTER_SKEW")) {
    char* end = nullptr;
    h.skew_ = std::strtod(e, &end);
    ORIGAMI_CHECK(*e && !*end && std::isfinite(h.skew_), "ORIGAMI_TEST_ROUTER_SKEW must be a number, got '", e, "'");
    ORIGAMI_CHECK(moe, "ORIGAMI_TEST_ROUTER_SKEW is for mixture-of-experts models");
  }
  if (const char* dir = std::getenv("ORIGAMI_TEST_ROUTING"); dir && moe)
    h.routing_log_ = std::make_shared<std::ofstream>(cat(dir, "/routing.", world_rank, ".jsonl"), std::ios::app);
  return h;
}

std::string TestHooks::describe() const {
  if (skew_ != 0) return cat("test router skew: experts 0 and 1 selected with a bias of ", skew_, " (ORIGAMI_TEST_ROUTER_SKEW)");
  if (slow_rank_ >= 0)
    return cat("test slow backward: rank ", slow_rank_, " sleeps ", slow_ms_, " ms before each backward (ORIGAMI_TEST_SLOW_BACKWARD)");
  if (nan_step_ < 1) return "";
  return cat("test fault injection: a NaN in rank ", nan_rank_, "'s gradient at step ", nan_step_,
             " (ORIGAMI_TEST_NAN_GRAD)");
}

void TestHooks::poison_gradient(int64_t step, float* grad) {
  if (step != nan_step_ || nan_rank_ != rank_ || injected_) return;
  *grad = std::numeric_limits<float>::quiet_NaN();
  injected_ = true;
}

void TestHooks::slow_backward() const {
  if (rank_ == slow_rank_) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
}

void TestHooks::fail_once(int64_t step, In where) const {
  if (where != fail_in_ || step != fail_step_ || rank_ != fail_rank_ || std::filesystem::exists(fail_file_)) return;
  std::ofstream(fail_file_) << "failed\n";
  throw std::runtime_error(cat("test failure at step ", step, where == In::validation ? "'s validation" : "",
                              " (ORIGAMI_TEST_FAIL)"));
}

void TestHooks::log_routing(int64_t step, const std::vector<std::vector<int64_t>>& counts) {
  if (routing_log_) *routing_log_ << nlohmann::json({{"step", step}, {"expert_counts", counts}}).dump() << std::endl;
}

void TestHooks::skew_router(std::vector<std::vector<float>>& bias, int64_t layers, int64_t experts) const {
  if (skew_ == 0) return;
  if (bias.empty()) bias.assign(size_t(layers), std::vector<float>(size_t(experts), 0.f));
  for (std::vector<float>& b : bias)
    for (size_t e = 0; e < std::min<size_t>(2, b.size()); ++e) b[e] += float(skew_);
}

}  // namespace origami
