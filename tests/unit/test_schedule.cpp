// Pipeline schedules (src/parallel/schedule.h): every schedule of a grid of sizes is replayed across
// all its stages (no deadlock, every dependency met), and its bubble and in-flight micro-batches are
// checked against the formulas of Narayanan et al. 2021. No MPI.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "parallel/pipeline.h"
#include "parallel/schedule.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

using namespace origami;

namespace {

struct Config {
  ScheduleKind kind;
  int stages, microbatches, chunks;
  std::string name() const {
    return cat(schedule_kind_name(kind), " p=", stages, " M=", microbatches, " v=", chunks);
  }
};

// The grid: every kind, p in {1,2,3,4,8}, M in {1,2,3,4,8,16}; interleaved with
// v in {2,3}, p >= 2 and M a multiple of p only.
std::vector<Config> grid() {
  std::vector<Config> out;
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 8, 16}) {
      out.push_back({ScheduleKind::gpipe, p, m, 1});
      out.push_back({ScheduleKind::one_f_one_b, p, m, 1});
      if (p >= 2 && m % p == 0)
        for (int v : {2, 3}) out.push_back({ScheduleKind::interleaved, p, m, v});
    }
  return out;
}

std::vector<std::vector<Action>> all_stages(const Config& c) {
  std::vector<std::vector<Action>> out;
  for (int s = 0; s < c.stages; ++s) out.push_back(make_schedule(c.kind, c.stages, s, c.microbatches, c.chunks));
  return out;
}

Replay replay(const Config& c, double t_forward, double t_backward) {
  return replay_schedules(all_stages(c), c.stages, c.microbatches, c.chunks, t_forward, t_backward);
}

auto is(ActionType t) {
  return [t](const Action& a) { return a.type == t; };
}
int count(const std::vector<Action>& list, ActionType t) { return int(std::count_if(list.begin(), list.end(), is(t))); }

// (microbatch, chunk) of the computes of one type, in list order.
std::vector<std::pair<int, int>> computes(const std::vector<Action>& list, ActionType t) {
  std::vector<std::pair<int, int>> out;
  for (const Action& a : list)
    if (a.type == t) out.push_back({a.microbatch, a.chunk});
  return out;
}

// The message of the Error thrown by f, or "" if none is thrown.
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ScheduleKinds, ParseAndName) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved})
    EXPECT_EQ(parse_schedule_kind(schedule_kind_name(k)), k);
  EXPECT_STREQ(schedule_kind_name(ScheduleKind::one_f_one_b), "1f1b");
  const std::string msg = error_of([] { parse_schedule_kind("zigzag"); });
  EXPECT_NE(msg.find("--pp-schedule 'zigzag' is not one of gpipe, 1f1b, interleaved"), std::string::npos) << msg;
}

// Exact lists for small cases, written out by hand from the paper's figures.
TEST(ScheduleLists, OneFOneBTwoStages) {
  using T = ActionType;
  // Stage 0 of p=2, M=3: warm-up 1 forward, steady F1 B0, F2 B1, cool-down B2.
  const std::vector<Action> s0 = {{T::forward, 0, 0},       {T::send_forward, 0, 0},  {T::forward, 1, 0},
                                  {T::send_forward, 1, 0},  {T::recv_backward, 0, 0}, {T::backward, 0, 0},
                                  {T::forward, 2, 0},       {T::send_forward, 2, 0},  {T::recv_backward, 1, 0},
                                  {T::backward, 1, 0},      {T::recv_backward, 2, 0}, {T::backward, 2, 0}};
  EXPECT_EQ(make_schedule(ScheduleKind::one_f_one_b, 2, 0, 3), s0);
  // Stage 1 (last): no warm-up, F B alternate; it sends no activation and receives no gradient.
  const std::vector<Action> s1 = {{T::recv_forward, 0, 0}, {T::forward, 0, 0},  {T::backward, 0, 0},
                                  {T::send_backward, 0, 0}, {T::recv_forward, 1, 0}, {T::forward, 1, 0},
                                  {T::backward, 1, 0},      {T::send_backward, 1, 0}, {T::recv_forward, 2, 0},
                                  {T::forward, 2, 0},       {T::backward, 2, 0},      {T::send_backward, 2, 0}};
  EXPECT_EQ(make_schedule(ScheduleKind::one_f_one_b, 2, 1, 3), s1);
  // One stage: forward and backward alternate, no communication at all.
  const std::vector<Action> single = {{T::forward, 0, 0}, {T::backward, 0, 0}, {T::forward, 1, 0}, {T::backward, 1, 0}};
  EXPECT_EQ(make_schedule(ScheduleKind::one_f_one_b, 1, 0, 2), single);
}

TEST(ScheduleLists, GpipeAllForwardsThenAllBackwardsInOrder) {
  const auto list = make_schedule(ScheduleKind::gpipe, 3, 1, 4);
  const std::vector<std::pair<int, int>> order = {{0, 0}, {1, 0}, {2, 0}, {3, 0}};
  EXPECT_EQ(computes(list, ActionType::forward), order);
  EXPECT_EQ(computes(list, ActionType::backward), order);
  const auto first_backward = std::find_if(list.begin(), list.end(), is(ActionType::backward));
  EXPECT_EQ(std::count_if(first_backward, list.end(), is(ActionType::forward)), 0);
}

TEST(ScheduleLists, InterleavedMegatronOrder) {
  // p=2, v=2, M=4: forward k -> chunk (k/2)%2, micro-batch (k/4)*2 + k%2; backwards reverse chunks.
  for (int s : {0, 1}) {
    const auto list = make_schedule(ScheduleKind::interleaved, 2, s, 4, 2);
    const std::vector<std::pair<int, int>> fwd = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {2, 0}, {3, 0}, {2, 1}, {3, 1}};
    const std::vector<std::pair<int, int>> bwd = {{0, 1}, {1, 1}, {0, 0}, {1, 0}, {2, 1}, {3, 1}, {2, 0}, {3, 0}};
    EXPECT_EQ(computes(list, ActionType::forward), fwd) << "stage " << s;
    EXPECT_EQ(computes(list, ActionType::backward), bwd) << "stage " << s;
  }
  // p=2, v=3: stage 0 warm-up (2-0-1)*2 + (3-1)*2 = 6, stage 1 warm-up 4.
  EXPECT_EQ(num_warmup_forwards(ScheduleKind::interleaved, 2, 0, 4, 3), 6);
  EXPECT_EQ(num_warmup_forwards(ScheduleKind::interleaved, 2, 1, 4, 3), 4);
  // Capped at M*v: p=4, v=2, M=4 stage 0 would be 3*2 + 4 = 10 > 8.
  EXPECT_EQ(num_warmup_forwards(ScheduleKind::interleaved, 4, 0, 4, 2), 8);
}

// Structure over the whole grid: counts, the warm-up, and each transfer right next to its compute.
TEST(ScheduleLists, CountsWarmupAndTransfersNextToCompute) {
  for (const Config& c : grid()) {
    const int p = c.stages, v = c.chunks, mv = c.microbatches * c.chunks;
    for (int s = 0; s < p; ++s) {
      const auto list = make_schedule(c.kind, p, s, c.microbatches, v);
      SCOPED_TRACE(cat(c.name(), " stage ", s));
      EXPECT_EQ(count(list, ActionType::forward), mv);
      EXPECT_EQ(count(list, ActionType::backward), mv);
      // Forwards before the first backward = the warm-up, plus the first steady-state forward.
      const auto first_b = std::find_if(list.begin(), list.end(), is(ActionType::backward));
      const int before = int(std::count_if(list.begin(), first_b, is(ActionType::forward)));
      const int warmup = num_warmup_forwards(c.kind, p, s, c.microbatches, v);
      EXPECT_EQ(before, std::min(warmup + 1, mv));
      for (size_t i = 0; i < list.size(); ++i) {
        const Action& a = list[i];
        const int u = a.chunk * p + s;
        const bool first = u == 0, last = u == p * v - 1;
        auto at = [&](size_t j) { return j < list.size() ? list[j] : Action{ActionType::forward, -1, -1}; };
        if (a.type == ActionType::forward) {
          if (!first) EXPECT_EQ(at(i - 1), (Action{ActionType::recv_forward, a.microbatch, a.chunk}));
          if (!last) EXPECT_EQ(at(i + 1), (Action{ActionType::send_forward, a.microbatch, a.chunk}));
        } else if (a.type == ActionType::backward) {
          if (!last) EXPECT_EQ(at(i - 1), (Action{ActionType::recv_backward, a.microbatch, a.chunk}));
          if (!first) EXPECT_EQ(at(i + 1), (Action{ActionType::send_backward, a.microbatch, a.chunk}));
        } else {
          // No transfer across the model's two ends.
          const bool at_input = a.type == ActionType::recv_forward || a.type == ActionType::send_backward;
          EXPECT_FALSE(at_input && first) << to_string(a);
          EXPECT_FALSE(!at_input && last) << to_string(a);
        }
      }
    }
  }
}

// Replays every schedule of the grid: replay_schedules throws on a deadlock or any broken
// dependency, and checks every (micro-batch, chunk) is forwarded and backwarded exactly once.
TEST(ScheduleReplay, WholeGridRunsWithoutDeadlock) {
  int n = 0;
  for (const Config& c : grid()) {
    SCOPED_TRACE(c.name());
    Replay r;
    ASSERT_NO_THROW(r = replay(c, 1, 2));
    ASSERT_EQ(int(r.stages.size()), c.stages);
    for (const StageTiming& t : r.stages) {
      EXPECT_DOUBLE_EQ(t.busy, c.microbatches * c.chunks * 3.0);  // M*v forwards (1) and backwards (2)
      EXPECT_DOUBLE_EQ(t.idle, t.finish - t.busy);
      EXPECT_LE(t.finish, r.makespan);
    }
    ++n;
  }
  EXPECT_EQ(n, 5 * 6 * 2 + 2 * (4 + 1 + 3 + 2));  // 60 gpipe/1f1b + 10 interleaved (p, M) pairs x 2 chunk counts
}

// Bubble (makespan - busy) / busy per stage, exact: (p-1)/M for gpipe and 1f1b, (p-1)/(v*M) for
// interleaved. Why it is exact whatever t_backward / t_forward (also for interleaved):
// for any schedule, stage p-1 cannot start before (p-1)*t_f (micro-batch 0 goes through stages
// 0..p-2 first), then computes v*M*(t_f + t_b), and the gradient of its last backward still has to
// pass through at least p-1 backwards (virtual stages below it) to reach stage 0: makespan >=
// (v*M + p - 1)*(t_f + t_b). These schedules attain that bound -- stage p-1 never waits once
// started -- so each stage's bubble is exactly (p-1)*(t_f + t_b) against busy v*M*(t_f + t_b).
// Checked with t_b/t_f = 1, 2, 0.5 and 3: the ratio does not matter.
TEST(ScheduleReplay, BubbleMatchesPaperExactly) {
  for (const Config& c : grid())
    for (auto [tf, tb] : {std::pair{1.0, 1.0}, std::pair{1.0, 2.0}, std::pair{2.0, 1.0}, std::pair{1.0, 3.0}}) {
      SCOPED_TRACE(cat(c.name(), " t_f=", tf, " t_b=", tb));
      const Replay r = replay(c, tf, tb);
      const double want = double(c.stages - 1) / (c.chunks * c.microbatches);
      EXPECT_NEAR(r.makespan, (c.chunks * c.microbatches + c.stages - 1) * (tf + tb), 1e-12);
      for (int s = 0; s < c.stages; ++s) {
        const double busy = r.stages[s].busy;
        EXPECT_NEAR((r.makespan - busy) / busy, want, 1e-12) << "stage " << s;
      }
    }
}

// Activations held at once (the memory argument for 1F1B): 1f1b min(p-s, M), gpipe M, interleaved
// the Megatron warm-up count + 1 (the steady state's first forward), capped at M*v when the warm-up
// already covers everything.
TEST(ScheduleReplay, InFlightBound) {
  for (const Config& c : grid()) {
    const Replay r = replay(c, 1, 2);
    for (int s = 0; s < c.stages; ++s) {
      SCOPED_TRACE(cat(c.name(), " stage ", s));
      const int got = r.stages[s].max_in_flight;
      const int p = c.stages, m = c.microbatches, v = c.chunks;
      switch (c.kind) {
        case ScheduleKind::gpipe: EXPECT_EQ(got, m); break;
        case ScheduleKind::one_f_one_b: EXPECT_EQ(got, std::min(p - s, m)); break;
        case ScheduleKind::interleaved: {
          const int megatron_warmup = (p - s - 1) * 2 + (v - 1) * p;  // uncapped
          EXPECT_LE(got, megatron_warmup + 1);
          EXPECT_EQ(got, std::min(megatron_warmup + 1, m * v));
          break;
        }
      }
    }
  }
  // Two spot values of the interleaved bound: p=4, v=2, M=8 holds 11 on stage 0 and 5 on stage 3
  // (1f1b with the same p holds 4 and 1, but of chunks twice as large).
  const Replay r = replay({ScheduleKind::interleaved, 4, 8, 2}, 1, 2);
  EXPECT_EQ(r.stages[0].max_in_flight, 11);
  EXPECT_EQ(r.stages[3].max_in_flight, 5);
}

// The pipeline's message buffers (Pipeline::buffer_bytes), in messages: a received input, the next
// receive, and the backward sends that may be in flight: GPipe's all (a stage behind a slower one
// piles them up: measured 7 of 8, with 3 counted before), 1f1b's and the interleaved schedule's
// kMaxBackwardSends (the trainer warns beyond it); the first stage sends none.
TEST(ScheduleMemory, MessageBuffersCountTheCooldownsSends) {
  auto messages = [](ScheduleKind kind, int p, int s, int m, int v) {
    return Pipeline::buffer_bytes(stage_actions(kind, p, s, m, v, false), p, 1) / 4;
  };
  EXPECT_EQ(messages(ScheduleKind::one_f_one_b, 4, 1, 8, 1), 2 + Pipeline::kMaxBackwardSends);
  EXPECT_EQ(messages(ScheduleKind::gpipe, 4, 2, 8, 1), 2 + 8);
  EXPECT_EQ(messages(ScheduleKind::one_f_one_b, 4, 0, 8, 1), 3);      // no sends: an evaluation's 3
  EXPECT_EQ(messages(ScheduleKind::one_f_one_b, 1, 0, 8, 1), 0);      // no pipeline
  EXPECT_EQ(messages(ScheduleKind::interleaved, 4, 0, 8, 2), 2 + Pipeline::kMaxBackwardSends);  // (wrap-around)
}

// What the memory check counts (pipeline_message_buffers): under document batching every step packs
// its own count of micro-batches, up to the planned one, and a small count can need more buffers
// (1f1b at 3 micro-batches on stage 1 of 4 has no forward after a backward: all 3 sends) than the
// planned one (6: the two counted).
TEST(ScheduleMemory, DocumentBatchingCountsEveryMicroBatchCount) {
  TrainOptions o;
  o.pp = 4;
  EXPECT_EQ(pipeline_message_buffers(o, 4, 1, 6, false), 2 + Pipeline::kMaxBackwardSends);
  o.batching = "documents";
  EXPECT_EQ(pipeline_message_buffers(o, 4, 1, 6, false), 2 + 3);
  EXPECT_EQ(pipeline_message_buffers(o, 1, 0, 6, false), 0);
}

// The activation peak the planner computes from a stage's list: with equal slots, the in-flight
// bound times the slot; with unequal chunk slots (interleaved, chunk 1 three times chunk 0's), the
// largest sum of live slots — checked here against a direct count.
TEST(ScheduleMemory, ActivationPeakFollowsTheList) {
  for (const Config& c : grid()) {
    const Replay r = replay(c, 1, 2);
    for (int s = 0; s < c.stages; ++s) {
      SCOPED_TRACE(cat(c.name(), " stage ", s));
      const std::vector<Action> list = make_schedule(c.kind, c.stages, s, c.microbatches, c.chunks);
      // One pool (an even split): what is in flight at once.
      EXPECT_EQ(schedule_activation_peak(list, std::vector<int64_t>(size_t(c.chunks), 1000),
                                         std::vector<int>(size_t(c.chunks), 0)),
                1000 * int64_t(r.stages[s].max_in_flight));
      // A pool per chunk (chunks of different shapes): each keeps the most of its own it had out.
      std::vector<int64_t> sizes;
      std::vector<int> own;
      for (int k = 0; k < c.chunks; ++k) sizes.push_back(100 * (2 * k + 1)), own.push_back(k);
      std::vector<int> out(size_t(c.chunks), 0), most(size_t(c.chunks), 0);
      for (const Action& a : list) {
        if (a.type == ActionType::forward) most[size_t(a.chunk)] = std::max(most[size_t(a.chunk)], ++out[size_t(a.chunk)]);
        if (a.type == ActionType::backward) out[size_t(a.chunk)]--;
      }
      int64_t held = 0;
      for (int k = 0; k < c.chunks; ++k) held += most[size_t(k)] * sizes[size_t(k)];
      EXPECT_EQ(schedule_activation_peak(list, sizes, own), held);
    }
  }
}

TEST(ScheduleErrors, MessagesNameTheValues) {
  auto expect = [](const std::string& msg, std::initializer_list<const char*> parts) {
    EXPECT_FALSE(msg.empty()) << "no Error thrown";
    for (const char* part : parts) EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
  };
  expect(error_of([] { check_schedule(ScheduleKind::interleaved, 2, 3, 2); }),
         {"microbatches=3", "stages=2", "multiple of", "Megatron"});
  expect(error_of([] { make_schedule(ScheduleKind::interleaved, 2, 0, 3, 2); }), {"microbatches=3", "stages=2"});
  expect(error_of([] { check_schedule(ScheduleKind::one_f_one_b, 4, 8, 2); }), {"1f1b", "chunks=2", "interleaved"});
  expect(error_of([] { make_schedule(ScheduleKind::gpipe, 4, 0, 8, 2); }), {"gpipe", "chunks=2"});
  expect(error_of([] { make_schedule(ScheduleKind::one_f_one_b, 4, 4, 8); }), {"stage 4", "stages=4", "0..3"});
  expect(error_of([] { make_schedule(ScheduleKind::one_f_one_b, 4, -1, 8); }), {"stage -1", "stages=4"});
  expect(error_of([] { check_schedule(ScheduleKind::gpipe, 0, 8, 1); }), {"stages=0", ">= 1"});
  expect(error_of([] { check_schedule(ScheduleKind::gpipe, 2, 0, 1); }), {"microbatches=0", ">= 1"});
  expect(error_of([] { check_schedule(ScheduleKind::interleaved, 2, 2, 0); }), {"chunks=0", ">= 1"});
  expect(error_of([] { check_schedule(ScheduleKind::interleaved, 1, 4, 2); }),
         {"interleaved", "stages >= 2", "stages=1"});
  EXPECT_NO_THROW(check_schedule(ScheduleKind::interleaved, 2, 4, 2));
  EXPECT_NO_THROW(check_schedule(ScheduleKind::one_f_one_b, 4, 3, 1));  // 1f1b and gpipe take any M
}

// Broken schedules make the replay throw: the checker really checks.
TEST(ScheduleReplay, CatchesBrokenSchedules) {
  using T = ActionType;
  const Config c{ScheduleKind::one_f_one_b, 2, 2, 1};
  auto replay_with = [&](auto edit) {
    auto lists = all_stages(c);
    edit(lists);
    return error_of([&] { replay_schedules(lists, c.stages, c.microbatches, c.chunks, 1, 2); });
  };
  auto find = [](const std::vector<Action>& l, Action a) { return std::find(l.begin(), l.end(), a) - l.begin(); };
  auto expect_has = [](const std::string& msg, const char* part) {
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: '" << msg << "'";
  };

  // Unedited: fine.
  EXPECT_EQ(replay_with([](auto&) {}), "");
  // Stage 0 waits for the gradient of micro-batch 0 before sending its activation: each stage waits
  // for the other.
  expect_has(replay_with([&](auto& l) {
               auto& s0 = l[0];
               std::swap(s0[find(s0, {T::send_forward, 0, 0})], s0[find(s0, {T::recv_backward, 0, 0})]);
             }),
             "deadlock");
  // Stage 1 receives micro-batch 1 first, but stage 0 sends micro-batch 0 first on that channel.
  expect_has(replay_with([&](auto& l) {
               auto& s1 = l[1];
               std::swap(s1[find(s1, {T::recv_forward, 0, 0})], s1[find(s1, {T::recv_forward, 1, 0})]);
             }),
             "earliest unmatched message");
  // A send before the compute that produces it.
  expect_has(replay_with([&](auto& l) {
               auto& s0 = l[0];
               std::swap(s0[find(s0, {T::forward, 0, 0})], s0[find(s0, {T::send_forward, 0, 0})]);
             }),
             "runs before its forward");
  // A forward without its input.
  expect_has(replay_with([&](auto& l) {
               auto& s1 = l[1];
               std::swap(s1[find(s1, {T::recv_forward, 0, 0})], s1[find(s1, {T::forward, 0, 0})]);
             }),
             "runs before its recv_forward");
  // On the last stage, a backward before the forward of the same micro-batch.
  expect_has(replay_with([&](auto& l) {
               auto& s1 = l[1];
               std::swap(s1[find(s1, {T::forward, 1, 0})], s1[find(s1, {T::backward, 1, 0})]);
             }),
             "runs before this stage's forward");
  // A backward missing: stage 1 never runs it, so never sends its gradient and stage 0 is stuck.
  expect_has(replay_with([&](auto& l) {
               auto& s1 = l[1];
               const auto b = find(s1, {T::backward, 1, 0}), sb = find(s1, {T::send_backward, 1, 0});
               s1.erase(s1.begin() + b, s1.begin() + sb + 1);
             }),
             "deadlock");
  // A duplicated forward.
  expect_has(replay_with([&](auto& l) { l[0].insert(l[0].begin(), Action{T::forward, 0, 0}); }), "runs twice");
  // A receive missing: its compute finds no input.
  expect_has(replay_with([&](auto& l) { l[0].erase(l[0].begin() + find(l[0], {T::recv_backward, 1, 0})); }),
             "runs before its recv_backward");
  // A send nobody receives: stage 1 drops micro-batch 1 altogether, stage 0 its backward.
  expect_has(replay_with([&](auto& l) {
               std::erase_if(l[1], [](const Action& a) { return a.microbatch == 1; });
               std::erase_if(l[0], [](const Action& a) { return a.microbatch == 1 && a.type >= T::recv_backward; });
             }),
             "never receives");
  // Transfers across the model's ends.
  expect_has(replay_with([&](auto& l) { l[0].insert(l[0].begin(), Action{T::recv_forward, 0, 0}); }),
             "first virtual stage has no input");
  // Out-of-range micro-batch.
  expect_has(replay_with([&](auto& l) { l[0].push_back(Action{T::forward, 2, 0}); }), "micro-batch must be in 0..1");
  // Interleaved: stage 1's chunk-0 output goes to stage 0's chunk 1; receiving chunk 1's
  // activations in the wrong order is caught.
  {
    const Config ci{ScheduleKind::interleaved, 2, 4, 2};
    auto lists = all_stages(ci);
    auto& s0 = lists[0];
    std::swap(s0[find(s0, {T::recv_forward, 0, 1})], s0[find(s0, {T::recv_forward, 1, 1})]);
    expect_has(error_of([&] { replay_schedules(lists, 2, 4, 2, 1, 2); }), "earliest unmatched message");
  }
}

TEST(SchedulePartition, EvenExplicitAndErrors) {
  using origami::partition_layers;
  auto ranges = partition_layers(8, 4, 1);
  ASSERT_EQ(ranges.size(), 4u);
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(ranges[size_t(s)].begin, 2 * s);
    EXPECT_EQ(ranges[size_t(s)].end, 2 * s + 2);
  }
  ranges = partition_layers(22, 4, 1, {5, 6, 6, 5});
  EXPECT_EQ(ranges[1].begin, 5);
  EXPECT_EQ(ranges[3].end, 22);
  EXPECT_EQ(partition_layers(8, 2, 2).size(), 4u);  // virtual stages, in virtual-stage order
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const origami::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { partition_layers(6, 4, 1); }).find("6 layers cannot be split evenly over 4"), std::string::npos);
  EXPECT_NE(message([] { partition_layers(22, 4, 1, {5, 6, 6, 6}); }).find("sums to 23 layers but the model has 22"),
            std::string::npos);
  EXPECT_NE(message([] { partition_layers(8, 4, 1, {4, 4}); }).find("lists 2 stage sizes but the pipeline has 4"),
            std::string::npos);
  EXPECT_NE(message([] { partition_layers(8, 2, 1, {8, 0}); }).find("at least one layer"), std::string::npos);
}

// ---- Vocabulary parallelism's output passes (with_vocab_passes) ----

// Over the grid (p >= 2): every stage runs each kind of pass once per micro-batch, in micro-batch
// order, and otherwise its base list unchanged; the first stage runs vocab_embed(m) before its forward
// of (m, 0) and vocab_embed_grad(m) after its backward of it, the last stage vocab(m) between its
// forward and its backward of (m, last chunk); the lists replay without deadlock with output passes of
// any cost, and lining the stages up costs little (the embedding passes sit next to output passes or
// at either end, adding no waiting): the makespan grows by the passes' own time and at most one
// forward per micro-batch.
TEST(ScheduleVocab, PassesOnEveryStageInOrderWithoutDeadlock) {
  for (const Config& c : grid()) {
    if (c.stages < 2) continue;
    SCOPED_TRACE(c.name());
    const auto base = all_stages(c);
    std::vector<std::vector<Action>> lists;
    ASSERT_NO_THROW(lists = with_vocab_passes(base, c.stages, c.microbatches, c.chunks));
    for (int s = 0; s < c.stages; ++s) {
      std::vector<Action> rest;
      std::map<ActionType, std::vector<int>> passes;
      for (const Action& a : lists[size_t(s)])
        if (is_vocab_pass(a.type)) passes[a.type].push_back(a.microbatch);
        else rest.push_back(a);
      EXPECT_EQ(rest, base[size_t(s)]) << "stage " << s;
      std::vector<int> want(size_t(c.microbatches));
      for (int m = 0; m < c.microbatches; ++m) want[size_t(m)] = m;
      for (ActionType t : {ActionType::vocab_embed, ActionType::vocab, ActionType::vocab_embed_grad})
        EXPECT_EQ(passes[t], want) << "stage " << s << " " << action_type_name(t);
    }
    const auto &first = lists.front(), &last = lists.back();
    auto at = [](const std::vector<Action>& l, Action a) { return std::find(l.begin(), l.end(), a) - l.begin(); };
    for (int m = 0; m < c.microbatches; ++m) {
      const auto pass = at(last, {ActionType::vocab, m, 0});
      EXPECT_LT(at(last, {ActionType::forward, m, c.chunks - 1}), pass);
      EXPECT_LT(pass, at(last, {ActionType::backward, m, c.chunks - 1}));
      EXPECT_LT(at(first, {ActionType::vocab_embed, m, 0}), at(first, {ActionType::forward, m, 0}));
      EXPECT_LT(at(first, {ActionType::backward, m, 0}), at(first, {ActionType::vocab_embed_grad, m, 0}));
    }
    for (double tv : {0.25, 1.0, 4.0}) {
      Replay r;
      ASSERT_NO_THROW(r = replay_schedules(lists, c.stages, c.microbatches, c.chunks, 1, 2, tv));
      // Each stage's busy time grows by exactly its passes; the makespan by them and by at most one
      // forward per micro-batch after the first (1F1B's steady state: the last stage waits, once per
      // micro-batch, for the others to end the action under way when its head forward ends).
      const Replay b = replay(c, 1, 2);
      for (int s = 0; s < c.stages; ++s) EXPECT_DOUBLE_EQ(r.stages[s].busy, b.stages[s].busy + c.microbatches * tv);
      EXPECT_LE(r.makespan, b.makespan + c.microbatches * tv + (c.microbatches - 1) * 1.0 + 1e-9) << "t_vocab " << tv;
    }
  }
  // GPipe's passes cost nothing but their own time: every forward precedes every pass's wait.
  const Config g{ScheduleKind::gpipe, 4, 8, 1};
  EXPECT_DOUBLE_EQ(replay_schedules(with_vocab_passes(all_stages(g), 4, 8, 1), 4, 8, 1, 1, 2, 0.5).makespan,
                   replay(g, 1, 2).makespan + 8 * 0.5);
}

// The replay refuses lists whose passes are missing, out of order, or before the head forward.
TEST(ScheduleVocab, ReplayCatchesBrokenPasses) {
  const Config c{ScheduleKind::one_f_one_b, 2, 2, 1};
  const auto good = with_vocab_passes(all_stages(c), 2, 2, 1);
  auto replay_with = [&](auto edit) {
    auto lists = good;
    edit(lists);
    return error_of([&] { replay_schedules(lists, 2, 2, 1, 1, 2, 0.5); });
  };
  auto pass = [](int m) { return Action{ActionType::vocab, m, 0}; };
  auto erase = [](std::vector<Action>& l, Action a) { l.erase(std::find(l.begin(), l.end(), a)); };
  EXPECT_EQ(replay_with([](auto&) {}), "");
  // Stage 0 without the pass of micro-batch 1: the last stage waits for it forever.
  EXPECT_NE(replay_with([&](auto& l) { erase(l[0], pass(1)); }).find("deadlock"), std::string::npos);
  // The last stage's backward of micro-batch 0 before its pass.
  EXPECT_NE(replay_with([&](auto& l) {
              erase(l[1], pass(0));
              l[1].insert(std::find(l[1].begin(), l[1].end(), Action{ActionType::backward, 0, 0}) + 1, pass(0));
            }).find("before its micro-batch's vocab pass"),
            std::string::npos);
  // The passes of stage 0 in the other order: the stages wait at different passes.
  EXPECT_NE(replay_with([&](auto& l) {
              auto a = std::find(l[0].begin(), l[0].end(), pass(0)), b = std::find(l[0].begin(), l[0].end(), pass(1));
              std::iter_swap(a, b);
            }).find("deadlock"),
            std::string::npos);
  // A pass at the very start of every list: before the last stage's forward of micro-batch 0.
  EXPECT_NE(replay_with([&](auto& l) {
              for (auto& list : l) erase(list, pass(0)), list.insert(list.begin(), pass(0));
            }).find("before the last virtual stage's forward"),
            std::string::npos);
  // The embedding pass of micro-batch 0 after the first stage's forward of it; its gradient pass first.
  const Action embed{ActionType::vocab_embed, 0, 0}, embed_grad{ActionType::vocab_embed_grad, 0, 0};
  EXPECT_NE(replay_with([&](auto& l) {
              for (auto& list : l) erase(list, embed), list.push_back(embed);
            }).find("before its micro-batch's vocab_embed pass"),
            std::string::npos);
  EXPECT_NE(replay_with([&](auto& l) {
              for (auto& list : l) erase(list, embed_grad), list.insert(list.begin(), embed_grad);
            }).find("before the first virtual stage's backward"),
            std::string::npos);
}

// One stage runs each micro-batch's forward and backward back to back whatever --pp-schedule says:
// GPipe's order on one stage (all forwards, then all backwards) only kept every micro-batch's
// activations at once, while the trainer said the option changed nothing.
TEST(Schedule, GpipeOnOneStageIsOneForwardOneBackward) {
  TrainOptions o;
  o.pp = 1, o.pp_schedule = "gpipe";
  EXPECT_EQ(o.schedule_kind(), ScheduleKind::one_f_one_b);
  o.pp = 2;
  EXPECT_EQ(o.schedule_kind(), ScheduleKind::gpipe);
}
