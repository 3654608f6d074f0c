// ReleasablePages (core/memory.h), the gradient buffers' memory: release(begin, end) zeroes exactly
// the bytes [begin, end) — whole pages returned, the partial pages at both ends cleared by hand — and
// leaves every byte outside the range as it was (ZeRO-2 returns a bucket's pages around its shard,
// while the neighbouring buckets and the shard hold live gradients); the returned pages leave the
// process's resident memory and read as zeros.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

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

}  // namespace
}  // namespace origami
