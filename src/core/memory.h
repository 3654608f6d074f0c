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

// This machine's host name (gethostname; "" when it has none).
std::string host_name();

// Resident set size of this process now (bytes).
int64_t resident_bytes();

// Memory this process may still take: MemAvailable (/proc/meminfo), lowered by the limits of its
// cgroup v2 group and the group's ancestors (memory.max − (memory.current − inactive_file)) where
// set. `source` says which bound applied.
struct AvailableMemory {
  int64_t bytes = 0;
  std::string source;
};
AvailableMemory available_memory();

}  // namespace origami
