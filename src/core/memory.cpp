#include "core/memory.h"

#include <cstdio>
#include <fstream>
#include <algorithm>
#include <climits>
#include <sstream>
#include <sys/resource.h>
#include <unistd.h>

namespace origami {

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) bytes /= 1024, ++u;
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  else std::snprintf(buf, sizeof buf, bytes < 10 ? "%.2f %s" : bytes < 100 ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * int64_t(sysconf(_SC_PAGESIZE));
}

int64_t peak_resident_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return int64_t(u.ru_maxrss) * 1024;  // Linux reports kilobytes
}

namespace {

// A number from a one-line file (cgroup interface files); -1 when absent or "max".
int64_t read_number_file(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return -1;
  try {
    return std::stoll(s);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

AvailableMemory available_memory() {
  AvailableMemory out{-1, "MemAvailable"};
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream is(line);
    std::string key;
    int64_t kib = 0;
    if (is >> key >> kib && key == "MemAvailable:") out.bytes = kib * 1024;
  }
  // cgroup v2 (containers, batch schedulers): the limit of this process's group.
  const int64_t max = read_number_file("/sys/fs/cgroup/memory.max");
  const int64_t current = read_number_file("/sys/fs/cgroup/memory.current");
  if (max > 0 && current >= 0 && (out.bytes < 0 || max - current < out.bytes))
    out = {std::max<int64_t>(0, max - current), "the cgroup's memory.max"};
  if (out.bytes < 0) out = {INT64_MAX, "unknown"};
  return out;
}

}  // namespace origami
