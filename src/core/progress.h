// The progress board between the ranks of a training job and `origami launch` (train/launch.h): every
// rank keeps a small record in DIR/rank.R — its pid and host, the steps it completed, and the
// collective it last entered — as plain stores into a shared file mapping, so noting costs no system
// call and the launcher reads every rank's record whenever it polls. The launcher's watchdog uses it
// to see a job stop making progress, to name the ranks that did not arrive and what each last
// entered, and to reach their processes.
//
// A rank joins when ORIGAMI_PROGRESS_DIR is set (the launcher sets it); otherwise every call here
// does nothing. Reads can see a record half-updated: its text fields are for people, and `beats`
// (bumped after every change) is what the watchdog compares.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace origami {

// Rank side. progress_join maps this rank's record (Error naming the file when it cannot).
void progress_join(int world_rank);
void progress_step_done(int64_t step);
// `what` in the group `group`, e.g. ("all_reduce", "dp"); kept until the next note.
void progress_entered(const char* what, const std::string& group);
// The memory check's measured parts of this rank (train/memory_check.h): the runtime (the process's
// resident bytes before the model's buffers) and the data samplers' bytes. --shrink weighs a smaller
// world with the most any rank measured, as the next run's own check will.
void progress_memory(int64_t runtime_bytes, int64_t sampler_bytes);
// Progress without a change of place: a long checkpoint write beats after every 256 MiB, so that the
// watchdog does not take a slow disk for a hang (safe from any thread).
void progress_alive();

// When process `pid` started (field 22 of /proc/PID/stat: clock ticks since boot), −1 when it cannot
// be read (no such process, no /proc). With the pid it names one process: a pid is reused only by a
// process that starts later.
int64_t process_start(int64_t pid);

// Launcher side: the records of ranks 0 .. world-1 in dir (a rank that has not joined: pid 0).
// `start` is the rank's process_start (−1: it could not read it).
struct RankProgress {
  int64_t pid = 0, step = -1, start = -1;
  int64_t runtime = 0, sampler = 0;  // progress_memory's (0: not measured yet)
  uint64_t beats = 0;
  std::string host, entered;
};
std::vector<RankProgress> read_progress(const std::string& dir, int world);
// Whether the record's process (on this host) is still the rank: the same pid and start time. A rank
// that exited leaves its pid free for another process, which the watchdog must not kill. A rank that
// could not read its start cannot be told from another: true.
bool still_running(const RankProgress& r);

}  // namespace origami
