#include "core/memory.h"

#include <cstdio>
#include <fstream>
#include <algorithm>
#include <climits>
#include <cstring>
#include <sstream>
#include <sys/mman.h>
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

ReleasablePages::ReleasablePages(int64_t bytes, const char* purpose) : bytes_(bytes), mapped_(std::max<int64_t>(1, bytes)) {
  void* p = mmap(nullptr, size_t(mapped_), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ORIGAMI_CHECK(p != MAP_FAILED, "out of memory: cannot allocate ", format_bytes(double(bytes)), " for ", purpose);
  data_ = p;
}

ReleasablePages::ReleasablePages(ReleasablePages&& o) noexcept : data_(o.data_), bytes_(o.bytes_), mapped_(o.mapped_) {
  o.data_ = nullptr, o.bytes_ = o.mapped_ = 0;
}

ReleasablePages& ReleasablePages::operator=(ReleasablePages&& o) noexcept {
  std::swap(data_, o.data_), std::swap(bytes_, o.bytes_), std::swap(mapped_, o.mapped_);
  return *this;
}

ReleasablePages::~ReleasablePages() {
  if (data_ != nullptr) munmap(data_, size_t(mapped_));
}

void ReleasablePages::release(int64_t begin, int64_t end) {
  ORIGAMI_ASSERT(0 <= begin && begin <= end && end <= bytes_);
  char* base = static_cast<char*>(data_);
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t first = (begin + page - 1) / page * page, last = end / page * page;  // whole pages: [first, last)
  if (first >= last || madvise(base + first, size_t(last - first), MADV_DONTNEED) != 0) {
    std::memset(base + begin, 0, size_t(end - begin));
    return;
  }
  std::memset(base + begin, 0, size_t(first - begin));
  std::memset(base + last, 0, size_t(end - last));
}

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * int64_t(sysconf(_SC_PAGESIZE));
}

namespace {

// A number from a one-line file (cgroup interface files); -1 when absent or "max".
int64_t read_number_file(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return -1;
  try {
    return std::stoll(s);
  } catch (const std::exception&) {
    return -1;
  }
}

// A "key value" line of a cgroup memory.stat file; 0 when absent.
int64_t read_stat(const std::string& path, const std::string& key) {
  std::ifstream f(path);
  std::string k;
  int64_t v = 0;
  while (f >> k >> v)
    if (k == key) return v;
  return 0;
}

}  // namespace

AvailableMemory available_memory(const std::string& root) {
  AvailableMemory out{-1, "MemAvailable"};
  std::ifstream f(root + "/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream is(line);
    std::string key;
    int64_t kib = 0;
    if (is >> key >> kib && key == "MemAvailable:") out.bytes = kib * 1024;
  }
  // Control groups (containers, batch schedulers): this process's group and each of its ancestors
  // may set a limit; what the group uses counts against it, less the file cache the kernel reclaims
  // first. cgroup v2: "0::/path" in /proc/self/cgroup, memory.max / memory.current / inactive_file;
  // v1 (below): memory.limit_in_bytes / memory.usage_in_bytes / total_inactive_file.
  auto lower_by_groups = [&](const std::string& mount, const std::string& group, const char* max_file,
                             const char* used_file, const char* inactive_key, const char* name) {
    for (std::string dir = mount + (group == "/" ? "" : group);;) {
      const int64_t max = read_number_file(dir + "/" + max_file), used = read_number_file(dir + "/" + used_file);
      if (max > 0 && max < (int64_t(1) << 60) && used >= 0) {
        const int64_t held = std::max<int64_t>(0, used - read_stat(dir + "/memory.stat", inactive_key));
        if (out.bytes < 0 || max - held < out.bytes) out = {std::max<int64_t>(0, max - held), name};
      }
      const size_t slash = dir.rfind('/');
      if (dir == mount || slash == std::string::npos) break;
      dir = dir.substr(0, slash);
    }
  };
  const std::string sys = root + "/sys/fs/cgroup";
  std::ifstream cg(root + "/proc/self/cgroup");
  while (std::getline(cg, line)) {
    if (line.rfind("0::", 0) == 0)
      lower_by_groups(sys, line.substr(3), "memory.max", "memory.current", "inactive_file",
                      "the cgroup's memory.max");
    // v1: "N:controllers:/path", the controllers comma-separated ("memory", or co-mounted as
    // "cpu,memory", whose hierarchy is mounted under that name and often linked as "memory" too).
    const size_t c0 = line.find(':'), c1 = c0 == std::string::npos ? c0 : line.find(':', c0 + 1);
    if (c1 == std::string::npos) continue;
    const std::string controllers = line.substr(c0 + 1, c1 - c0 - 1);
    if (("," + controllers + ",").find(",memory,") == std::string::npos) continue;
    std::string mount = sys + "/memory";
    if (!std::ifstream(mount + "/memory.limit_in_bytes")) mount = cat(sys, "/", controllers);
    const std::string group = line.substr(c1 + 1);
    // Inside a container the group's path is often not visible under the mount: use the mount's root.
    const bool visible = bool(std::ifstream(mount + group + "/memory.limit_in_bytes"));
    lower_by_groups(mount, visible ? group : std::string("/"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file",
                    "the cgroup's memory.limit_in_bytes");
  }
  if (out.bytes < 0) out = {INT64_MAX, "unknown"};
  return out;
}

}  // namespace origami
