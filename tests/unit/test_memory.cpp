// ReleasablePages (core/memory.h), the gradient buffers' memory: release(begin, end) zeroes exactly
// the bytes [begin, end) — whole pages returned, the partial pages at both ends cleared by hand — and
// leaves every byte outside the range as it was (ZeRO-2 returns a bucket's pages around its shard,
// while the neighbouring buckets and the shard hold live gradients); the returned pages leave the
// process's resident memory and read as zeros. available_memory() reads its limits off fake /proc
// and /sys trees.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/memory.h"

namespace origami {
namespace {

TEST(ReleasablePages, ReleaseZeroesExactlyTheRange) {
  const int64_t page = sysconf(_SC_PAGESIZE), bytes = 6 * page + 123;
  ReleasablePages pages(bytes, "a test buffer");
  unsigned char* p = static_cast<unsigned char*>(pages.data());
  for (int64_t i = 0; i < bytes; ++i) EXPECT_EQ(p[i], 0) << "new memory must read as zeros";
  // Ranges: inside one page, across one page boundary, over whole pages with partial ends, up to the
  // end of the buffer, empty.
  const int64_t cases[][2] = {{10, 50}, {page - 7, page + 9}, {page / 2, 4 * page + 77}, {5 * page + 3, bytes},
                              {3 * page, 3 * page}, {0, bytes}};
  for (const auto& c : cases) {
    for (int64_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(1 + i % 251);
    pages.release(c[0], c[1]);
    int64_t wrong_inside = 0, wrong_outside = 0;
    for (int64_t i = 0; i < bytes; ++i) {
      if (i >= c[0] && i < c[1]) wrong_inside += p[i] != 0;
      else wrong_outside += p[i] != static_cast<unsigned char>(1 + i % 251);
    }
    EXPECT_EQ(wrong_inside, 0) << "bytes of [" << c[0] << ", " << c[1] << ") not zeroed";
    EXPECT_EQ(wrong_outside, 0) << "bytes outside [" << c[0] << ", " << c[1] << ") changed";
  }
}

TEST(ReleasablePages, ReleasedPagesLeaveTheResidentSet) {
  const int64_t mib = 1 << 20;
  ReleasablePages pages(64 * mib, "a test buffer");
  std::memset(pages.data(), 1, size_t(64 * mib));
  const int64_t touched = resident_bytes();
  pages.release(8 * mib + 1, 56 * mib - 1);  // 48 MiB less two partial pages
  const int64_t released = touched - resident_bytes();
  EXPECT_GE(released, 47 * mib) << "resident " << touched << " -> " << touched - released << " bytes";
  pages.release(0, pages.bytes());
  EXPECT_GE(touched - resident_bytes(), 63 * mib);
}

TEST(ReleasablePages, MovedFromOwnsNothing) {
  ReleasablePages a(4096, "a test buffer");
  void* p = a.data();
  ReleasablePages b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.bytes(), 4096);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.bytes(), 0);
}

// available_memory() on fake /proc and /sys trees: the tightest of MemAvailable and each limit of the
// process's memory group and its ancestors, less what the group holds beyond reclaimable file cache;
// cgroup v1's memory controller found both mounted alone and co-mounted with another ("cpu,memory").
class FakeRoot {
 public:
  FakeRoot() : dir_(std::filesystem::temp_directory_path() / ("origami_mem_" + std::to_string(getpid()))) {
    std::filesystem::remove_all(dir_);
    write("proc/meminfo", "MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n");  // 4 GiB available
  }
  ~FakeRoot() { std::filesystem::remove_all(dir_); }
  void write(const std::string& path, const std::string& text) {
    std::filesystem::create_directories((dir_ / path).parent_path());
    std::ofstream(dir_ / path) << text;
  }
  std::string root() const { return dir_.string(); }

 private:
  std::filesystem::path dir_;
};

constexpr int64_t MiB = int64_t(1) << 20;

TEST(AvailableMemory, MemAvailableWithoutGroups) {
  FakeRoot fake;
  const AvailableMemory m = available_memory(fake.root());
  EXPECT_EQ(m.bytes, 4096 * MiB);
  EXPECT_EQ(m.source, "MemAvailable");
}

TEST(AvailableMemory, CgroupV2GroupAndAncestor) {
  FakeRoot fake;
  fake.write("proc/self/cgroup", "0::/job/step\n");
  fake.write("sys/fs/cgroup/job/memory.max", std::to_string(3072 * MiB));  // parent: 3 GiB, 1 GiB held
  fake.write("sys/fs/cgroup/job/memory.current", std::to_string(1024 * MiB));
  fake.write("sys/fs/cgroup/job/step/memory.max", "max");
  fake.write("sys/fs/cgroup/job/step/memory.current", std::to_string(512 * MiB));
  AvailableMemory m = available_memory(fake.root());
  EXPECT_EQ(m.bytes, 2048 * MiB);
  EXPECT_EQ(m.source, "the cgroup's memory.max");
  // The group's own limit, with reclaimable file cache not counted as held.
  fake.write("sys/fs/cgroup/job/step/memory.max", std::to_string(1024 * MiB));
  fake.write("sys/fs/cgroup/job/step/memory.stat", "anon 1\ninactive_file " + std::to_string(256 * MiB) + "\n");
  m = available_memory(fake.root());
  EXPECT_EQ(m.bytes, 768 * MiB);
}

TEST(AvailableMemory, CgroupV1AloneAndCoMounted) {
  for (const std::string controllers : {"memory", "cpu,memory"}) {
    FakeRoot fake;
    fake.write("proc/self/cgroup", "7:pids:/job\n4:" + controllers + ":/job\n1:name=systemd:/job\n");
    const std::string group = "sys/fs/cgroup/" + controllers;
    fake.write(group + "/memory.limit_in_bytes", "9223372036854771712");  // the root: no limit
    fake.write(group + "/memory.usage_in_bytes", std::to_string(6000 * MiB));
    fake.write(group + "/job/memory.limit_in_bytes", std::to_string(1536 * MiB));
    fake.write(group + "/job/memory.usage_in_bytes", std::to_string(1024 * MiB));
    fake.write(group + "/job/memory.stat", "cache 9\ntotal_inactive_file " + std::to_string(512 * MiB) + "\n");
    const AvailableMemory m = available_memory(fake.root());
    EXPECT_EQ(m.bytes, 1024 * MiB) << controllers;
    EXPECT_EQ(m.source, "the cgroup's memory.limit_in_bytes") << controllers;
  }
}

}  // namespace
}  // namespace origami
