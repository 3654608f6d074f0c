// origami launch (train/launch.h): which hostfile slots a failure takes away (--shrink), and which
// processes the watchdog may kill.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "train/launch.h"

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

// A rank's pid on the progress board names the job's process only while the rank lives: the
// watchdog kills a pid only when that process's environment names the job's progress directory.
TEST(Launch, KillsOnlyTheJobsProcesses) {
  auto start_sleep = [](std::vector<std::string> env_text) {
    std::vector<std::string> argv_text{"sleep", "30"};
    std::vector<char*> argv, env;
    for (auto& a : argv_text) argv.push_back(a.data());
    for (auto& e : env_text) env.push_back(e.data());
    argv.push_back(nullptr), env.push_back(nullptr);
    pid_t pid = 0;
    EXPECT_EQ(posix_spawnp(&pid, "sleep", nullptr, nullptr, argv.data(), env.data()), 0);
    return pid;
  };
  auto end = [](pid_t pid) {
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
  };
  const pid_t rank = start_sleep({"PATH=/usr/bin:/bin", "ORIGAMI_PROGRESS_DIR=/tmp/job.progress"});
  const pid_t other = start_sleep({"PATH=/usr/bin:/bin", "ORIGAMI_PROGRESS_DIR=/tmp/job.progress.old"});
  // (posix_spawn returns while exec still builds the new stack, whose environment reads empty until
  // then: wait until each shows its own)
  auto shows = [](pid_t pid, const std::string& dir) {
    for (int i = 0; i < 1000 && !is_job_process(pid, dir); ++i) usleep(1000);
    return is_job_process(pid, dir);
  };
  ASSERT_TRUE(shows(rank, "/tmp/job.progress"));
  ASSERT_TRUE(shows(other, "/tmp/job.progress.old"));
  EXPECT_FALSE(is_job_process(rank, "/tmp/job"));  // the whole value, not a prefix
  EXPECT_FALSE(is_job_process(other, "/tmp/job.progress"));
  end(rank), end(other);
  EXPECT_FALSE(is_job_process(rank, "/tmp/job.progress"));  // gone (reaped): its pid is free for another
}

}  // namespace
}  // namespace origami
