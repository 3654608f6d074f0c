// origami launch (train/launch.h): which hostfile slots a failure takes away (--shrink), and which
// processes the watchdog may kill (a rank's pid only while its process is still the rank).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/progress.h"
#include "model/config.h"
#include "train/launch.h"
#include "train/memory_plan.h"

namespace origami {
namespace {

TEST(Launch, SameHostByNameShortNameOrAddress) {
  EXPECT_TRUE(same_host("node3", "node3"));
  EXPECT_TRUE(same_host("node3", "node3.cluster.local"));   // mpirun's short name, the hostfile's full one
  EXPECT_TRUE(same_host("node3.cluster.local", "node3"));
  EXPECT_FALSE(same_host("node3", "node30.cluster.local"));  // a prefix of the first label is another host
  EXPECT_FALSE(same_host("node3.a.invalid", "node3.b.invalid"));  // two full names, neither resolving
  EXPECT_TRUE(same_host("localhost", "127.0.0.1"));          // by address
}

TEST(Launch, FailedHostsLeaveTheHostfile) {
  Slots s;
  s.hosts = {{"node1.cluster.local", 4}, {"node2.cluster.local", 4}, {"node3.cluster.local", 4}};
  EXPECT_TRUE(drop_failed_slots(s, {5, 6}, {"node2", "node2"}).empty());  // two ranks of one host, by its short name
  ASSERT_EQ(s.hosts.size(), 2u);
  EXPECT_EQ(s.hosts[0].first, "node1.cluster.local");
  EXPECT_EQ(s.hosts[1].first, "node3.cluster.local");
  EXPECT_EQ(s.total(), 8);
  // A host the hostfile does not name is returned (its slots stay), and so is "" for a rank that named no
  // host (it hung before its progress record): it blames none.
  EXPECT_EQ(drop_failed_slots(s, {0, 1}, {"node9", ""}), (std::vector<std::string>{"node9", ""}));
  EXPECT_EQ(s.total(), 8);
  // A host on several lines leaves with all of them; a second spelling of it is no unknown host.
  Slots lines;
  lines.hosts = {{"node2", 1}, {"node2", 1}, {"node3", 1}, {"node3", 1}};
  EXPECT_TRUE(drop_failed_slots(lines, {1, 2}, {"node2", "node2.cluster.local"}).empty());
  ASSERT_EQ(lines.hosts.size(), 2u);
  EXPECT_EQ(lines.hosts[0].first, "node3");
  Slots anonymous;
  anonymous.anonymous = 4;
  drop_failed_slots(anonymous, {}, {});  // a death mpirun named no rank of: one slot
  EXPECT_EQ(anonymous.total(), 3);
  drop_failed_slots(anonymous, {0, 2}, {"x", "x"});
  EXPECT_EQ(anonymous.total(), 1);
}

// A rank's pid on the progress board names its process only while the rank lives: the watchdog
// kills a pid only while that process's start time is the one the rank recorded (still_running).
TEST(Launch, KillsOnlyProcessesThatAreStillTheRanks) {
  auto start_sleep = [] {
    std::vector<std::string> argv_text{"sleep", "30"};
    std::vector<char*> argv;
    for (auto& a : argv_text) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    EXPECT_EQ(posix_spawnp(&pid, "sleep", nullptr, nullptr, argv.data(), environ), 0);
    return pid;
  };
  auto end = [](pid_t pid) {
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
  };
  const pid_t rank = start_sleep(), other = start_sleep();
  RankProgress r;
  r.pid = rank, r.start = process_start(rank);
  ASSERT_GT(r.start, 0);
  EXPECT_TRUE(still_running(r));
  RankProgress reused = r;  // the rank's record, its pid now another process's (a later start)
  reused.pid = other, reused.start = process_start(other) - 1;
  EXPECT_FALSE(still_running(reused));
  end(rank);
  EXPECT_FALSE(still_running(r));  // gone (reaped): its pid is free for another
  RankProgress unknown;  // a rank that could not read its start: not told from another
  unknown.pid = other;
  EXPECT_TRUE(still_running(unknown));
  end(other);
}

// --shrink weighs a world as train's memory check would: under --memory-limit-gb each rank against it
// (it compared the node's ranks with the node's memory), and with the run's routing options (it
// priced a capacity-bounded MoE as dropless, up to EP times the experts' rows).
TEST(Launch, ShrinkWeighsAWorldAsTrainsMemoryCheck) {
  const ModelConfig cfg = load_model_config(std::string(ORIGAMI_SOURCE_DIR) + "/tests/parallel/configs/mixtral_8e.json");
  TrainOptions o;
  o.data = "launch";
  o.micro_batch = 64, o.seq_len = 64, o.ep = 2, o.moe_capacity_factor = 1.0;
  const Plan plan = make_plan(cfg, o, 2);
  const int64_t need = rank_memory(plan.model, plan.options, 2, 0, 0, 0).total();
  ASSERT_GT(rank_memory(cfg, plan.options, 2, 0, 0, 0).total(), need + (4 << 20));  // dropless would need more
  const Slots here;  // no hostfile: both ranks on this node
  EXPECT_EQ(memory_shortfall(plan, 2, here, 2 * need + (1 << 20), {}), "");
  EXPECT_NE(memory_shortfall(plan, 2, here, 2 * need - (1 << 20), {}), "");
  // What the failed job's ranks measured (runtime, samplers) counts on every rank, as in train's check.
  const MeasuredMemory measured{int64_t(3) << 20, int64_t(1) << 20};
  EXPECT_EQ(rank_memory(plan.model, plan.options, 2, 0, measured.runtime, measured.sampler).total(),
            need + (int64_t(4) << 20));
  EXPECT_NE(memory_shortfall(plan, 2, here, 2 * need + (1 << 20), measured), "");
  EXPECT_EQ(memory_shortfall(plan, 2, here, 2 * need + (9 << 20), measured), "");
  Plan limited = plan;
  limited.options.memory_limit_gb = double(need) / double(1 << 30) * 0.9;  // under one rank's need
  const std::string why = memory_shortfall(limited, 2, here, int64_t(1) << 50, {});
  EXPECT_NE(why.find("more than --memory-limit-gb"), std::string::npos) << why;
  limited.options.memory_limit_gb = double(need) / double(1 << 30) * 1.1;
  EXPECT_EQ(memory_shortfall(limited, 2, here, 1, {}), "");  // the limit, not the node's memory
}

// A rank joining the board records its pid and start time, and later its memory check's measured parts,
// which the launcher reads back.
TEST(Launch, ARankRecordsItsStart) {
  const std::string dir = ::testing::TempDir() + "origami_progress_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  ::setenv("ORIGAMI_PROGRESS_DIR", dir.c_str(), 1);
  progress_join(0);
  ::unsetenv("ORIGAMI_PROGRESS_DIR");
  EXPECT_EQ(read_progress(dir, 1)[0].runtime, 0);  // (no memory check yet)
  progress_memory(123 << 20, 5 << 20);  // what the memory check measured, for --shrink
  const std::vector<RankProgress> board = read_progress(dir, 1);
  ASSERT_EQ(board.size(), 1u);
  EXPECT_EQ(board[0].pid, getpid());
  EXPECT_EQ(board[0].start, process_start(getpid()));
  EXPECT_EQ(board[0].runtime, 123 << 20);
  EXPECT_EQ(board[0].sampler, 5 << 20);
  EXPECT_TRUE(still_running(board[0]));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace origami
