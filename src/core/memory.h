// Memory of the machine and of this process, and allocations that say what they were for.
// (What a run will need is computed in train/memory_plan.h; this file only measures and formats.)
#pragma once
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>

#include "core/error.h"

namespace origami {

// "512 B", "7.2 MiB", "2.1 TiB" (binary units).
std::string format_bytes(double bytes);

// Runs fn, which allocates about `bytes` for `purpose`; if it runs out of memory, throws one Error
// naming the size and the purpose instead of a bare std::bad_alloc.
template <typename Fn>
void allocating(const char* purpose, int64_t bytes, Fn&& fn) {
  try {
    fn();
  } catch (const std::bad_alloc&) {
    fail("out of memory: cannot allocate ", format_bytes(double(bytes)), " for ", purpose);
  } catch (const std::length_error&) {
    fail("cannot allocate ", format_bytes(double(bytes)), " for ", purpose, ": more than a buffer can hold");
  }
}

// Zero-filled memory of anonymous pages whose ranges can be given back to the operating system
// (the gradient buffers: ZeRO-2 keeps only its shard and the buckets in flight resident). A range
// released reads as zeros again and takes memory only where it is next written.
class ReleasablePages {
 public:
  ReleasablePages() = default;
  // `bytes` of zeros (at least one page is mapped); Error naming `purpose` when the mapping fails.
  ReleasablePages(int64_t bytes, const char* purpose);
  ReleasablePages(ReleasablePages&& o) noexcept;
  ReleasablePages& operator=(ReleasablePages&& o) noexcept;
  ~ReleasablePages();
  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  // Zeroes bytes [begin, end): whole pages inside the range are returned (madvise), the partial pages
  // at its ends are cleared (they hold bytes outside the range). Everything: release(0, bytes()).
  void release(int64_t begin, int64_t end);

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0, mapped_ = 0;
};

// This machine's host name (gethostname; "" when it has none).
std::string host_name();

// Resident set size of this process now (bytes).
int64_t resident_bytes();

// Memory this process may still take: MemAvailable (/proc/meminfo), lowered by the limits of its
// cgroup group and the group's ancestors where set: v2's memory.max − (memory.current −
// inactive_file), v1's memory.limit_in_bytes − (memory.usage_in_bytes − total_inactive_file), the
// memory controller mounted alone or with others. `source` says which bound applied. `root` prefixes
// /proc and /sys (a test's fake tree).
struct AvailableMemory {
  int64_t bytes = 0;
  std::string source;
};
AvailableMemory available_memory(const std::string& root = "");

}  // namespace origami
