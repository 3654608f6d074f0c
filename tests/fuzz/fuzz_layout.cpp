// libFuzzer target: a `--layout` string, through the planner's parser and then the whole search with
// those axes fixed (`origami plan --layout SPEC` on a small llama and an 8-GPU slice of a DGX H100
// cluster, --json to /dev/null). The command's source is compiled into this target (its parser is
// file-local).
#include <cstdio>
#include <string>
#include <vector>

#include "../../apps/cmd_plan.cpp"
#include "fuzz_common.h"

namespace {
std::string config_path, cluster_path;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (!std::freopen("/dev/null", "w", stdout)) std::perror("/dev/null");
  config_path = origami_fuzz::write_file("config.json", R"({"model_type": "mixtral", "vocab_size": 1000,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"})");
  cluster_path = origami_fuzz::write_file("cluster.json", R"({"name": "fuzz", "source": "tests/fuzz",
    "nodes": 2, "devices_per_node": 4, "device": {"memory_gb": 80, "peak_tflops": 989,
    "memory_bandwidth_gb_s": 3350, "gemm_efficiency": 0.8, "attention_tflops": 346},
    "intra_node": {"bandwidth_gb_s": 450, "latency_us": 3}, "inter_node": {"bandwidth_gb_s": 50, "latency_us": 6},
    "comm_overlap": 1})");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string spec(origami_fuzz::as_text(data, size));
  bool parsed = false;
  origami_fuzz::expect_errors([&] { origami::parse_layout(spec), parsed = true; });
  if (!parsed || spec.find('\0') != std::string::npos) return 0;  // a NUL cannot reach argv
  std::vector<std::string> args = {"plan", "--config", config_path, "--cluster", cluster_path, "--devices", "8",
                                   "--global-batch", "16", "--seq-len", "512", "--top", "2", "--json", "--layout", spec};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  origami_fuzz::expect_errors([&] { origami::cmd_plan(int(args.size()), argv.data()); });
  return 0;
}
