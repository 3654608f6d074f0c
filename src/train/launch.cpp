#include "train/launch.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/files.h"
#include "core/memory.h"
#include "core/progress.h"
#include "core/timer.h"
#include "kernels/cpu/gemm.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "train/memory_plan.h"
#include "train/metrics.h"
#include "train/plan.h"

extern char** environ;

namespace origami {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
// Seconds on the steady clock, for the launcher's own waits (a step of the wall clock, NTP's, does not
// stretch or cut a backoff or the SIGKILL that follows a kill); events keep unix_time_s.
double steady_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

// --events: one JSON object per line (appended, flushed), each with its wall-clock time.
class Events {
 public:
  explicit Events(const std::string& path) : path_(path) {
    if (!path.empty()) file_ = MetricsFile(path, true, "--events file");
  }
  // A failed write (a full disk) warns once and ends the log, not the launch: the job's outcome does
  // not depend on it.
  void write(nlohmann::json e) {
    if (!file_) return;
    e["time"] = unix_time_s();
    if (file_.write(e)) return;
    std::fprintf(stderr, "origami launch: warning: writing the --events file '%s' failed; no more events are written\n",
                 path_.c_str());
    file_ = MetricsFile();
  }

 private:
  std::string path_;
  MetricsFile file_;
};

// The fewest steps any rank on the board has completed (-1: none has joined).
int64_t fewest_steps(const std::vector<RankProgress>& board) {
  int64_t fewest = -1;
  for (const RankProgress& r : board)
    if (r.pid > 0) fewest = fewest < 0 ? r.step : std::min(fewest, r.step);
  return fewest;
}

// A hostfile line's "slots=N" (Open MPI's word): N a whole number in [1, 2^20], digits only. (It had
// been read with atoi: "slots=4x" gave 4 silently, "slots=x" "no slots", and a number past int's range
// whatever the overflow left.)
int hostfile_slots(const std::string& word, const std::string& path, const std::string& host) {
  constexpr int64_t kMostSlots = int64_t(1) << 20;
  const std::string n = word.substr(6);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), v);
  ORIGAMI_CHECK(!n.empty() && n[0] != '-' && ec == std::errc() && end == n.data() + n.size() && v >= 1 && v <= kMostSlots,
                "--hostfile ", path, ": host ", host, ": '", word, "' needs a whole number of slots in [1, ", kMostSlots,
                "]");
  return int(v);
}

Slots read_hostfile(const std::string& path, int np) {
  Slots s;
  if (path.empty()) {
    s.anonymous = np;
    return s;
  }
  std::istringstream in(read_file_bytes(path));
  for (std::string line; std::getline(in, line);) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string host, word;
    if (!(words >> host)) continue;
    int slots = 1;
    while (words >> word)
      if (word.rfind("slots=", 0) == 0) slots = hostfile_slots(word, path, host);
    s.hosts.emplace_back(host, slots);
  }
  ORIGAMI_CHECK(!s.hosts.empty(), "--hostfile ", path, " names no host");
  return s;
}

// How one job ended.
struct JobEnd {
  int code = 0;           // mpirun's exit code (128 + signal when it was killed)
  bool hung = false;      // the watchdog ended it
  std::string why;        // in words
  std::vector<int> failed_ranks;
  std::vector<std::string> failed_hosts;
  int signal = 0;         // the signal that ended a failed rank (0: it exited)
  int64_t steps_done = 0; // the fewest steps any rank had completed
  double detected = 0;    // hung: when the watchdog saw it (Unix time)
  bool stopped = false;   // the launcher got SIGINT or SIGTERM and passed it on to the job
  bool user_error = false;  // the output has train's error line ("origami train: error: ...")
  bool ran = false;         // a rank joined the progress board (mpirun started the job)
  MeasuredMemory measured;  // the most the ranks' memory checks recorded (0: none reached it)
};

// SIGINT / SIGTERM to the launcher: the count received, which run_job passes on to mpirun (the first
// as SIGTERM, so every rank finishes its step, saves and exits 130; a second as SIGKILL).
volatile std::sig_atomic_t stop_requests = 0;
extern "C" void count_stop_request(int) { stop_requests = stop_requests + 1; }


// The watchdog's clock: when the board last changed, and the steps' durations seen so far.
class Watchdog {
 public:
  explicit Watchdog(double fixed) : fixed_(fixed), changed_(Clock::now()), step_at_(Clock::now()) {}
  // Takes a look at the board; true when nothing changed for longer than the timeout.
  bool stalled(const std::vector<RankProgress>& board) {
    std::vector<uint64_t> beats;
    for (const RankProgress& r : board) beats.push_back(r.beats);
    const int64_t fewest = fewest_steps(board);
    if (beats != beats_) beats_ = beats, changed_ = Clock::now();
    if (fewest > step_) {  // the job's step advanced: time it (the first one includes start-up)
      if (step_ >= 1) step_s_.push_back(since(step_at_) / double(fewest - step_));
      step_ = fewest, step_at_ = Clock::now();
    }
    return since(changed_) > timeout();
  }
  // --step-timeout S from every rank's first step on; until then (MPI's start-up on many nodes, the
  // data, the warm-up's timings, a load: no steps to pace them) at least 600 s, as in auto mode.
  double timeout() const {
    if (fixed_ > 0) return step_ > 0 ? fixed_ : std::max(fixed_, 600.0);
    if (step_s_.size() < 3) return 600;
    std::vector<double> s = step_s_;
    std::nth_element(s.begin(), s.begin() + long(s.size() / 2), s.end());
    return std::max(60.0, 10 * s[s.size() / 2]);
  }

 private:
  double fixed_;
  std::vector<uint64_t> beats_;
  Clock::time_point changed_, step_at_;
  int64_t step_ = -1;
  std::vector<double> step_s_;
};

bool stopped(int64_t pid) {  // the process is stopped (SIGSTOP, a debugger): state T in /proc/PID/stat
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && (text[close + 2] == 'T' || text[close + 2] == 't');
}

// The ranks of a hung job that did not arrive: those with the fewest completed steps; among them,
// those whose last collective differs from the one a majority of ranks entered (the others wait in
// it), or else the stopped ones.
std::vector<int> did_not_arrive(const std::vector<RankProgress>& board) {
  std::vector<int> behind;
  int64_t fewest = INT64_MAX;
  for (const RankProgress& r : board) fewest = std::min(fewest, r.step);
  std::map<std::string, int> votes;
  for (size_t i = 0; i < board.size(); ++i) {
    if (board[i].step == fewest) behind.push_back(int(i));
    ++votes[board[i].entered];
  }
  const auto top = std::max_element(votes.begin(), votes.end(), [](auto& a, auto& b) { return a.second < b.second; });
  const std::string common = 2 * size_t(top->second) > board.size() ? top->first : std::string("\x01none");
  for (auto pick : {+[](const RankProgress& r, const std::string& c) { return c != "\x01none" && r.entered != c; },
                    +[](const RankProgress& r, const std::string&) { return r.pid > 0 && stopped(r.pid); }}) {
    std::vector<int> some;
    for (int r : behind)
      if (pick(board[size_t(r)], common)) some.push_back(r);
    if (!some.empty() && some.size() < board.size()) return some;
  }
  return behind;
}

// Open MPI's report of a rank that died, anywhere in a line:
// "mpirun noticed that process rank R with PID P on node H exited on signal S (...)".
struct RankDeath {
  int rank = 0, signal = 0;
  std::string host;
};

// Reads the decimal digits at line[at] (1 to 9 of them: no sign, no overflow) into value, moving at past them.
bool read_count(const std::string& line, size_t& at, int& value) {
  size_t end = at;
  while (end < line.size() && std::isdigit(static_cast<unsigned char>(line[end]))) ++end;
  if (end == at || end - at > 9) return false;
  std::from_chars(line.data() + at, line.data() + end, value);
  at = end;
  return true;
}

// The report in line, if it holds one (H is a host name: no spaces).
std::optional<RankDeath> parse_rank_death(const std::string& line) {
  static const std::string lead = "process rank ";
  for (size_t start = line.find(lead); start != std::string::npos; start = line.find(lead, start + 1)) {
    size_t at = start + lead.size();
    auto word = [&](const char* w) {
      const size_t n = std::strlen(w);
      if (line.compare(at, n, w) != 0) return false;
      at += n;
      return true;
    };
    RankDeath d;
    int pid = 0;
    if (!read_count(line, at, d.rank) || !word(" with PID ") || !read_count(line, at, pid) || !word(" on node "))
      continue;
    const size_t host_end = line.find(' ', at);
    if (host_end == std::string::npos || host_end == at) continue;
    d.host = line.substr(at, host_end - at);
    at = host_end;
    if (word(" exited on signal ") && read_count(line, at, d.signal)) return d;
  }
  return std::nullopt;
}

// Forwards the job's output and finds Open MPI's reports of ranks that died (until the watchdog
// ends a hung job: then the ranks it killed are reported by it, not as failures).
class OutputScanner {
 public:
  void feed(const char* data, size_t n, JobEnd& end) {
    std::fwrite(data, 1, n, stdout);  // (output that cannot be shown is still read for the reports)
    std::fflush(stdout);
    pending_.append(data, n);
    for (size_t nl; (nl = pending_.find('\n')) != std::string::npos; pending_.erase(0, nl + 1)) {
      // Once the watchdog ended the job, the ranks it killed itself are no failures to report.
      if (end.hung) continue;
      const std::string line = pending_.substr(0, nl);
      if (line.find("origami train: error: ") != std::string::npos) end.user_error = true;  // (--tag-output prefixes it)
      if (const auto died = parse_rank_death(line)) {
        end.failed_ranks.push_back(died->rank);
        end.failed_hosts.push_back(died->host);
        end.signal = died->signal;
      }
    }
  }

 private:
  std::string pending_;
};

// Starts argv with its standard output and error into a pipe (returned through out_fd) and
// ORIGAMI_PROGRESS_DIR set.
pid_t spawn_job(const std::vector<std::string>& argv, const std::string& progress_dir, int* out_fd) {
  int fds[2];
  ORIGAMI_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "launch: pipe failed (", std::strerror(errno), ")");
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&files, fds[1], 1);
  posix_spawn_file_actions_adddup2(&files, fds[1], 2);
  std::vector<std::string> env_text{"ORIGAMI_PROGRESS_DIR=" + progress_dir};
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "ORIGAMI_PROGRESS_DIR=", 21) != 0) env_text.emplace_back(*e);
  std::vector<char*> args, env;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  for (const std::string& e : env_text) env.push_back(const_cast<char*>(e.c_str()));
  args.push_back(nullptr), env.push_back(nullptr);
  // A process group of its own: a terminal's Ctrl-C then reaches the launcher alone, which asks the
  // ranks to save and stop (ask_to_stop); mpirun, sent it too, would kill them a second later.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &files, &attr, args.data(), env.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&files);
  ::close(fds[1]);
  if (rc != 0) ::close(fds[0]);
  ORIGAMI_CHECK(rc == 0, "launch: cannot run '", argv[0], "' (", std::strerror(rc), "); give --mpirun");
  *out_fd = fds[0];
  return pid;
}

// Ends a hung job: every rank on the board that runs on this host and still runs (a pid names a
// process of its own host only; mpirun ends the others), then mpirun.
void kill_job(pid_t mpirun, const std::vector<RankProgress>& board) {
  const std::string here = host_name();
  for (const RankProgress& r : board)
    if (r.pid > 0 && r.host == here && still_running(r)) ::kill(pid_t(r.pid), SIGKILL);
  ::kill(mpirun, SIGTERM);
}

// Asks a job to save and stop: SIGTERM to this host's ranks that have finished a step (their stop
// signals are taken by then: core/stop_signals.h), which combine the request in the step's all-reduce,
// so every rank of every host stops after the same step and saves. Not through mpirun: Open MPI 4's
// mpirun passes it on and kills the ranks odls_base_sigkill_timeout (1 s) later, mid-step or mid-save.
// With no such rank here (none finished a step yet: nothing to save), mpirun itself.
void ask_to_stop(pid_t mpirun, const std::vector<RankProgress>& board) {
  const std::string here = host_name();
  int asked = 0;
  for (const RankProgress& r : board)
    if (r.pid > 0 && r.step > 0 && r.host == here && still_running(r)) asked += ::kill(pid_t(r.pid), SIGTERM) == 0;
  if (asked == 0) ::kill(mpirun, SIGTERM);
}

std::string hang_words(const std::vector<RankProgress>& board, const std::vector<int>& ranks, double timeout) {
  std::string s = cat("no progress for ", timeout, " s; did not arrive:");
  for (int r : ranks)
    s += cat(" rank ", r, " (", board[size_t(r)].host, ", pid ", board[size_t(r)].pid, ", after step ",
             board[size_t(r)].step, ", last entered ", board[size_t(r)].entered, ")");
  return s;
}

// Runs one job to its end, forwarding its output; the watchdog may end it.
JobEnd run_job(const std::vector<std::string>& argv, int world, const std::string& progress_dir, double timeout_s) {
  std::filesystem::remove_all(progress_dir);
  std::filesystem::create_directories(progress_dir);
  int fd = -1;
  const pid_t pid = spawn_job(argv, progress_dir, &fd);
  JobEnd end;
  OutputScanner scanner;
  Watchdog watchdog(timeout_s);
  std::vector<RankProgress> board;
  int status = 0, signalled = 0;
  double killed_at = 0;  // when the job was killed (watchdog, second stop request): SIGKILL 10 s later
  bool ending = false;   // this host's ranks were killed
  for (bool open = true;;) {
    pollfd p{fd, POLLIN, 0};
    if (open && ::poll(&p, 1, 200) > 0) {
      char buf[4096];
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) scanner.feed(buf, size_t(n), end);
      else open = false;
    } else if (!open) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    board = read_progress(progress_dir, world);
    if (::waitpid(pid, &status, WNOHANG) == pid) break;
    if (stop_requests > signalled) {  // the launcher was asked to stop: so is the job
      signalled = int(stop_requests), end.stopped = true;
      // Once politely (the ranks save and stop); a second request kills this host's ranks too (a hung
      // job's would outlive mpirun) and mpirun 10 s later, as the watchdog does.
      if (signalled == 1) ask_to_stop(pid, board);
      else if (!ending) kill_job(pid, board), killed_at = steady_s(), ending = true;
    }
    if (killed_at > 0 && steady_s() - killed_at > 10) ::kill(pid, SIGKILL), killed_at = 0;
    // The watchdog keeps watching a job asked to stop: a hung one cannot save and stop, and is ended
    // as a second request would end it (the launch still ends as stopped, not restarted).
    if (!ending && watchdog.stalled(board)) {
      const std::vector<int> late = did_not_arrive(board);
      const std::string why = hang_words(board, late, watchdog.timeout());
      if (end.stopped) {
        std::fprintf(stderr, "origami launch: the job does not stop: %s; ending it\n", why.c_str());
      } else {
        end.hung = true, end.why = why, end.failed_ranks = late, end.detected = unix_time_s();
        for (int r : late) end.failed_hosts.push_back(board[size_t(r)].host);
        std::fprintf(stderr, "origami launch: watchdog: %s; ending the job\n", why.c_str());
      }
      kill_job(pid, board);
      killed_at = steady_s(), ending = true;
    }
  }
  end.stopped = end.stopped || stop_requests > 0;  // (a request as mpirun exited, before the loop saw it)
  // What is left in the pipe, for at most 5 s (a process that inherited mpirun's output may hold it open).
  for (const double until = steady_s() + 5; steady_s() < until;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    scanner.feed(buf, size_t(n), end);
  }
  ::close(fd);
  end.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  end.steps_done = std::max<int64_t>(0, fewest_steps(board));
  end.ran = std::any_of(board.begin(), board.end(), [](const RankProgress& r) { return r.pid > 0; });
  for (const RankProgress& r : board) {
    end.measured.runtime = std::max(end.measured.runtime, r.runtime);
    end.measured.sampler = std::max(end.measured.sampler, r.sampler);
  }
  if (!end.hung && end.code != 0)
    end.why = end.signal ? cat("rank ", end.failed_ranks.front(), " on ", end.failed_hosts.front(), " ended by signal ",
                               end.signal, " (", strsignal(end.signal), ")")
                         : cat("mpirun exited with ", end.code);
  return end;
}

// mpirun with the world and, with a hostfile, the hosts left (written beside the progress board).
std::vector<std::string> job_command(const std::vector<std::string>& mpirun, int world, const Slots& slots,
                                     const std::string& progress) {
  std::vector<std::string> args = mpirun;
  args.insert(args.end(), {"-np", std::to_string(world)});
  if (slots.hosts.empty()) return args;
  std::string text;
  for (const auto& [host, n] : slots.hosts) text += cat(host, " slots=", n, "\n");
  const std::string path = progress + ".hosts";
  std::filesystem::create_directories(std::filesystem::path(progress).parent_path());  // (--save, before its first save)
  write_file_atomically(path, text);
  // Open MPI passes the environment to the ranks on this host only: the board's directory (absolute,
  // under --save, which every host must share) is exported to the others by name.
  args.insert(args.end(), {"--hostfile", path, "-x", "ORIGAMI_PROGRESS_DIR"});
  return args;
}

// The arguments without each "--NAME VALUE" pair named.
std::vector<std::string> without(std::vector<std::string> args, const std::vector<std::string>& names) {
  for (const std::string& name : names)
    for (auto it = args.begin(); it != args.end();) {
      if (*it == name && it + 1 != args.end()) it = args.erase(it, it + 2);
      else ++it;
    }
  return args;
}

// A world a shrunk job restarts on: its size, pipeline stages, layout in words and, with a cluster,
// the planner's predicted step time.
struct World {
  int size = 0, pp = 1, dp = 1;
  std::string layout;
  double predicted_s = 0;
  MeasuredMemory weighed_with;  // --shrink: the measured parts each rank's memory counted
};

// The largest world in [min_np, most] with a valid layout whose ranks on each node fit this node's
// memory (the launcher's node standing for every node; each run checks its own nodes at start), each
// rank counting the runtime and sampler bytes the failed job measured: DP
// re-derived from the world, TP, CP and EP and the global batch kept (accumulation takes up the rest),
// and the run's PP or fewer stages (an even split, no interleaving). With a cluster description the
// planner's cost model picks the fastest of those; without, the most stages.
World choose_world(const ModelConfig& cfg, const TrainOptions& train, const Slots& slots, int most, int min_np,
                   const Cluster* cluster, MeasuredMemory measured) {
  const int64_t available = available_memory().bytes;
  std::string why = "no world from " + std::to_string(most) + " down to --min-np " + std::to_string(min_np);
  for (int w = most; w >= min_np; --w) {
    std::vector<World> fit;
    for (int pp = train.pp; pp >= 1; --pp) {
      TrainOptions o = train;
      o.dp = 0, o.pp = pp;
      // (each rank's threads hold attention scratch, as its memory check counts: --threads 0 is every
      // core, which this node's count stands for)
      if (o.threads == 0) o.threads = num_threads();
      if (pp != train.pp) o.vpp = 1, o.pp_layers.clear(), o.pp_schedule.clear();
      try {
        const Plan plan = make_plan(cfg, o, w);
        if (const std::string short_by = memory_shortfall(plan, w, slots, available, measured); !short_by.empty()) {
          why += cat("; ", w, " ranks (PP", pp, "): ", short_by);
          continue;
        }
        const double s = cluster ? CostModel(plan.model, *cluster, w).predict(plan.options).step_s : 0;
        fit.push_back({w, pp, plan.mesh.degree("dp"), plan.mesh.describe(cfg.is_moe()), s, measured});
      } catch (const Error& e) {
        if (pp == train.pp) why += cat("; ", w, " ranks: ", e.what());
      }
    }
    if (!fit.empty())
      return *std::min_element(fit.begin(), fit.end(), [](const World& a, const World& b) { return a.predicted_s < b.predicted_s; });
  }
  fail("--shrink: ", why);
}

// What DIR/latest names and when that step was committed: it changes when this launch saves.
struct SaveMark {
  std::string step;
  std::filesystem::file_time_type when{};
  bool operator==(const SaveMark&) const = default;
};

SaveMark save_mark(const std::string& save) {
  if (!Checkpoint::committed_in(save)) return {};
  const std::string step = Checkpoint::resolved(save);
  std::error_code ec;  // (a step removed meanwhile: its time stays unknown, and the path tells)
  return {step, std::filesystem::last_write_time(std::filesystem::path(step) / "metadata.json", ec)};
}

// The --resume of an attempt: the --save directory once this launch saved there; before, the run's own
// start — its --resume, or its --init-from ("", which then stays) —, or without one the --save
// directory (continued when it holds steps, unless --overwrite-save: a new run, "", over them).
std::string attempt_resume(const TrainOptions& train, bool saved) {
  if (saved) return train.save;
  if (!train.resume.empty() || !train.init_from.empty()) return train.resume;
  return train.overwrite_save && Checkpoint::committed_in(train.save) ? "" : train.save;
}

// The training's words for an attempt on world `w`: from `start` (attempt_resume), with the pinned step size
// (`step`: the flag and its value) and, once shrunk, DP and the stages re-derived.
std::vector<std::string> attempt_words(const LaunchOptions& o, const TrainOptions& train, const std::string& start,
                                       const World& w, const std::pair<std::string, std::string>& step) {
  std::vector<std::string> drop{"--resume", step.first};
  if (start == train.save) drop.push_back("--init-from");  // (the run's own checkpoints from here)
  // DP follows a new world size, and new stages on the same world too (a user's --dp would not fit).
  const bool new_dp = w.size != o.np || w.pp != train.pp;
  if (new_dp) drop.push_back("--dp");
  if (w.pp != train.pp) drop.insert(drop.end(), {"--pp", "--vpp", "--pp-layers", "--pp-schedule"});
  std::vector<std::string> words = without(o.train_args, drop);
  if (w.pp != train.pp) words.insert(words.end(), {"--pp", std::to_string(w.pp)});
  if (new_dp) words.insert(words.end(), {"--dp", std::to_string(w.dp)});  // (over a --run-config's dp)
  if (!start.empty()) words.insert(words.end(), {"--resume", start});
  words.insert(words.end(), {step.first, step.second});
  return words;
}

// The start or restart event and line.
// `start`: the attempt's --resume ("" or a directory without a step: from step 0).
void announce(Events& events, int attempt, const World& w, int np, const std::string& start) {
  const bool resumes = !start.empty() && (Checkpoint::committed_in(start) || Checkpoint::is_checkpoint(start));
  const int64_t from = resumes ? Checkpoint::open(start).state().step : 0;
  nlohmann::json begin = {{"event", attempt == 0 ? "start" : "restart"}, {"attempt", attempt}, {"world", w.size},
                          {"layout", w.layout}, {"resumed_from", from}};
  if (w.predicted_s > 0) begin["predicted_step_s"] = w.predicted_s;
  if (w.weighed_with.runtime > 0)
    begin["memory_measured"] = {{"runtime_bytes", w.weighed_with.runtime}, {"sampler_bytes", w.weighed_with.sampler}};
  events.write(begin);
  std::printf("origami launch: %s %d rank%s (%s)%s%s\n", attempt == 0 ? "starting" : "restarting", w.size,
              w.size == 1 ? "" : "s", w.layout.c_str(), w.size != np ? cat(", shrunk from ", np).c_str() : "",
              from > 0 ? cat(", from step ", from, " of ", start).c_str() : "");
  std::fflush(stdout);
}

}  // namespace

std::string memory_shortfall(const Plan& plan, int w, const Slots& slots, int64_t available, MeasuredMemory measured) {
  double most = 0, node = 0, rank_most = 0;
  size_t host = 0;
  int left = slots.hosts.empty() ? w : slots.hosts[0].second;  // this host's slots not yet filled
  for (int r = 0; r < w; ++r) {
    if (left == 0 && host + 1 < slots.hosts.size())  // the next host
      most = std::max(most, node), node = 0, left = slots.hosts[++host].second;
    const double need = double(rank_memory(plan.model, plan.options, w, r, measured.runtime, measured.sampler).total());
    node += need, rank_most = std::max(rank_most, need), --left;
  }
  most = std::max(most, node);
  if (const double limit = plan.options.memory_limit_gb * double(1 << 30); limit > 0)
    return rank_most > limit ? cat("a rank needs ", format_bytes(rank_most), ", more than --memory-limit-gb ",
                                   plan.options.memory_limit_gb)
                             : "";
  return most > double(available) ? cat("need ", format_bytes(most), slots.hosts.size() > 1 ? " on a node" : "", " of ",
                                        format_bytes(double(available)))
                                  : "";
}

bool same_host(const std::string& a, const std::string& b) {
  if (a == b) return true;
  const std::string& shorter = a.size() < b.size() ? a : b;
  const std::string& longer = a.size() < b.size() ? b : a;
  if (shorter.find('.') == std::string::npos && longer.starts_with(shorter + ".")) return true;
  const auto addresses = [](const std::string& host) {
    std::vector<std::string> out;
    addrinfo hints{}, *list = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(host.c_str(), nullptr, &hints, &list) != 0) return out;
    for (const addrinfo* p = list; p; p = p->ai_next)
      out.emplace_back(reinterpret_cast<const char*>(p->ai_addr), p->ai_addrlen);
    ::freeaddrinfo(list);
    return out;
  };
  const std::vector<std::string> x = addresses(a), y = addresses(b);
  return std::any_of(x.begin(), x.end(), [&](const std::string& e) { return std::find(y.begin(), y.end(), e) != y.end(); });
}

std::vector<std::string> drop_failed_slots(Slots& slots, const std::vector<int>& ranks,
                                           const std::vector<std::string>& hosts) {
  if (slots.hosts.empty()) {
    slots.anonymous -= std::max<int>(1, int(ranks.size()));
    return {};
  }
  // Each failed host once (a host's failed ranks name it each), every hostfile line of it (a hostfile may
  // name a host on several lines); "" (a rank that hung before its progress record) matches none.
  std::vector<std::string> dropped, unknown;
  for (const std::string& h : hosts) {
    if (std::find(dropped.begin(), dropped.end(), h) != dropped.end() ||
        std::find(unknown.begin(), unknown.end(), h) != unknown.end())
      continue;
    if (!h.empty() && std::erase_if(slots.hosts, [&](const auto& e) { return same_host(e.first, h); }) > 0)
      dropped.push_back(h);
    // (another spelling of a host already left out is no unknown host)
    else if (h.empty() || std::none_of(dropped.begin(), dropped.end(), [&](const std::string& d) { return same_host(d, h); }))
      unknown.push_back(h);
  }
  return unknown;
}

int run_launch(const LaunchOptions& o, const ModelConfig& cfg, const TrainOptions& train) {
  struct sigaction on_stop {};
  on_stop.sa_handler = count_stop_request;  // (no SA_RESTART: the job's poll returns to look at it)
  ::sigaction(SIGINT, &on_stop, nullptr);
  ::sigaction(SIGTERM, &on_stop, nullptr);
  ::sigaction(SIGHUP, &on_stop, nullptr);  // (a closed terminal: mpirun, in its own group, does not hear it)
  ORIGAMI_CHECK(!o.train_args.empty() && o.train_args[0] == "train",
                "give the training after '--': origami launch --np N -- train ARGS...");
  const std::string save = train.save;  // (from the command line or its --run-config)
  ORIGAMI_CHECK(!save.empty(), "origami launch restarts from the run's checkpoints: give --save DIR to train");
  ORIGAMI_CHECK(!Checkpoint::is_checkpoint(save), "--save '", save,  // (a regular file is one too)
                "' is a file or a checkpoint: give the run's directory (it holds DIR/step-N checkpoints)");
  const bool planned = std::any_of(o.train_args.begin(), o.train_args.end(), [](const std::string& a) {
    return a == "--plan" || a.starts_with("--plan=");  // (Args reads both spellings)
  });
  ORIGAMI_CHECK(!o.shrink || !planned,
                "--shrink lays the job out again on fewer ranks, and train's --plan fixes a layout for ", o.np,
                " devices: give its options instead, or no --shrink");
  ORIGAMI_CHECK(o.np >= 1 && o.min_np >= 1 && o.min_np <= o.np, "--np ", o.np, " and --min-np ", o.min_np,
                ": need 1 <= --min-np <= --np");
  ORIGAMI_CHECK(o.max_restarts >= 0, "--max-restarts must not be negative, got ", o.max_restarts);
  // The step size is pinned (--global-batch, or --tokens-per-step under document batching): a default
  // one would follow DP when the world shrinks. A run that resumes keeps its checkpoint's.
  TrainOptions first = train;
  first.resume = attempt_resume(train, false);
  if (first.resume == save) first.init_from.clear();
  const SaveMark before = save_mark(save);  // (a later one: this launch saved)
  const TrainOptions pinned = make_resumed_plan(cfg, first, o.np).options;
  const bool docs = train.documents();
  const std::string step_flag = docs ? "--tokens-per-step" : "--global-batch";
  const std::string step_size = std::to_string(docs ? pinned.tokens_per_step : pinned.global_batch);
  Slots slots = read_hostfile(o.hostfile, o.np);
  ORIGAMI_CHECK(slots.total() >= o.np, "--hostfile ", o.hostfile, " has ", slots.total(), " slots, fewer than --np ", o.np);
  Events events(o.events);
  std::vector<std::string> mpirun;
  std::istringstream words(o.mpirun);
  for (std::string w; words >> w;) mpirun.push_back(w);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string progress = (std::filesystem::absolute(save) / ".launch").string();
  const std::optional<Cluster> cluster = o.cluster.empty() ? std::nullopt : std::optional<Cluster>(Cluster::load(o.cluster));
  // (ranks beyond a node's devices are priced over its link to other nodes, or within a node's: a
  // one-rank profile has neither)
  ORIGAMI_CHECK(!cluster || o.np <= cluster->devices_per_node || cluster->inter.bandwidth > 0, "--cluster ", o.cluster,
                " gives no link between devices (a one-rank profile measures none), so it cannot price --np ", o.np,
                " ranks; profile on as many ranks as the job has");
  World w{o.np, train.pp, 1, make_plan(cfg, pinned, o.np).mesh.describe(cfg.is_moe()), 0, {}};
  MeasuredMemory measured;  // what the latest job whose ranks reached their memory check measured
  for (int attempt = 0;; ++attempt) {
    std::vector<std::string> args = job_command(mpirun, w.size, slots, progress);
    args.push_back(self);
    const std::string start = attempt_resume(train, save_mark(save) != before);
    const std::vector<std::string> words = attempt_words(o, train, start, w, {step_flag, step_size});
    args.insert(args.end(), words.begin(), words.end());
    announce(events, attempt, w, o.np, start);
    const JobEnd end = run_job(args, w.size, progress, o.step_timeout_s);
    if (end.code == 0 && !end.hung && !end.stopped) {
      events.write({{"event", "finish"}, {"restarts", attempt}, {"world", w.size}});
      return 0;
    }
    // A user error (every rank reported it: 1, with train's error line), the non-finite stop (3), a
    // signal to the job (130) or to the launcher, which passed it on: not restarted. A failure on one
    // rank (2) or a death is, and so is an exit 1 of Open MPI's own (its code for a lost daemon: a
    // node that died) once the ranks ran; before any did, mpirun could not start the job (its
    // options, too few slots), which it says, and a restart would not change.
    const bool user_error = end.code == 1 && (end.user_error || !end.ran);
    if (end.stopped || (!end.hung && (user_error || end.code == 3 || end.code == 130))) {
      const int code = end.stopped ? 130 : end.code;
      events.write({{"event", "stop"}, {"exit_code", code}, {"steps_done", end.steps_done}});
      return code;
    }
    nlohmann::json failure = {{"event", end.hung ? "hang" : "failure"}, {"why", end.why},
                              {"ranks", end.failed_ranks}, {"hosts", end.failed_hosts}, {"steps_done", end.steps_done},
                              {"exit_code", end.code}};
    if (end.signal) failure["signal"] = end.signal;
    if (end.hung) failure["detected"] = end.detected;  // the job's teardown comes after it
    events.write(failure);
    // The run had saved its last step (the failure came after it, in the teardown):
    // done, as a restart would only be told the checkpoint is already at --steps.
    if (const SaveMark now = save_mark(save); now != before && Checkpoint::open(now.step).state().step >= train.steps) {
      std::fprintf(stderr, "origami launch: %s after the run saved its last step (%s): done\n", end.why.c_str(),
                   now.step.c_str());
      events.write({{"event", "finish"}, {"restarts", attempt}, {"world", w.size}, {"after_failure", end.why}});
      return 0;
    }
    // Giving up (the restarts spent, or no world left to shrink to) ends the launch as the job's failure: 2.
    const auto give_up = [&](const std::string& why) {
      std::fprintf(stderr, "origami launch: error: %s\n", why.c_str());
      events.write({{"event", "give_up"}, {"why", why}, {"restarts", attempt}, {"exit_code", kExitRankFailed},
                    {"steps_done", end.steps_done}});
      return kExitRankFailed;
    };
    if (attempt >= o.max_restarts)
      return give_up(cat("the job failed ", attempt + 1, " time", attempt ? "s" : "", " (", end.why, "); --max-restarts ",
                         o.max_restarts, " reached"));
    // (a hang where no rank stands out names every rank: then no slot is blamed, the world stays)
    if (o.shrink && int(end.failed_ranks.size()) < w.size) {
      try {
        for (const std::string& h : drop_failed_slots(slots, end.failed_ranks, end.failed_hosts))
          std::fprintf(stderr, "origami launch: warning: --shrink: %s, so its slots stay in use\n",
                       h.empty() ? "a failed rank named no host (it hung before its progress record)"
                                 : cat("the failed host '", h, "' is none of --hostfile's hosts by name or address "
                                       "(name the hosts as mpirun reports them)").c_str());
        if (end.measured.runtime > 0) measured = end.measured;  // (else an earlier job's, if any)
        w = choose_world(cfg, pinned, slots, std::min(w.size, slots.total()), o.min_np, cluster ? &*cluster : nullptr,
                         measured);
      } catch (const Error& e) {
        return give_up(e.what());
      }
    }
    std::fprintf(stderr, "origami launch: %s; restarting in %g s (%d of %d)\n", end.why.c_str(), o.backoff_s,
                 attempt + 1, o.max_restarts);
    // The backoff, cut short by a stop request (the signal does not end a sleep_for).
    for (const double until = steady_s() + o.backoff_s; steady_s() < until && stop_requests == 0;)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (stop_requests > 0) {
      events.write({{"event", "stop"}, {"exit_code", 130}, {"steps_done", end.steps_done}});
      return 130;
    }
  }
}

}  // namespace origami
