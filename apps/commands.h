// The `origami` subcommands. Each takes (argc, argv) with argv[0] = the subcommand's name,
// returns the process exit code, and throws origami::Error for user mistakes.
#pragma once
#include <optional>

#include "comm/comm.h"
#include "model/config.h"
#include "train/trainer.h"

namespace origami {
class Args;
// The MoE routing options (--moe-*), shared by train and dump (`train` adds the bias update rate).
void add_routing_options(Args& a, bool train);
void read_routing_options(const Args& a, TrainOptions& o, bool train);
// An error when a routing option (or, for train, an expert-parallel one) is given, even at its
// default value, for a model without experts.
void require_experts_for_given(const Args& a, const ModelConfig& cfg, bool train);
// --precision fp32|bf16, shared by train, dump and generate.
void add_precision_option(Args& a);
// --threads N of data, dump, generate and profile, checked as train's (check_thread_count).
int threads_option(const Args& a);

// The options of `origami train`, read and checked on every rank of `world`; the model config loaded.
// nullopt when --help was asked for (the help text is then already printed). `ranks`: the job's ranks a
// --plan must lay out (0: world's; origami launch reads the options on one rank for a job of --np).
struct TrainCommand {
  ModelConfig cfg;
  TrainOptions options;
};
std::optional<TrainCommand> parse_train_options(int argc, char** argv, Comm& world, int ranks = 0);

int cmd_train(int argc, char** argv);     // apps/cmd_train.cpp
int cmd_launch(int argc, char** argv);    // apps/cmd_launch.cpp
int cmd_generate(int argc, char** argv);  // apps/cmd_generate.cpp
int cmd_dump(int argc, char** argv);      // apps/cmd_dump.cpp
int cmd_data(int argc, char** argv);      // apps/cmd_data.cpp
int cmd_ckpt(int argc, char** argv);      // apps/cmd_ckpt.cpp
int cmd_profile(int argc, char** argv);   // apps/cmd_profile.cpp
int cmd_plan(int argc, char** argv);      // apps/cmd_plan.cpp
int cmd_plot(int argc, char** argv);      // apps/cmd_plot.cpp
}  // namespace origami
