// origami: the command. `origami <command> [options]`; `origami <command> --help` for each.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/files.h"
#include "kernels/cpu/gemm.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

const Command kCommands[] = {
    {"train", origami::cmd_train, "train a gpt2 / llama / mixtral / qwen2_moe model from a Hugging Face config.json"},
    {"launch", origami::cmd_launch, "run train under mpirun and restart it from its checkpoints when a rank fails or hangs"},
    {"generate", origami::cmd_generate, "sample text from a saved checkpoint"},
    {"data", origami::cmd_data, "prepare tokenized datasets (origami data prepare --help)"},
    {"ckpt", origami::cmd_ckpt, "inspect a checkpoint, or export it as a Hugging Face directory (origami ckpt --help)"},
    {"plan", origami::cmd_plan, "predict step time, memory and MFU of layouts on a cluster and list the best"},
    {"profile", origami::cmd_profile, "measure this machine (GEMMs, attention, collectives) for the planner: a cluster.json"},
    {"plot", origami::cmd_plot, "draw the loss, learning rate, speed and gradient norm curves of runs from --metrics files"},
    {"dump", origami::cmd_dump, "write logits, losses and gradients of one batch (for checking against other implementations)"},
};

void usage(FILE* out) {
  std::fprintf(out, "usage: origami <command> [options]\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(out, "\n'origami <command> --help' describes a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {  // no command is a user mistake like any other: one error line, exit 1
    std::fprintf(stderr, "origami: error: no command given\n\n");
    usage(stderr);
    return 1;
  }
  if (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(stdout);
    return 0;
  }
  for (const auto& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    origami::flush_denormals();  // (kernels/cpu/gemm.h: why)
    try {
      const int rc = c.run(argc - 1, argv + 1);
      // Output that could not be written (a full disk, /dev/full) is an error, not a success.
      const bool flushed = std::fflush(stdout) == 0;
      if (!flushed || std::ferror(stdout)) {
        std::fprintf(stderr, "origami %s: error: writing the standard output failed%s%s\n", c.name,
                     flushed ? "" : ": ", flushed ? "" : std::strerror(errno));
        return rc == 0 ? 1 : rc;
      }
      return rc;
    } catch (const origami::ErrorReported&) {
      return 1;
    } catch (const origami::Error& e) {
      std::fprintf(stderr, "origami %s: error: %s\n", c.name, e.what());
      return 1;
    } catch (const std::filesystem::filesystem_error& e) {  // a path a user gave (core/error.h)
      std::fprintf(stderr, "origami %s: error: %s\n", c.name, origami::filesystem_words(e).c_str());
      return 1;
    } catch (const std::bad_alloc&) {  // large buffers are checked before allocation and name their purpose
      std::fprintf(stderr, "origami %s: error: out of memory (in an allocation outside the checked buffers)\n", c.name);
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "origami %s: unexpected error: %s\n", c.name, e.what());
      return 1;
    }
  }
  std::vector<std::string> names;
  for (const auto& c : kCommands) names.push_back(c.name);
  const std::string meant = origami::closest_name(argv[1], names);
  std::fprintf(stderr, "origami: error: unknown command '%s'%s\n\n", argv[1],
               meant.empty() ? "" : (" (did you mean '" + meant + "'?)").c_str());
  usage(stderr);
  return 1;
}
