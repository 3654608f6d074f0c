#include "core/progress.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/memory.h"

namespace origami {

namespace {

// One rank's record, at the start of its file.
struct Record {
  uint64_t magic;
  int64_t pid, step, start;
  int64_t runtime, sampler;
  uint64_t beats;
  char host[64];
  char entered[96];
};
constexpr uint64_t kMagic = 0x6f72696761'6d6933ull;  // "origami3"

Record* mine = nullptr;

std::string record_path(const std::string& dir, int rank) { return dir + "/rank." + std::to_string(rank); }

void copy_text(char* dst, size_t size, const std::string& s) {
  const size_t n = std::min(size - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

}  // namespace

void progress_join(int world_rank) {
  const char* dir = std::getenv("ORIGAMI_PROGRESS_DIR");
  if (!dir || !*dir) return;
  const std::string path = record_path(dir, world_rank);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ORIGAMI_CHECK(fd >= 0, "cannot write the progress record '", path, "' (", std::strerror(errno), ")");
  const bool sized = ::ftruncate(fd, sizeof(Record)) == 0;
  void* p = sized ? ::mmap(nullptr, sizeof(Record), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  ORIGAMI_CHECK(p != MAP_FAILED, "cannot map the progress record '", path, "' (", std::strerror(errno), ")");
  mine = static_cast<Record*>(p);
  mine->pid = ::getpid();
  mine->start = process_start(mine->pid);
  mine->step = 0;
  copy_text(mine->host, sizeof mine->host, host_name());
  copy_text(mine->entered, sizeof mine->entered, "start-up");
  mine->beats = 1;
  mine->magic = kMagic;
}

// (atomic: a checkpoint's writer thread beats beside the main thread)
void beat() { __atomic_fetch_add(&mine->beats, 1, __ATOMIC_RELAXED); }

void progress_step_done(int64_t step) {
  if (!mine) return;
  mine->step = step;
  beat();
}

void progress_memory(int64_t runtime_bytes, int64_t sampler_bytes) {
  if (!mine) return;
  mine->runtime = runtime_bytes, mine->sampler = sampler_bytes;
  beat();
}

void progress_alive() {
  if (mine) beat();
}

void progress_entered(const char* what, const std::string& group) {
  if (!mine) return;
  char text[sizeof mine->entered];
  std::snprintf(text, sizeof text, "%s on %s", what, group.c_str());
  std::memcpy(mine->entered, text, sizeof text);
  beat();
}

std::vector<RankProgress> read_progress(const std::string& dir, int world) {
  std::vector<RankProgress> out(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const int fd = ::open(record_path(dir, r).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    Record rec{};
    const bool whole = ::pread(fd, &rec, sizeof rec, 0) == ssize_t(sizeof rec);
    ::close(fd);
    if (!whole || rec.magic != kMagic) continue;
    rec.host[sizeof rec.host - 1] = rec.entered[sizeof rec.entered - 1] = '\0';
    out[size_t(r)] = {rec.pid, rec.step, rec.start, rec.runtime, rec.sampler, rec.beats, rec.host, rec.entered};
  }
  return out;
}

int64_t process_start(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(f, text)) return -1;
  const size_t paren = text.rfind(')');  // (the command name before it may hold spaces and parentheses)
  if (paren == std::string::npos) return -1;
  std::istringstream fields(text.substr(paren + 1));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i)  // fields 3 (state) .. 22 (starttime)
    if (i == 22) return std::strtoll(field.c_str(), nullptr, 10);
  return -1;
}

bool still_running(const RankProgress& r) { return r.start < 0 || process_start(r.pid) == r.start; }

}  // namespace origami
