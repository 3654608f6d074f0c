// origami ckpt: look into checkpoints and convert them to Hugging Face directories.
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include "ckpt/checkpoint.h"
#include "commands.h"
#include "core/args.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/io.h"

namespace origami {

namespace {

const char* kCkptUsage =
    "usage: origami ckpt <subcommand> CHECKPOINT [options]\n\n"
    "subcommands:\n"
    "  info     the step, the layout that saved it, every tensor's global shape and the bytes per rank\n"
    "  export   write a Hugging Face model directory (transformers loads it)\n\n"
    "CHECKPOINT: a --save directory (its newest committed step), one step-N in it, an exported directory,\n"
    "a Hugging Face model directory or a .safetensors file.\n";

// `ckpt SUB CHECKPOINT --opts`: the checkpoint is the first word after the subcommand (or --checkpoint).
std::string take_checkpoint(int& argc, char**& argv, Args& a) {
  a.option("checkpoint", "PATH", "the checkpoint (or give it as the first argument)");
  std::string path;
  if (argc >= 2 && argv[1][0] != '-') {
    path = argv[1];
    argv[1] = argv[0];
    --argc, ++argv;
  }
  return path;
}

// The checkpoint take_checkpoint found or --checkpoint gave: exactly one of them.
std::string checkpoint_of(const std::string& first, const Args& a, const char* usage) {
  ORIGAMI_CHECK(first.empty() || !a.has("checkpoint"), "two checkpoints given: '", first, "' and --checkpoint '",
                a.str("checkpoint"), "'; give one");
  const std::string path = first.empty() ? a.str("checkpoint") : first;
  ORIGAMI_CHECK(!path.empty(), "give the checkpoint: ", usage);
  return path;
}

std::string format_mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", double(bytes) / 1e6);
  return buf;
}

// total plus the elements of a tensor of `shape` (the file's: a sum past 64 bits is an Error naming it).
Size add_elements(Size total, const Checkpoint& ck, const char* what, const std::string& name,
                  const std::vector<int64_t>& shape) {
  return size_error(cat("'", ck.path(), "': the ", what), cat("tensor ", name, " of shape ", shape_str(shape)), [&] {
    Size n = 1;
    for (int64_t d : shape) n *= d;
    return total + n;
  });
}

// ckpt info of a bare .safetensors file: its tensors, with no config to check them against.
void print_file_tensors(const Checkpoint& ck) {
  const auto shapes = ck.weight_shapes();
  std::printf("tensors (%zu; no config.json to check them against):\n", shapes.size());
  Size elements = 0;
  for (const auto& [name, shape] : shapes) {
    std::printf("  %-48s %s\n", name.c_str(), shape_str(shape).c_str());
    elements = add_elements(elements, ck, "element count", name, shape);
  }
  std::printf("elements: %lld\n", (long long)elements.get());
}

int ckpt_info(int argc, char** argv) {
  Args a("ckpt info", "Print a checkpoint's step, the layout that saved it, every tensor's global shape and the\n"
                      "bytes each rank wrote. A sharded checkpoint's files are checked: each there, with its\n"
                      "recorded size and a readable header (--verify: and its recorded checksum).");
  std::string path = take_checkpoint(argc, argv, a);
  a.flag("verify", "also read every shard file and check its checksum (as a resume does)");
  if (!a.parse(argc, argv)) return 0;
  path = checkpoint_of(path, a, "origami ckpt info DIR");
  Checkpoint ck = Checkpoint::open(path);
  ck.warn_fallback(path, "ckpt info");
  const nlohmann::json& st = ck.trainer_state();
  std::printf("checkpoint %s\n", ck.path().c_str());
  std::printf("form: %s\n", ck.sharded() ? "origami sharded (one file per rank)"
                            : ck.has_optimizer() ? "origami single-file (weights, optimizer state)"
                                                 : "weights only (Hugging Face)");
  if (!st.is_null() && st.contains("step")) std::printf("step: %lld\n", (long long)st["step"].get<int64_t>());
  if (ck.sharded()) {
    const nlohmann::json& m = ck.metadata();
    const nlohmann::json& l = m["layout"];
    const int world = l.value("world", 0);
    const std::string ranks = cat(world, world == 1 ? " rank" : " ranks"), layout = l.value("description", std::string("?"));
    std::printf("saved by: %s\n", layout == ranks ? ranks.c_str() : (ranks + ", " + layout).c_str());
    int64_t total = 0;
    std::printf("bytes per rank:");
    for (const auto& f : m["files"]) {
      std::printf(" %s", format_mb(f["bytes"].get<int64_t>()).c_str());
      total += f["bytes"].get<int64_t>();
    }
    std::printf(" (%s in %zu file%s)\n", format_mb(total).c_str(), m["files"].size(), m["files"].size() == 1 ? "" : "s");
    ck.check_files();
    if (a.on("verify")) ck.verify_checksums(0, 1);
    std::printf("files: %s\n", a.on("verify") ? "each there with its recorded size and checksum"
                                              : "each there with its recorded size (--verify: checksums too)");
    Size params = 0;  // checked (core/checked.h): the shapes are the file's
    std::printf("tensors (%zu):\n", m["tensors"].size());
    std::map<std::string, int> weight_pieces;  // by tensor (one pass: a large run saves many pieces of many tensors)
    for (const auto& p : m["pieces"])
      if (p[0].get_ref<const std::string&>() == "weight") ++weight_pieces[p[1].get<std::string>()];
    for (const auto& [name, t] : m["tensors"].items()) {
      const auto shape = t["shape"].get<std::vector<int64_t>>();
      params = add_elements(params, ck, "parameter count", name, shape);
      const int pieces = weight_pieces[name];
      std::printf("  %-48s %-16s %s, %d weight piece%s\n", name.c_str(), shape_str(shape).c_str(),
                  t["dtype"].get<std::string>().c_str(), pieces, pieces == 1 ? "" : "s");
    }
    std::printf("parameters: %lld\n", (long long)params.get());
    return 0;
  }
  // The other forms: what the file headers say, checked against the config where there is one.
  std::string cfg_path = ck.config_path();
  if (cfg_path.empty()) {  // a bare .safetensors file
    print_file_tensors(ck);
    return 0;
  }
  const ModelConfig cfg = load_model_config(cfg_path);
  ck.bind(cfg);
  for (const ParamSpec& p : make_param_table(cfg)) std::printf("  %-48s %s\n", p.name.c_str(), shape_str(p.shape).c_str());
  std::printf("parameters: %lld\n", (long long)num_parameters(cfg));
  return 0;
}

// What a Hugging Face config cannot say about how the run routed: transformers would run these
// weights as another model. Said, not refused: the export still resumes under origami, and the
// weights are the run's.
void warn_routing_not_exported(const Checkpoint& ck, const ModelConfig& cfg) {
  if (!cfg.is_moe()) return;
  if (const std::string score = ck.trained_option("moe_router_score", "softmax"); score != "softmax")
    std::fprintf(stderr, "origami ckpt export: warning: the run scored its routers with %s "
                         "(--moe-router-score); Hugging Face's %s scores with softmax, so transformers will route "
                         "these weights differently ('origami generate' of the checkpoint, or of an export with "
                         "--optimizer, routes as trained)\n",
                 score.c_str(), cfg.model_type().c_str());
  bool biased = false;
  for (const auto& layer : ck.state().router_bias)
    for (float b : layer) biased = biased || b != 0;
  if (biased)
    std::fprintf(stderr, "origami ckpt export: warning: the run learned router selection biases "
                         "(--moe-router-bias-update-rate); a Hugging Face config has no place for them, so "
                         "transformers will select experts without them ('origami generate' of the checkpoint, or of "
                         "an export with --optimizer, uses them)\n");
}

int ckpt_export(int argc, char** argv) {
  Args a("ckpt export", "Write a Hugging Face model directory from any checkpoint: config.json, model.safetensors\n"
                        "(or shards with model.safetensors.index.json above --max-shard-gb, the Hub's layout) and\n"
                        "tokenizer.json with tokenizer_config.json when the checkpoint has one. With --optimizer also\n"
                        "optimizer.safetensors and trainer_state.json: the result is an origami checkpoint that\n"
                        "--resume continues. With --dtype bf16 the weights are BF16 and config.json's torch_dtype\n"
                        "\"bfloat16\".");
  std::string path = take_checkpoint(argc, argv, a);
  a.option("hf", "OUT", "output directory")
      .option("max-shard-gb", "X", "largest weights file in GB (10^9 bytes)", "5")
      .option("dtype", "fp32|bf16", "the weights' element type in the export (bf16: half the bytes, rounded to "
              "nearest even; the checkpoint itself stays fp32)", "fp32")
      .flag("optimizer", "also write the AdamW moments and the trainer state");
  if (!a.parse(argc, argv)) return 0;
  path = checkpoint_of(path, a, "origami ckpt export DIR --hf OUT");
  ORIGAMI_CHECK(a.has("hf"), "give the output directory: --hf OUT");
  const double gb = a.number("max-shard-gb");
  ORIGAMI_CHECK(gb > 0 && gb <= 9e9, "--max-shard-gb must be positive and at most 9e9 (bytes in 64 bits), got ", gb);
  const ExportDtype dtype = parse_export_dtype(a.str("dtype"));
  Checkpoint ck = Checkpoint::open(path);
  ck.warn_fallback(path, "ckpt export");
  ORIGAMI_CHECK(!ck.config_path().empty(), "'", ck.path(), "' has no config.json beside it");
  const ModelConfig cfg = load_model_config(ck.config_path());
  ck.bind(cfg);
  ck.verify_checksums(0, 1);  // a damaged shard is refused, not exported
  warn_routing_not_exported(ck, cfg);
  const int files = export_checkpoint(ck, cfg, a.str("hf"), int64_t(gb * 1e9), a.on("optimizer"), dtype);
  std::printf("exported %s to %s (%d weights file%s%s%s)\n", ck.path().c_str(), a.str("hf").c_str(), files,
              files == 1 ? "" : "s", dtype == ExportDtype::bf16 ? ", bf16" : "", a.on("optimizer") ? ", optimizer state" : "");
  return 0;
}

}  // namespace

int cmd_ckpt(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kCkptUsage, stderr);
    fail("a subcommand is required (info or export)");
  }
  const std::string sub = argv[1];
  if (sub == "--help" || sub == "-h") {
    std::fputs(kCkptUsage, stdout);
    return 0;
  }
  if (sub == "info") return ckpt_info(argc - 1, argv + 1);
  if (sub == "export") return ckpt_export(argc - 1, argv + 1);
  fail("unknown subcommand '", sub, "' (known: info, export; see 'origami ckpt --help')");
}

}  // namespace origami
