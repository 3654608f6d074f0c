// `origami launch`: a training job that heals itself. The launcher starts `origami train` under
// mpirun, watches it, and when the job ends abnormally — a rank killed or crashed, an MPI failure, or
// the watchdog ending a hung job — starts it again from the latest committed checkpoint of its
// --save directory (after a backoff, up to --max-restarts times). The global batch never changes, so
// the resumed run continues the uninterrupted loss curve (checkpoints resume under any layout and
// world size, and the numerics do not depend on the layout).
//
// Exit codes of the job that end the launch at once, with the same code: 1 (a user error: every rank
// reported it, with train's error line; an exit 1 of Open MPI's own once the ranks ran is restarted),
// 3 (the non-finite stop), 130 (stopped by SIGINT/SIGTERM); 0 ends it as finished. The
// launch gives up with 2 when --max-restarts are spent or --shrink finds no world left.
//
// --shrink: the failed ranks' slots (with a hostfile, the failed hosts) are not used again; the next
// world is the largest one not above the slots left and not below --min-np for which the run's layout
// with DP re-derived — TP, CP, EP and the global batch kept, gradient accumulation taking up the rest,
// and the run's pipeline stages or fewer — is valid and fits this node's memory (with the runtime and
// data-sampler bytes the failed job's ranks measured at start, as the next run's own check counts).
// With --cluster FILE (a cluster.json, as `origami plan` reads) the planner's cost model picks the
// fastest of that world's layouts; without, the one with the most stages.
//
// Watchdog: the ranks keep their progress on a board the launcher reads (core/progress.h). When no
// rank's record changes for --step-timeout seconds — by default 10× the median step once 3 steps
// completed, at least 60 s, and 600 s before — the job is ended, naming the ranks that did not arrive
// and the collective each last entered, and it restarts like a failed one.
//
// --events FILE (JSONL, appended): start, failure (rank, host, exit code or signal, steps done),
// hang, restart (world, layout, the step resumed from; after --shrink the runtime and sampler bytes a
// rank's memory was weighed with), finish / stop / give_up.
//
// A stop request (SIGINT/SIGTERM) goes as SIGTERM to this host's ranks (not through mpirun, which
// kills them a second after passing it on): the ranks finish their step, save and exit.
// The watchdog still watches: a job that makes no progress for its timeout then (a hung one cannot
// stop) is killed, as a second request kills it at once.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "train/plan.h"
#include "train/trainer.h"

namespace origami {

struct LaunchOptions {
  int np = 0;             // ranks of the first attempt
  int min_np = 1;         // --shrink never goes below
  bool shrink = false;
  int max_restarts = 3;
  std::string hostfile;   // passed to mpirun (and shrunk by host)
  std::string events;     // JSONL path, optional
  double step_timeout_s = 0;  // 0: automatic (above)
  double backoff_s = 5;   // before a restart
  std::string mpirun = "mpirun";  // the launcher command, split at spaces (e.g. "mpirun --oversubscribe")
  std::string cluster;    // --shrink: a cluster.json whose cost model picks the fastest layout of a world
  std::vector<std::string> train_args;  // "train" and its arguments
};

// The slots runs may use: the hostfile's hosts ("host slots=N", a bare host being one slot), or
// anonymous slots on this node.
struct Slots {
  std::vector<std::pair<std::string, int>> hosts;  // empty: no hostfile
  int anonymous = 0;
  int total() const {
    int n = anonymous;
    for (const auto& [h, s] : hosts) n += s;
    return n;
  }
};

// Whether two host names name one host: the same words; a short name and a full one that begins with
// it ("node3", "node3.cluster.local"), as mpirun and a hostfile may each write; or names that resolve to
// a common address.
bool same_host(const std::string& a, const std::string& b);

// --shrink: the slots left after a failure of `ranks` on `hosts` (mpirun's or the progress board's
// names, "" for a rank that named none): without a hostfile, one fewer per failed rank (at least one);
// with one, without every line of each failed host. Returns the failed hosts the hostfile does not
// name, "" among them for a rank that named none (their slots stay in use: the launcher warns).
std::vector<std::string> drop_failed_slots(Slots& slots, const std::vector<int>& ranks,
                                           const std::vector<std::string>& hosts);

// The parts of a rank's memory that train's memory check measures rather than computes — the runtime
// (libraries, MPI, thread pools) and the data samplers — as the most any rank of the last job that
// reached its check recorded on the progress board (0 where no rank did: then they are not counted).
struct MeasuredMemory {
  int64_t runtime = 0, sampler = 0;
};

// --shrink: what of a world of w ranks does not fit, as train's memory check would find it ("" when it
// fits): under --memory-limit-gb each rank's need against it, else each node's ranks' against
// `available` (mpirun fills the hostfile's hosts in order, slot by slot; without one, every rank is on
// this node), each rank's need counting `measured`. The plan's model carries the run's routing options
// (a capacity factor bounds the experts' rows).
std::string memory_shortfall(const Plan& plan, int w, const Slots& slots, int64_t available, MeasuredMemory measured);

// Runs the job to its end; returns the launch's exit code. `cfg` and `train` are the run's model and
// options as `origami train` reads them from train_args (for re-planning a smaller world).
int run_launch(const LaunchOptions& o, const ModelConfig& cfg, const TrainOptions& train);

}  // namespace origami
