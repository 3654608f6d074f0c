// The `origami` subcommands. Each takes (argc, argv) with argv[0] = the subcommand's name,
// returns the process exit code, and throws origami::Error for user mistakes.
#pragma once

namespace origami {
class Args;
struct TrainOptions;
// The MoE routing options (--moe-*), shared by train and dump (`train` adds the bias update rate).
void add_routing_options(Args& a, bool train);
void read_routing_options(const Args& a, TrainOptions& o, bool train);
// --precision fp32|bf16, shared by train, dump and generate.
void add_precision_option(Args& a);

int cmd_train(int argc, char** argv);     // apps/cmd_train.cpp
int cmd_generate(int argc, char** argv);  // apps/cmd_generate.cpp
int cmd_dump(int argc, char** argv);      // apps/cmd_dump.cpp
int cmd_data(int argc, char** argv);      // apps/cmd_data.cpp
int cmd_ckpt(int argc, char** argv);      // apps/cmd_ckpt.cpp
int cmd_profile(int argc, char** argv);   // apps/cmd_profile.cpp
int cmd_plan(int argc, char** argv);      // apps/cmd_plan.cpp
int cmd_plot(int argc, char** argv);      // apps/cmd_plot.cpp
}  // namespace origami
