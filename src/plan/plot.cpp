#include "plan/plot.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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

// One segment kind of the bars: its legend entry, colour and seconds in each row.
struct Part {
  std::string name, colour;
  std::vector<double> s;
};

// Paul Tol's qualitative colours (told apart with colour-blindness too): compute blue, bubble grey,
// then the communicators in turn.
constexpr const char* kComputeColour = "#4477AA";
constexpr const char* kBubbleColour = "#BBBBBB";
constexpr const char* kCommColours[] = {"#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#EE7733",
                                        "#009988", "#882255", "#999933", "#332288", "#44AA99", "#CC3311"};

// Control characters would end a line of the script or a field of its data: spaces instead.
std::string one_line(std::string s) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return s;
}

// A gnuplot single-quoted string: nothing is an escape in it but a doubled quote.
std::string quoted(const std::string& s) {
  std::string q = "'";
  for (char c : one_line(s)) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

// compute; bubble unless it is zero in every row; then each communicator with exposed time in some
// row, by name.
std::vector<Part> parts_of(const std::vector<PlotRow>& rows) {
  std::vector<Part> parts{{"compute", kComputeColour, {}}, {"bubble", kBubbleColour, {}}};
  std::map<std::string, size_t> axes;  // communicator -> its index in parts
  for (const PlotRow& r : rows)
    for (const auto& [axis, s] : r.exposed_s)
      if (s > 0) axes.emplace(axis, 0);
  size_t colour = 0;
  for (auto& [axis, index] : axes) {
    index = parts.size();
    parts.push_back({"exposed " + axis, kCommColours[colour++ % std::size(kCommColours)], {}});
  }
  for (const PlotRow& r : rows) {
    for (Part& p : parts) p.s.push_back(0);
    parts[0].s.back() = r.compute_s;
    parts[1].s.back() = r.bubble_s;
    for (const auto& [axis, s] : r.exposed_s)
      if (axes.count(axis)) parts[axes[axis]].s.back() = s;
  }
  if (std::all_of(parts[1].s.begin(), parts[1].s.end(), [](double s) { return s == 0; }))
    parts.erase(parts.begin() + 1);
  return parts;
}

// The gnuplot script, its data inline: per row the label, then where each part starts and ends along
// the bar (columns k + 2 and k + 3 for part k). Row i is drawn at y = i, the first at the top: its
// label above its bar, so that long layout names leave the whole width to the bars.
std::string script(const std::vector<PlotRow>& rows, const std::vector<Part>& parts, const std::string& title) {
  std::ostringstream s;
  s.precision(9);
  s << "$bars << EOD\n";
  double longest = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    double x = 0;
    s << one_line(rows[r].label) << '\t' << x;
    for (const Part& p : parts) s << '\t' << (x += p.s[r]);
    s << '\n';
    longest = std::max(longest, x);
  }
  s << "EOD\n";
  s << "set terminal pngcairo size 1200," << 160 + 60 * rows.size() << " font 'sans,11' noenhanced\n"  // text as typed
    << "set datafile separator '\\t'\n"
    << "set title " << quoted(title) << " font ',13'\n"
    << "set xlabel 'seconds per step'\n"
    << "set xrange [0:" << longest * 1.1 << "]\n"  // room for the totals right of the bars
    << "set xtics nomirror\n"
    << "set grid xtics\n"
    << "set yrange [" << rows.size() - 0.5 << ":-0.5]\n"
    << "unset ytics\n"
    << "set lmargin 3\n"
    << "set rmargin 3\n"
    << "set key outside bottom center horizontal Left reverse samplen 2 height 1\n"  // height: clear of the xlabel
    << "set style fill solid 1.0 noborder\n"
    << "plot";
  for (size_t k = 0; k < parts.size(); ++k)
    s << (k ? ", \\\n    " : " ") << "$bars using " << k + 2 << ":0:" << k + 2 << ":" << k + 3
      << ":($0-0.08):($0+0.4) with boxxyerror lc rgb '" << parts[k].colour << "' title " << quoted(parts[k].name);
  const size_t total = parts.size() + 2;
  s << ", \\\n    $bars using " << total << ":($0+0.16):(sprintf(' %.4g s', column(" << total
    << "))) with labels left notitle"
    << ", \\\n    $bars using (0):($0-0.28):1 with labels left offset 0.5,0 notitle\n";
  return s.str();
}

// The last non-empty line of a file ("" when there is none).
std::string last_line(const std::string& path) {
  std::istringstream in(read_file_bytes(path));
  std::string last;
  for (std::string line; std::getline(in, line);)
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  return last;
}

constexpr const char* kNoGnuplot = "--plot needs gnuplot (Debian: apt-get install gnuplot-nox; scripts/setup.sh installs it)";

// Runs `gnuplot SCRIPT` with its standard output (the PNG) to out_fd and its standard error to
// err_path; Error unless it exits 0. posix_spawnp: no shell, the arguments as they are.
void run_gnuplot(const std::string& script_path, int out_fd, const std::string& err_path) {
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
  ORIGAMI_CHECK(rc != ENOENT, kNoGnuplot);
  ORIGAMI_CHECK(rc == 0, "--plot: cannot run gnuplot (", std::strerror(rc), ")");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    ORIGAMI_CHECK(errno == EINTR, "--plot: waiting for gnuplot failed (", std::strerror(errno), ")");
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  const std::string why = last_line(err_path);
  fail("--plot: gnuplot failed: ", !why.empty()        ? why
                                   : WIFEXITED(status) ? cat("exit status ", WEXITSTATUS(status))
                                                       : cat("killed by signal ", WTERMSIG(status)));
}

// A new temporary directory, removed with its files when this goes out of scope.
struct TempDir {
  std::string path;
  TempDir() {
    std::string name = (std::filesystem::temp_directory_path() / "origami-plot-XXXXXX").string();
    ORIGAMI_CHECK(::mkdtemp(name.data()), "--plot: cannot create a temporary directory ", name, " (",
                  std::strerror(errno), ")");
    path = name;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace

void require_gnuplot() {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && ::access((dir + "/gnuplot").c_str(), X_OK) == 0) return;
  fail(kNoGnuplot);
}

void plot_step_breakdown(const std::vector<PlotRow>& rows, const std::string& title, const std::string& png_path) {
  ORIGAMI_ASSERT(!rows.empty());
  const TempDir dir;
  const std::string script_path = dir.path + "/plot.gp";
  write_file_atomically(script_path, script(rows, parts_of(rows), title));
  // Opened here, not by gnuplot: an unwritable place is reported as such, and the path never enters
  // the script.
  const std::string tmp = png_path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ORIGAMI_CHECK(fd >= 0, "--plot ", png_path, ": cannot write ", tmp, " (", std::strerror(errno),
                "); the directory must exist and be writable");
  try {
    run_gnuplot(script_path, fd, dir.path + "/stderr.txt");
    struct stat st {};
    ORIGAMI_CHECK(::fstat(fd, &st) == 0 && st.st_size > 0, "--plot: gnuplot exited 0 but wrote no image");
    // On disk before the rename, so that after a crash png_path is the old file or the whole new one.
    ORIGAMI_CHECK(::fsync(fd) == 0 || errno == EINVAL, tmp, ": write failed (", std::strerror(errno), ")");
  } catch (const Error&) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  rename_file(tmp, png_path);
  sync_dir(std::filesystem::path(png_path).parent_path().string());
}

}  // namespace origami
