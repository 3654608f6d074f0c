// Test-only switches of a training run, in one place: read once from the environment when the run
// starts (an unset variable leaves its hook inert) and each called from one place in the trainer.
//   ORIGAMI_TEST_NAN_GRAD=STEP:RANK  world rank RANK's gradient at the first parameter backward
//       reaches in step STEP (from 1) becomes NaN, before any reduction — as a fault in one rank's
//       backward would. The non-finite guard must stop every rank (tests/parallel/test_run_safety.py).
//   ORIGAMI_TEST_FAIL=STEP:RANK:FILE  world rank RANK throws (an error on that rank alone) as step STEP
//       (from 1) starts — STEP = --steps + 1: after the last step and its save —, unless FILE exists,
//       which it creates first: a failure once, which `origami launch` must restart, or end after the
//       last save (tests/parallel/test_launch.py).
//   ORIGAMI_TEST_FAIL_IN=validation  ORIGAMI_TEST_FAIL's throw comes as step STEP's validation starts
//       instead: a run that fails there must resume without losing the step's metrics row
//       (tests/cli/test_train_cli.py).
//   ORIGAMI_TEST_ROUTING=DIR  every rank of a MoE run appends its own routed counts per step to
//       DIR/routing.RANK.jsonl, from which a test derives the dispatcher's bytes independently
//       (tests/parallel/test_expert_parallel.py).
//   ORIGAMI_TEST_SLOW_BACKWARD=RANK:MS  world rank RANK sleeps MS milliseconds before each backward
//       pass of its pipeline stage: a slow stage, whose next stage then runs ahead of it and piles up
//       backward sends (tests/parallel/test_pipeline.py, the memory check's count).
//   ORIGAMI_TEST_ROUTER_SKEW=B  every MoE layer's router adds B to the selection scores of experts 0
//       and 1 (as the aux-loss-free bias does; without --moe-router-bias-update-rate it stays put):
//       the skewed routing of the FSSDP-against-EP benchmark (bench/fssdp_bench.py).
#pragma once
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace origami {

class TestHooks {
 public:
  // Error naming the variable for a malformed value.
  static TestHooks from_env(int world_rank, bool moe);

  // The startup line of an armed fault injection ("" when none is).
  std::string describe() const;
  // The gradient hook: makes *grad NaN once, in step `step` on the chosen rank.
  void poison_gradient(int64_t step, float* grad);
  // Before each backward pass: sleeps on the chosen rank (ORIGAMI_TEST_SLOW_BACKWARD).
  bool slows_backward() const { return slow_rank_ == rank_; }
  void slow_backward() const;
  // As step `step` (from 1) or its validation starts (ORIGAMI_TEST_FAIL_IN): throws on the chosen rank,
  // once (ORIGAMI_TEST_FAIL).
  enum class In { step, validation };
  void fail_once(int64_t step, In where) const;
  // After the step's routing: this rank's counts per layer and expert.
  void log_routing(int64_t step, const std::vector<std::vector<int64_t>>& counts);
  // At the start: the router skew added to the selection bias ([layers][experts], allocated if empty).
  void skew_router(std::vector<std::vector<float>>& bias, int64_t layers, int64_t experts) const;

 private:
  int rank_ = 0;
  long long nan_step_ = -1;
  int nan_rank_ = -1;
  bool injected_ = false;
  long long fail_step_ = -1;
  int fail_rank_ = -1;
  std::string fail_file_;
  In fail_in_ = In::step;
  double skew_ = 0;
  int slow_rank_ = -1, slow_ms_ = 0;
  std::shared_ptr<std::ofstream> routing_log_;
};

}  // namespace origami
