// The `origami` subcommands. Each takes (argc, argv) with argv[0] = the subcommand's name,
// returns the process exit code, and throws origami::Error for user mistakes.
#pragma once

namespace origami {
int cmd_train(int argc, char** argv);     // apps/cmd_train.cpp
int cmd_generate(int argc, char** argv);  // apps/cmd_generate.cpp
int cmd_dump(int argc, char** argv);      // apps/cmd_dump.cpp
int cmd_data(int argc, char** argv);      // apps/cmd_data.cpp
}  // namespace origami
