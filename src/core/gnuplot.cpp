#include "core/gnuplot.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <sstream>

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/error.h"
#include "core/files.h"

extern char** environ;

namespace origami {
namespace {

// The last non-empty line of a file ("" when there is none).
std::string last_line(const std::string& path) {
  std::istringstream in(read_file_bytes(path));
  std::string last;
  for (std::string line; std::getline(in, line);)
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  return last;
}

std::string no_gnuplot(const std::string& who) {
  return who + " needs gnuplot (Debian: apt-get install gnuplot-nox; scripts/setup.sh installs it)";
}

// Runs `gnuplot SCRIPT` with its standard output (the PNG) to out_fd and its standard error to
// err_path; Error unless it exits 0. posix_spawnp: no shell, the arguments as they are.
void run_gnuplot(const std::string& script_path, int out_fd, const std::string& err_path, const std::string& who) {
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&files, out_fd, 1);
  posix_spawn_file_actions_addopen(&files, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  std::string program = "gnuplot", script_arg = script_path;
  char* argv[] = {program.data(), script_arg.data(), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, "gnuplot", &files, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&files);
  ORIGAMI_CHECK(rc != ENOENT, no_gnuplot(who));
  ORIGAMI_CHECK(rc == 0, who, ": cannot run gnuplot (", std::strerror(rc), ")");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    ORIGAMI_CHECK(errno == EINTR, who, ": waiting for gnuplot failed (", std::strerror(errno), ")");
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  const std::string why = last_line(err_path);
  fail(who, ": gnuplot failed: ", !why.empty()        ? why
                                  : WIFEXITED(status) ? cat("exit status ", WEXITSTATUS(status))
                                                      : cat("killed by signal ", WTERMSIG(status)));
}

// A new temporary directory, removed with its files when this goes out of scope.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& who) {
    std::string name = (std::filesystem::temp_directory_path() / "origami-plot-XXXXXX").string();
    ORIGAMI_CHECK(::mkdtemp(name.data()), who, ": cannot create a temporary directory ", name, " (",
                  std::strerror(errno), ")");
    path = name;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace

void require_gnuplot(const std::string& who) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && ::access((dir + "/gnuplot").c_str(), X_OK) == 0) return;
  fail(no_gnuplot(who));
}

void require_png_output(const std::string& png_path, const std::string& option, const std::string& what) {
  ORIGAMI_CHECK(png_path.ends_with(".png"), option, " '", png_path, "': ", what, " a PNG picture, so FILE.png");
  require_writable_file(png_path, option);
}

void render_png(const std::string& script, const std::string& png_path, const std::string& who) {
  const TempDir dir(who);
  const std::string script_path = dir.path + "/plot.gp";
  write_file_atomically(script_path, script);
  // Opened here, not by gnuplot: an unwritable place is reported as such, and the path never enters
  // the script.
  const std::string tmp = png_path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ORIGAMI_CHECK(fd >= 0, who, " ", png_path, ": cannot write ", tmp, " (", std::strerror(errno),
                "); the directory must exist and be writable");
  if (fd <= 2) {  // (standard input, output or error closed): gnuplot's own 0, 1 and 2 are set before its output
    const int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
    const int err = errno;
    ::close(fd);
    if (moved < 0) ::unlink(tmp.c_str());
    ORIGAMI_CHECK(moved >= 0, who, ": cannot move the output's descriptor (", std::strerror(err), ")");
    fd = moved;
  }
  try {
    run_gnuplot(script_path, fd, dir.path + "/stderr.txt", who);
    struct stat st {};
    ORIGAMI_CHECK(::fstat(fd, &st) == 0 && st.st_size > 0, who, ": gnuplot exited 0 but wrote no image");
    // On disk before the rename, so that after a crash png_path is the old file or the whole new one.
    ORIGAMI_CHECK(::fsync(fd) == 0 || errno == EINVAL, tmp, ": write failed (", std::strerror(errno), ")");
  } catch (const Error&) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  rename_or_remove(tmp, png_path);
  sync_dir(std::filesystem::path(png_path).parent_path().string());
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return s;
}

std::string gnuplot_quoted(const std::string& s) {
  std::string q = "'";
  for (char c : one_line(s)) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

const char* series_colour(size_t i) {
  static constexpr const char* kColours[] = {"#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377",
                                             "#EE7733", "#009988", "#882255", "#999933", "#332288", "#44AA99"};
  return kColours[i % std::size(kColours)];
}

}  // namespace origami
