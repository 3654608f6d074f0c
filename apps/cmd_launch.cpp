// origami launch: a training job that restarts itself from its checkpoints (train/launch.h).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "train/launch.h"

namespace origami {

int cmd_launch(int argc, char** argv) {
  Args a("launch",
         "origami launch [options] -- train ARGS...\n\n"
         "Run `origami train ARGS` under mpirun and watch it: when a rank is killed or crashes, MPI fails or the\n"
         "job hangs, start it again with the same global batch (the same loss curve): from the run's own --resume\n"
         "or --init-from until the job first saves (give them on train's command line, not in a --run-config),\n"
         "then from the latest checkpoint of its --save directory (a run's directory, not a file or checkpoint).\n"
         "A user error (exit 1), the non-finite stop (3) and a stop by signal (130) end the launch with that\n"
         "code; a failure after the last step's save ends it as done (0). Giving up (--max-restarts spent, or\n"
         "under --shrink no world left) ends it with 2. A job that does not stop after a stop request (SIGINT or\n"
         "SIGTERM: the ranks save and stop) is killed when --step-timeout passes with no progress, or at a second.");
  a.option("np", "N", "ranks")
      .option("min-np", "M", "with --shrink, the fewest ranks to go on with", "1")
      .flag("shrink", "do not use a failed rank's slot (with --hostfile, its host, as the hostfile names it) again: restart on the largest "
                      "world left whose layout (DP re-derived, fewer pipeline stages where needed) is valid and fits; "
                      "--vpp, --pp-layers and --pp-schedule then go on train's command line, not in a run config")
      .option("cluster", "FILE", "with --shrink: a cluster.json (see origami plan) whose cost model picks the fastest "
                                 "layout of the smaller world")
      .option("max-restarts", "R", "restarts before giving up", "3")
      .option("hostfile", "FILE", "mpirun's hostfile (lines 'host slots=N')")
      .option("events", "FILE", "append one JSON object per event: start, failure, hang, restart, finish, stop, give_up")
      .option("step-timeout", "S", "end a job whose ranks make no progress for S seconds once every rank finished "
                                   "a step, at least 600 s before (default: 10x the median step once 3 steps ran, at "
                                   "least 60 s; 600 s before)", "0")
      .option("backoff", "S", "seconds to wait before a restart", "5")
      .option("mpirun", "COMMAND", "the MPI launcher with its options, split at spaces", "mpirun");
  int split = 1;
  while (split < argc && std::strcmp(argv[split], "--") != 0) ++split;
  if (!a.parse(split, argv)) return 0;
  ORIGAMI_CHECK(split + 1 < argc, "give the training after '--': origami launch --np N -- train ARGS...");
  LaunchOptions o;
  ORIGAMI_CHECK(a.has("np"), "give the number of ranks: --np N");
  o.np = a.small_integer("np");
  ORIGAMI_CHECK(o.np >= 1, "--np must be at least 1, got ", o.np);
  o.min_np = a.small_integer("min-np");
  o.shrink = a.on("shrink");
  o.max_restarts = a.small_integer("max-restarts");
  o.hostfile = a.str("hostfile");
  o.events = a.str("events");
  o.step_timeout_s = a.number("step-timeout");
  o.backoff_s = a.number("backoff");
  ORIGAMI_CHECK(o.step_timeout_s >= 0, "--step-timeout must not be negative, got ", a.str("step-timeout"));
  ORIGAMI_CHECK(o.backoff_s >= 0, "--backoff must not be negative, got ", a.str("backoff"));
  o.mpirun = a.str("mpirun");
  ORIGAMI_CHECK(o.mpirun.find_first_not_of(" \t") != std::string::npos, "--mpirun is empty: give the launcher's "
                "command, for example 'mpirun --oversubscribe'");
  o.cluster = a.str("cluster");
  ORIGAMI_CHECK(o.cluster.empty() || o.shrink, "--cluster prices the worlds --shrink chooses between: give --shrink too");
  ORIGAMI_CHECK(!a.given("min-np") || o.shrink, "--min-np bounds the worlds --shrink chooses between: give --shrink too");
  // "--name=value" as two words: launch drops and replaces some options by name (--resume, --dp, ...).
  for (int i = split + 1; i < argc; ++i) {
    const std::string w = argv[i];
    const size_t eq = w.find('=');
    if (w.starts_with("--") && eq != std::string::npos) o.train_args.insert(o.train_args.end(), {w.substr(0, eq), w.substr(eq + 1)});
    else o.train_args.push_back(w);
  }
  ORIGAMI_CHECK(o.train_args[0] == "train", "origami launch runs train: '-- train ARGS...', not '-- ",
                o.train_args[0], "'");
  // The run's options as train reads them (its errors now, before any rank starts).
  std::vector<char*> targs;
  for (std::string& s : o.train_args) targs.push_back(s.data());
  const auto local = make_local_comm();
  const std::optional<TrainCommand> cmd = parse_train_options(int(targs.size()), targs.data(), *local, o.np);
  if (!cmd) return 0;
  // Options launch rewrites on the command line, where a run config's value would stay beside launch's:
  // the run's start (replaced by --resume SAVE once the run resumes its own checkpoints; train refuses
  // both) and, under --shrink, the stages it re-derives.
  const TrainOptions& t = cmd->options;
  const auto on_line = [&](const char* flag) {
    return std::find(o.train_args.begin(), o.train_args.end(), flag) != o.train_args.end();
  };
  for (const auto& [flag, set] : {std::pair{"--resume", !t.resume.empty()}, {"--init-from", !t.init_from.empty()}})
    ORIGAMI_CHECK(!set || on_line(flag), "the run config gives ", flag + 2, ": under origami launch give ", flag,
                  " on train's command line, which launch replaces when it restarts from the run's own checkpoints");
  for (const auto& [flag, set] : {std::pair{"--vpp", t.vpp != 1}, {"--pp-layers", !t.pp_layers.empty()},
                                  {"--pp-schedule", !t.pp_schedule.empty()}})
    ORIGAMI_CHECK(!o.shrink || !set || on_line(flag), "the run config gives ", flag + 2, ": under --shrink give ", flag,
                  " on train's command line, which launch drops when it re-derives the pipeline stages");
  return run_launch(o, cmd->cfg, cmd->options);
}

}  // namespace origami
