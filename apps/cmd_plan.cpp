// origami plan: predicts step time, memory and MFU of training layouts on a cluster, searches the
// layouts the runtime accepts, and prints the best (plan/cost_model.h).
//
//   origami plan --config HF_CONFIG --cluster cluster.json --devices N --global-batch G --seq-len T
//                [--layout "tp2 cp1 ep8 etp1 pp4 vpp1 zero1 mb1 recompute=selective sp cp-comm=a2a"]
//                [--top K] [--json] [--out plan.json] [--plot FILE.png]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/files.h"
#include "core/memory.h"
#include "kernels/cpu/matmul.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "core/gnuplot.h"
#include "plan/plot.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

namespace origami {
namespace {

// The axes --layout fixes; -1 (or empty): searched.
constexpr int64_t kMaxTop = 1000;  // --top: the search keeps the best K, and a larger K stops it from skipping any
constexpr int64_t kMaxDevices = int64_t(1) << 20;  // --nodes: a million devices, far beyond any cluster

struct Fixed {
  int tp = -1, cp = -1, dp = -1, ep = -1, etp = -1, pp = -1, vpp = -1, zero = -1, sp = -1, fssdp = -1, vocab = -1;
  int64_t mb = -1;
  std::string recompute, cp_comm;
  std::vector<int> pp_layers;  // pp-layers=N,N,...: layers of each virtual stage (empty: an even split)
};

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// "7,8,8,7"
std::string join_layers(const std::vector<int>& layers) {
  std::string s;
  for (int n : layers) s += cat(s.empty() ? "" : ",", n);
  return s;
}

Fixed parse_layout(const std::string& spec) {
  Fixed f;
  std::istringstream in(spec);
  std::map<std::string, std::string> axis_word;  // each axis fixed once: "tp2 tp4" or "sp nosp" is a mistake
  for (std::string w; in >> w;) {
    auto number = [&](size_t skip, int64_t least = 1, int64_t most = kMaxDegree) {
      const std::string digits = w.substr(skip);
      ORIGAMI_CHECK(!digits.empty() && digits.size() < 12 && std::all_of(digits.begin(), digits.end(), is_digit) &&
                        std::stoll(digits) >= least && std::stoll(digits) <= most,
                    "--layout: '", w, "' needs an integer in [", least, ", ", most, "] after '", w.substr(0, skip),
                    "'");
      return std::stoll(digits);
    };
    auto mode = [&](size_t skip, const auto& parse) {  // the word's MODE, checked by train's own rule
      try {
        parse(w.substr(skip));
      } catch (const Error& e) {
        fail("--layout: '", w, "': ", e.what());
      }
      return w.substr(skip);
    };
    if (w.rfind("recompute=", 0) == 0) f.recompute = mode(10, parse_recompute);
    else if (w.rfind("cp-comm=", 0) == 0) {
      f.cp_comm = mode(8, parse_cp_comm);
      ORIGAMI_CHECK(f.cp_comm != "a2a+p2p", "--layout: 'cp-comm=a2a+p2p' needs the all-to-all groups' size "
                    "(train --cp-a2a-size), which plan does not search: plan cp-comm=p2p or cp-comm=a2a");
    } else if (w.rfind("pp-layers=", 0) == 0) {
      std::istringstream list(w.substr(10));
      int64_t layers = 0;
      for (std::string n; std::getline(list, n, ',');) {
        ORIGAMI_CHECK(!n.empty() && n.size() < 8 && std::all_of(n.begin(), n.end(), is_digit) && std::stoll(n) >= 1,
                      "--layout: '", w, "' needs positive layer counts (below 10^7) separated by commas, got '", n, "'");
        f.pp_layers.push_back(int(std::stoll(n)));
        layers += f.pp_layers.back();
        ORIGAMI_CHECK(layers <= kMaxDegree, "--layout: '", w, "' adds up to more than ", kMaxDegree, " layers");
      }
      ORIGAMI_CHECK(!f.pp_layers.empty() && w.back() != ',', "--layout: '", w,
                    "' needs positive layer counts separated by commas");
    }
    else if (w == "sp") f.sp = 1;
    else if (w == "nosp") f.sp = 0;
    else if (w == "fssdp") f.fssdp = 1;
    else if (w == "fssdp-keep") f.fssdp = 2;
    else if (w == "nofssdp") f.fssdp = 0;
    else if (w == "vocab") f.vocab = 1;
    else if (w == "novocab") f.vocab = 0;
    else if (w.rfind("etp", 0) == 0) f.etp = int(number(3));
    else if (w.rfind("tp", 0) == 0) f.tp = int(number(2));
    else if (w.rfind("cp", 0) == 0) f.cp = int(number(2));
    else if (w.rfind("dp", 0) == 0) f.dp = int(number(2));  // (derived from the others: a check, as the table prints it)
    else if (w.rfind("ep", 0) == 0) f.ep = int(number(2));
    else if (w.rfind("vpp", 0) == 0) f.vpp = int(number(3));
    else if (w.rfind("pp", 0) == 0) f.pp = int(number(2));
    else if (w.rfind("mb", 0) == 0) f.mb = number(2, 1, kMaxBatch);  // (train's bound on --micro-batch)
    else if (w.rfind("zero", 0) == 0) f.zero = int(number(4, 0));
    else fail("--layout: '", w, "' is not one of tpN cpN dpN epN etpN ppN vppN zeroN mbN sp nosp fssdp fssdp-keep nofssdp "
                "vocab novocab recompute=MODE cp-comm=MODE pp-layers=N,N,...");
    const size_t eq = w.find('=');  // the axis the (valid) word fixes: tp, sp, fssdp, recompute, ...
    std::string axis = eq != std::string::npos ? w.substr(0, eq) : w.starts_with("no") ? w.substr(2) : w;
    if (axis.starts_with("fssdp")) axis = "fssdp";
    while (is_digit(axis.back())) axis.pop_back();
    const auto [at, first] = axis_word.emplace(axis, w);
    ORIGAMI_CHECK(first, "--layout: '", at->second, "' and '", w, "' both fix ", axis, ": give it once");
  }
  ORIGAMI_CHECK(f.zero == -1 || (f.zero >= 0 && f.zero <= 3), "--layout: zero must be 0, 1, 2 or 3, got ", f.zero);
  return f;
}

// Ascending; in O(sqrt(n)) steps (n: a device count, an expert count or rows per DP rank, each below 2^31).
std::vector<int> divisors(int64_t n) {
  ORIGAMI_ASSERT(n >= 1 && n <= INT32_MAX);
  std::vector<int> low, high;
  for (int64_t k = 1; k * k <= n; ++k)
    if (n % k == 0) {
      low.push_back(int(k));
      if (k * k != n) high.push_back(int(n / k));
    }
  low.insert(low.end(), high.rbegin(), high.rend());
  return low;
}

std::string layout_name(const TrainOptions& o, int devices) {
  const MeshDims d = o.layout_dims(devices);
  std::string s = cat("tp", o.tp, " cp", o.cp, " dp", d.dp, " pp", o.pp);
  if (o.vpp > 1) s += cat(" vpp", o.vpp);
  if (o.vocab_parallel) s += " vocab";
  if (o.ep > 1 || o.etp > 1) s += cat(" ep", o.ep, " etp", o.etp);
  if (o.fssdp()) s += o.fssdp_keep ? " fssdp-keep" : " fssdp";
  s += cat(" zero", o.zero, " mb", o.micro_batch);
  if (o.sequence_parallel) s += " sp";
  if (o.cp > 1) s += " cp-comm=" + o.cp_comm;
  if (o.recompute != "none") s += " recompute=" + o.recompute;
  if (!o.pp_layers.empty()) s += " pp-layers=" + join_layers(o.pp_layers);
  return s;
}

struct Candidate {
  TrainOptions o;
  Prediction p;
};

// The options of `origami plan`, read and checked; the model and the cluster loaded.
struct PlanCommand {
  ModelConfig cfg;
  Cluster cluster;
  int devices = 0;
  int64_t global_batch = 0, seq_len = 0, top = 0;
  RoutingSkew skew;  // --imbalance
  std::string layout;  // --layout as given (empty: none)
  Fixed fixed;         // its axes
  bool json = false, explain = false, any_memory = false;
  std::string out, plot;  // empty: not asked for
  std::string precision;  // of the layer GEMMs: fp32 | bf16 (memory counts the bf16 weight copy and scratch)
  std::string grad_reduce_dtype;  // of the DP/EDP gradient reductions: fp32 | bf16 (their bytes and buffers)
};

// --imbalance: a number (every EP degree alike) or a run's metrics file (each EP degree from its routing).
RoutingSkew parse_imbalance(const std::string& v, const ModelConfig& cfg) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (!v.empty() && *end == 0) {
    ORIGAMI_CHECK(std::isfinite(x) && x >= 1, "--imbalance is the busiest rank's rows over the mean: at least 1, got ", v);
    RoutingSkew s{x};
    s.experts = cfg.num_experts, s.top_k = cfg.top_k;
    return s;
  }
  ORIGAMI_CHECK(std::filesystem::exists(v), "--imbalance must be a number (at least 1) or the metrics file of an MoE "
                "run; '", v, "' is neither (no such file)");
  return routing_skew_from_metrics(v, cfg.num_layers, cfg.num_experts);
}

// nullopt when --help was asked for (the help text is then already printed).
std::optional<PlanCommand> parse_plan_options(int argc, char** argv) {
  Args a("plan",
         "Predict step time, memory per rank and MFU of training layouts (TP, CP and its mechanism, EP or\n"
         "FSSDP, ETP, DP with ZeRO, PP and VPP, micro-batch, sequence and vocabulary parallelism,\n"
         "recomputation) on a cluster, and list the best that fit.\n"
         "Step time, memory and communication come from the runtime's own functions and the cluster's\n"
         "measured or documented rates (DESIGN.md, \"Planner\").");
  a.option("config", "FILE", "model config.json (Hugging Face)")
      .option("cluster", "FILE", "cluster.json (configs/clusters/, or written by 'origami profile')")
      .option("devices", "N", "ranks of the run (default: every device of the cluster)")
      .option("global-batch", "G", "rows per optimizer step")
      .option("seq-len", "T", "tokens per row")
      .option("layout", "AXES", "fix these axes and search the rest, e.g. \"tp2 pp4 zero1 mb1 recompute=selective\"; "
                                "the words: tpN cpN dpN epN etpN ppN vppN zeroN mbN, sp nosp, fssdp fssdp-keep "
                                "nofssdp, vocab novocab, recompute=MODE, cp-comm=p2p|a2a, pp-layers=N,N,...")
      .option("top", "K", "layouts to print", "10")
      .option("nodes", "N", "size the cluster file's pod: N nodes of its devices_per_node (default: the file's nodes)")
      .option("precision", "fp32|bf16", "the run's --precision: bf16 GEMMs and attention at the cluster's bf16 rates "
                                        "(its fp32 ones where it gives none), 2-byte activations on GPU clusters (4-byte "
                                        "on CPU ones, as origami's CPU kernels keep them), and the weights' bf16 copy and "
                                        "the rounding scratch in each rank's memory",
              "fp32")
      .option("grad-reduce-dtype", "fp32|bf16", "the run's --grad-reduce-dtype: bf16 halves the gradient "
                                                "reductions' bytes and adds their bf16 buffers to memory", "fp32")
      .option("imbalance", "X|FILE", "MoE: the busiest EP rank's routed rows over the mean, call by call (what a run's "
                                     "expert_sync_imbalance measures): X for every EP degree (at most d·min(k, E/d)/k at EPd: all "
                                     "the rows its experts can get), or a metrics file of an MoE "
                                     "run of this model (any layout; a short run on one rank will do): each EP degree's "
                                     "figure from its experts' token counts, the median of its steps", "1.0")
      .flag("json", "print a JSON list, best first (each with its step time's 'breakdown')")
      .flag("any-memory", "list layouts whatever memory they need (to time another trainer's published run, "
                          "whose memory differs from origami's); the memory column still says what origami needs")
      .flag("explain", "after the table, each listed layout's step time by part: compute by term (GEMMs, "
                       "attention, element-wise, kernel launches), bubble, exposed communication per group, optimizer")
      .option("out", "FILE", "write the best layout as a plan file (its options and prediction)")
      .option("plot", "FILE.png", "draw the predicted step time breakdown of the listed layouts (gnuplot)");
  if (!a.parse(argc, argv)) return std::nullopt;
  for (const char* required : {"config", "cluster", "global-batch", "seq-len"})
    ORIGAMI_CHECK(a.has(required), "--", required, " is required (see 'origami plan --help')");
  PlanCommand cmd;
  cmd.cfg = load_model_config(a.str("config"));
  cmd.cluster = Cluster::load(a.str("cluster"));
  if (a.has("nodes")) {
    cmd.cluster.nodes = a.small_integer("nodes");
    ORIGAMI_CHECK(cmd.cluster.nodes >= 1 && int64_t(cmd.cluster.nodes) * cmd.cluster.devices_per_node <= kMaxDevices,
                  "--nodes must be in [1, ", kMaxDevices / cmd.cluster.devices_per_node, "] (at most ", kMaxDevices,
                  " devices of ", cmd.cluster.devices_per_node, " per node), got ", cmd.cluster.nodes);
    ORIGAMI_CHECK(cmd.cluster.nodes == 1 || cmd.cluster.inter_given, "--nodes ", cmd.cluster.nodes, ": ",
                  a.str("cluster"), " gives no 'inter_node' link to join its nodes with");
  }
  cmd.devices = a.has("devices") ? a.small_integer("devices") : cmd.cluster.devices();
  ORIGAMI_CHECK(cmd.devices >= 1 && cmd.devices <= cmd.cluster.devices(), "--devices must be in [1, ",
                cmd.cluster.devices(), "] (the cluster's devices: ", cmd.cluster.nodes, " node", cmd.cluster.nodes > 1 ? "s" : "",
                " of ", cmd.cluster.devices_per_node, "; --nodes N sizes the pod), got ", cmd.devices);
  cmd.global_batch = a.integer("global-batch"), cmd.seq_len = a.integer("seq-len"), cmd.top = a.integer("top");
  for (const auto& [flag, v] : {std::pair{"--global-batch", cmd.global_batch}, {"--seq-len", cmd.seq_len}, {"--top", cmd.top}})
    ORIGAMI_CHECK(v >= 1, flag, " must be positive, got ", v);
  ORIGAMI_CHECK(cmd.top <= kMaxTop, "--top must be at most ", kMaxTop, ", got ", cmd.top);
  ORIGAMI_CHECK(cmd.global_batch <= kMaxBatch, "--global-batch must be at most ", kMaxBatch, " (as in 'origami train'), got ",
                cmd.global_batch);
  ORIGAMI_CHECK(cmd.seq_len <= cmd.cfg.max_positions, "--seq-len must be in [1, ", cmd.cfg.max_positions,
                "] (the model's maximum positions), got ", cmd.seq_len);
  checked_num_parameters(cmd.cfg);
  ORIGAMI_CHECK(!a.given("imbalance") || cmd.cfg.is_moe(), "--imbalance prices the routing of experts, and this ",
                cmd.cfg.model_type(), " model has none");
  cmd.skew = parse_imbalance(a.str("imbalance"), cmd.cfg);
  cmd.layout = a.str("layout");
  cmd.fixed = parse_layout(cmd.layout);
  cmd.json = a.on("json");
  cmd.explain = a.on("explain");
  ORIGAMI_CHECK(!(cmd.explain && cmd.json), "--explain prints each layout's step time by part after the table, which "
                "--json does not print: its 'breakdown' field holds the same parts; drop one");
  cmd.any_memory = a.on("any-memory");
  cmd.out = a.str("out");
  cmd.plot = a.str("plot");
  if (!cmd.out.empty()) require_writable_file(cmd.out, "--out");
  if (!cmd.plot.empty()) require_png_output(cmd.plot, "--plot", "the plot is");
  cmd.precision = a.str("precision");
  parse_precision(cmd.precision);
  cmd.grad_reduce_dtype = a.str("grad-reduce-dtype");
  TrainOptions check;
  check.grad_reduce_dtype = cmd.grad_reduce_dtype;
  check.grad_reduce_wire();  // its error names the value
  if (!cmd.plot.empty()) require_gnuplot("--plot");  // before the search, not after it
  return cmd;
}

// The most tensor sizings a search may need (LayoutSearch::work): 2.5x that of the largest search the
// benchmark makes (Mixtral 8x22B over 8192 H100s: 2e7, about 7 s here); a 10^4-layer Mixtral on 64
// devices would need 6e8 and is refused in a third of a second instead of running for minutes.
constexpr double kMaxSearchWork = 5e7;

std::vector<int> choices(int fixed_value, std::vector<int> all) {
  return fixed_value >= 0 ? std::vector<int>{fixed_value} : all;
}

// A layout without its ZeRO stage and CP mechanism: what decides compute (the mesh, micro-batch,
// recomputation), with the lower bound of its step time.
struct Shape {
  int tp, cp, pp, vpp, ep, etp, mb, recompute;  // recompute: index into LayoutSearch's recompute_modes
  int vocab;                                    // vocabulary parallelism (1) or not
  double bound;
  int sp = 0;                                   // sequence parallelism (1) or not
};

// What a search found: the best layouts that fit, best first, and how many it counted.
struct SearchResult {
  std::vector<Candidate> found;  // the best `top`
  int64_t layouts = 0, evaluated = 0, accepted = 0, fitting = 0;
  std::map<std::string, int64_t> refusals;  // why the runtime refused layouts: how many for each reason
  double search_s = 0;
};

// The layout search of one plan command. Every layout of the devices: first its shape, with its
// lower bound (add_shapes); ZeRO stage and CP mechanism are expanded when it is evaluated
// (evaluate_shapes).
class LayoutSearch {
 public:
  explicit LayoutSearch(const PlanCommand& cmd)
      : cmd_(cmd), model_(cmd.cfg, cmd.cluster, cmd.devices, 0, cmd.skew),
        recompute_modes_(cmd.fixed.recompute.empty() ? std::vector<std::string>{"none", "selective", "full"}
                                                     : std::vector<std::string>{cmd.fixed.recompute}) {
    base_.global_batch = cmd.global_batch;
    base_.seq_len = cmd.seq_len;
    base_.precision = cmd.precision;
    base_.grad_reduce_dtype = cmd.grad_reduce_dtype;
    base_.data = "plan";  // not read: validate() only asks that there is one
    base_.threads = std::max(1, cmd.cluster.threads_per_rank);  // (the memory check's: each thread's attention scratch)
  }

  // First with `counting` (the meshes and splits only, nothing sized: work() before anything is built),
  // then to build the shapes.
  void add_shapes(bool counting);
  double work() const;
  void evaluate_shapes();
  SearchResult& result() { return result_; }
  int64_t num_tensors() const { return model_.num_tensors(); }

 private:
  void add_shapes_of_mesh(int tp, int cp, int pp);
  void evaluate(const Shape& shape);
  TrainOptions options(const Shape& shape) const;
  std::vector<int> zero_choices(int dp, int cp, int edp, int vocab) const;
  int expert_dp(int stage, const Shape& shape) const;
  std::vector<int> vocab_choices(int pp) const;
  void add_shapes_of_split(Shape shape, int dp, int stage);
  std::vector<int> sharding_choices(int ep, int edp) const;
  std::vector<std::string> comm_choices(int tp, int cp) const;

  const PlanCommand& cmd_;
  CostModel model_;
  const std::vector<std::string> recompute_modes_;
  TrainOptions base_;
  std::vector<Shape> shapes_;
  SearchResult result_;
  bool counting_ = false;
  int64_t meshes_ = 0;                            // TP, CP, PP, VPP, EP, ETP combinations (DP follows)
  std::set<std::tuple<int, int, int>> splits_;  // (pp, vpp, ep)
};

TrainOptions LayoutSearch::options(const Shape& shape) const {
  TrainOptions o = base_;
  o.tp = shape.tp, o.cp = shape.cp, o.pp = shape.pp, o.vpp = shape.vpp, o.ep = shape.ep, o.etp = shape.etp;
  o.micro_batch = shape.mb;
  o.recompute = recompute_modes_[size_t(shape.recompute)];
  o.vocab_parallel = shape.vocab == 1;
  o.pp_layers = cmd_.fixed.pp_layers;
  o.sequence_parallel = shape.sp == 1;
  return o;
}

// The experts' data-parallel ranks of a stage of `stage` ranks (1 for a dense model: no experts to shard).
int LayoutSearch::expert_dp(int stage, const Shape& shape) const {
  return cmd_.cfg.is_moe() ? stage / (shape.ep * shape.etp) : 1;
}

// ZeRO shards over DP x CP, and the experts' state over EDP: with neither above one rank, only ZeRO 0.
std::vector<int> LayoutSearch::zero_choices(int dp, int cp, int edp, int vocab) const {
  const std::vector<int> all = dp * cp == 1 && edp == 1 ? std::vector<int>{0}
                               : vocab                  ? std::vector<int>{0, 1}
                                                        : std::vector<int>{0, 1, 2, 3};
  return choices(cmd_.fixed.zero, all);  // (vocabulary parallelism takes ZeRO 0 and 1: a fixed 2 or 3 is refused)
}

// Vocabulary parallelism (1) beside none (0) where there is a pipeline (only there, when --layout asks for vocab).
std::vector<int> LayoutSearch::vocab_choices(int pp) const {
  if (cmd_.fixed.vocab == 1) return pp > 1 ? std::vector<int>{1} : std::vector<int>{};
  return choices(cmd_.fixed.vocab, pp > 1 ? std::vector<int>{0, 1} : std::vector<int>{0});
}

// The experts' sharding: EP (0), FSSDP (1) and FSSDP keeping what it gathers until the update (2),
// FSSDP only where the experts are not split over EP and EDP has several ranks (only there, when
// --layout asks for fssdp or fssdp-keep).
std::vector<int> LayoutSearch::sharding_choices(int ep, int edp) const {
  const bool possible = cmd_.cfg.is_moe() && ep == 1 && edp > 1;
  if (cmd_.fixed.fssdp >= 1) return possible ? std::vector<int>{cmd_.fixed.fssdp} : std::vector<int>{};
  return choices(cmd_.fixed.fssdp, possible ? std::vector<int>{0, 1, 2} : std::vector<int>{0});
}

// The all-to-all splits a rank's heads over CP (Ulysses): offered when they divide.
std::vector<std::string> LayoutSearch::comm_choices(int tp, int cp) const {
  return !cmd_.fixed.cp_comm.empty() ? std::vector<std::string>{cmd_.fixed.cp_comm}
         : cp > 1 && cmd_.cfg.num_heads / tp % cp == 0 ? std::vector<std::string>{"p2p", "a2a"}
                                                       : std::vector<std::string>{"p2p"};
}

void LayoutSearch::add_shapes(bool counting) {
  counting_ = counting, meshes_ = 0, splits_.clear();
  const ModelConfig& cfg = cmd_.cfg;
  const Fixed& fixed = cmd_.fixed;
  // TP splits the heads (validate() refuses any other degree, and would be asked a million times).
  const std::vector<int> dev_div = divisors(cmd_.devices);
  std::vector<int> tp_div;
  for (int tp : dev_div)
    if (cfg.num_heads % tp == 0 && cfg.num_kv_heads % tp == 0) tp_div.push_back(tp);
  for (int tp : choices(fixed.tp, tp_div))
    for (int cp : choices(fixed.cp, dev_div))
      for (int pp : choices(fixed.pp, dev_div)) {
        if (cmd_.devices % (int64_t(tp) * cp * pp) != 0 || pp > cfg.num_layers) continue;
        if ((fixed.sp == 1 && tp == 1) || (!fixed.cp_comm.empty() && cp == 1)) continue;  // (what the word needs)
        if (fixed.dp >= 0 && cmd_.devices / (int64_t(tp) * cp * pp) != fixed.dp) continue;
        add_shapes_of_mesh(tp, cp, pp);
      }
}

// The shapes of TP x CP x PP (DP the rest of the devices); one the cost model refuses is counted as
// evaluated, with all its expansions.
void LayoutSearch::add_shapes_of_mesh(int tp, int cp, int pp) {
  const ModelConfig& cfg = cmd_.cfg;
  const Fixed& fixed = cmd_.fixed;
  const int dp = cmd_.devices / (tp * cp * pp), stage = cmd_.devices / pp;
  for (int vpp : choices(fixed.vpp, pp > 1 ? std::vector<int>{1, 2} : std::vector<int>{1}))
    for (int ep : choices(fixed.ep, cfg.is_moe() ? divisors(cfg.num_experts) : std::vector<int>{1}))
      for (int etp : choices(fixed.etp, cfg.is_moe() ? divisors(stage) : std::vector<int>{1})) {
        if (int64_t(ep) * etp > stage || stage % (ep * etp) != 0) continue;  // the experts' mesh must cover a stage's ranks
        if (cfg.is_moe() && cfg.num_experts % ep != 0) continue;            // (a fixed ep: each rank whole experts)
        ++meshes_, splits_.insert({pp, vpp, ep});
        if (counting_) continue;
        for (int vocab : vocab_choices(pp))
          for (int sp : choices(fixed.sp, tp > 1 ? std::vector<int>{1, 0} : std::vector<int>{0}))
            add_shapes_of_split({tp, cp, pp, vpp, ep, etp, 0, 0, vocab, 0, sp}, dp, stage);
      }
}

// The shapes of one mesh and split: every micro-batch and recomputation mode; a split whose layers do
// not divide over its stages is refused with all of them.
void LayoutSearch::add_shapes_of_split(Shape shape, int dp, int stage) {
  const int edp = expert_dp(stage, shape);
  const int64_t expansions = int64_t(zero_choices(dp, shape.cp, edp, shape.vocab).size() *
                                     comm_choices(shape.tp, shape.cp).size() * sharding_choices(shape.ep, edp).size());
  const std::vector<int> mbs = choices(int(cmd_.fixed.mb), divisors(std::max<int64_t>(cmd_.global_batch / dp, 1)));
  const int64_t all = expansions * int64_t(mbs.size() * recompute_modes_.size());
  if (const std::string* why = model_.split_refusal(options(shape))) {  // its layers do not split over the stages
    result_.layouts += all, result_.evaluated += all;
    result_.refusals[*why] += all;
    return;
  }
  for (int mb : mbs)
    for (int rc = 0; rc < int(recompute_modes_.size()); ++rc) {
      shape.mb = mb, shape.recompute = rc;
      result_.layouts += expansions;
      shape.bound = model_.step_bound(options(shape));  // (its split is known to divide the layers)
      shapes_.push_back(shape);
    }
}

// The search's work, known before it starts: predicting a layout's memory sizes every tensor of its
// stages (rank_buffers, kept per mesh: about the model's tensors per mesh), and building the tables
// of a (pipeline, EP) split visits the model's tensors once per stage. Deep or wide models multiply
// it (10^4 layers: 10^5 tensors per mesh), so the search is bounded in this work, not in the values.
double LayoutSearch::work() const {
  double stages = 0;
  for (const auto& [pp, vpp, ep] : splits_) stages += pp;
  return double(model_.num_tensors()) * (double(meshes_) + stages);
}

// Best bound first; a layout whose bound is above the K-th best prediction cannot enter the list,
// nor can any after it.
void LayoutSearch::evaluate_shapes() {
  std::sort(shapes_.begin(), shapes_.end(), [](const Shape& x, const Shape& y) { return x.bound < y.bound; });
  const std::vector<Candidate>& found = result_.found;
  for (const Shape& shape : shapes_) {
    if (int64_t(found.size()) >= cmd_.top && shape.bound > found.back().p.step_s) break;
    evaluate(shape);
  }
}

// Predicts the shape with each ZeRO stage and CP mechanism, and keeps those among the best that fit.
void LayoutSearch::evaluate(const Shape& shape) {
  auto better = [](const Candidate& x, const Candidate& y) {  // faster; when as fast, less memory
    return x.p.step_s != y.p.step_s ? x.p.step_s < y.p.step_s : x.p.memory.total() < y.p.memory.total();
  };
  SearchResult& r = result_;
  const int edp = expert_dp(cmd_.devices / shape.pp, shape);
  for (int zero : zero_choices(cmd_.devices / (shape.tp * shape.cp * shape.pp), shape.cp, edp, shape.vocab))
    for (const std::string& comm : comm_choices(shape.tp, shape.cp))
      for (int fssdp : sharding_choices(shape.ep, edp)) {
        Candidate c{options(shape), {}};
        c.o.zero = zero, c.o.cp_comm = comm, c.o.expert_sharding = fssdp ? "fssdp" : "ep", c.o.fssdp_keep = fssdp == 2;
        ++r.evaluated;
        try {
          c.p = model_.predict(c.o, cmd_.any_memory ? std::numeric_limits<double>::infinity() : cmd_.cluster.memory_bytes);
        } catch (const Error& e) {
          ++r.refusals[e.what()];
          continue;  // a layout the runtime refuses
        }
        ++r.accepted;
        if (!c.p.fits) continue;
        ++r.fitting;
        r.found.insert(std::upper_bound(r.found.begin(), r.found.end(), c, better), std::move(c));
        if (int64_t(r.found.size()) > cmd_.top) r.found.pop_back();
      }
}

// Why --layout leaves no layout to evaluate: the first rule its fixed axes break.
std::string why_no_layout(const PlanCommand& cmd) {
  const Fixed& f = cmd.fixed;
  const ModelConfig& cfg = cmd.cfg;
  const int n = cmd.devices;
  auto divides = [](int64_t x, int64_t y) { return x >= 1 && y % x == 0; };
  if (f.tp >= 0 && !(divides(f.tp, n) && divides(f.tp, cfg.num_heads) && divides(f.tp, cfg.num_kv_heads)))
    return cat("tp", f.tp, ": TP must divide the devices (", n, ") and the model's ", cfg.num_heads, " heads and ",
               cfg.num_kv_heads, " key-value heads");
  if (f.cp >= 0 && !divides(f.cp, n)) return cat("cp", f.cp, ": CP must divide the devices (", n, ")");
  if (f.pp >= 0 && !(divides(f.pp, n) && f.pp <= cfg.num_layers))
    return cat("pp", f.pp, ": PP must divide the devices (", n, ") and be at most the model's ", cfg.num_layers, " layers");
  if (f.dp >= 0 && !divides(f.dp, n)) return cat("dp", f.dp, ": DP must divide the devices (", n, ")");
  // (a degree above 1 the devices allow, where the word does not fix it)
  auto some_above_one = [&](int fixed, int limit) {
    if (fixed >= 0) return fixed > 1;
    for (int d = 2; d <= std::min(n, limit); ++d)
      if (n % d == 0) return true;
    return false;
  };
  if (f.sp == 1 && !some_above_one(f.tp, int(std::min<int64_t>(cfg.num_heads, INT32_MAX))))
    return "sp: sequence parallelism splits over TP: it needs tp2 or more";
  if (!f.cp_comm.empty() && f.cp == 1) return cat("cp-comm=", f.cp_comm, ": CP's exchange needs cp2 or more");
  if (!cfg.is_moe() && (f.ep > 1 || f.etp > 1 || f.fssdp >= 1)) return "ep, etp and fssdp need an MoE model";
  if (f.ep >= 0 && cfg.is_moe() && !divides(f.ep, cfg.num_experts))
    return cat("ep", f.ep, ": EP must divide the model's ", cfg.num_experts, " experts");
  if (f.vocab == 1 && !some_above_one(f.pp, int(std::min<int64_t>(cfg.num_layers, INT32_MAX))))
    return "vocab: vocabulary parallelism needs a pipeline (pp2 or more)";
  if (f.fssdp >= 1 && f.ep > 1)
    return cat("fssdp replaces EP (it shards the experts over a stage's ranks): drop ep", f.ep, " or give ep1");
  return cat("tp x cp x dp x pp must be the ", n, " devices, ep x etp must divide a stage's ranks, and fssdp needs more "
             "than one rank beside them (EDP)");
}

// The reasons most layouts were refused for, most first ("2000 layouts: REASON; 1000: REASON"): one
// refused layout's reason can be a rule of an axis the others do not share (a pipeline split).
std::string common_refusals(const std::map<std::string, int64_t>& refusals) {
  std::vector<std::pair<int64_t, std::string>> by_count;
  for (const auto& [why, n] : refusals) by_count.emplace_back(n, why);
  std::stable_sort(by_count.begin(), by_count.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::string out;
  for (size_t i = 0; i < std::min<size_t>(by_count.size(), 2); ++i)
    out += cat(i ? "; " : "", by_count[i].first, i ? "" : by_count[i].first == 1 ? " layout" : " layouts", ": ",
               by_count[i].second);
  if (by_count.size() > 2) out += cat(" (and ", by_count.size() - 2, by_count.size() == 3 ? " other reason)" : " other reasons)");
  return out;
}

// The search, timed; an Error when no layout is accepted or none fits.
SearchResult search_layouts(const PlanCommand& cmd) {
  const auto t0 = std::chrono::steady_clock::now();
  LayoutSearch search(cmd);
  search.add_shapes(true);
  const double work = search.work();
  ORIGAMI_CHECK(work <= kMaxSearchWork, "this search would size about ", std::setprecision(2), work, " tensors (",
                cmd.cfg.model_type(), " with ", search.num_tensors(), " tensors, over every layout of ", cmd.devices,
                " devices); the limit is ", kMaxSearchWork, ": fix axes with --layout (for example \"pp8 ep8\") or plan "
                "fewer --devices");
  search.add_shapes(false);
  search.evaluate_shapes();
  SearchResult r = std::move(search.result());
  r.search_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool with_layout = !cmd.layout.empty();
  ORIGAMI_CHECK(r.evaluated > 0, "--layout '", cmd.layout, "' leaves no layout of ", cmd.devices, " devices: ",
                why_no_layout(cmd));
  const std::string of_layout = with_layout ? " of --layout '" + cmd.layout + "'" : "";
  ORIGAMI_CHECK(r.accepted > 0 || r.evaluated > 1, "the runtime refuses the one layout", of_layout, ": ",
                r.refusals.begin()->first);
  ORIGAMI_CHECK(r.accepted > 0, "the runtime accepts none of the ", r.evaluated, " layouts", of_layout, "; ",
                common_refusals(r.refusals));
  ORIGAMI_CHECK(!r.found.empty(), "none of the ", r.accepted, " layouts the runtime accepts",
                with_layout ? " with --layout '" + cmd.layout + "'" : "", " fits in ", format_bytes(cmd.cluster.memory_bytes),
                " per device; more devices, a shorter --seq-len, fewer axes fixed by --layout, or a cluster with more memory");
  return r;
}

void print_json(const PlanCommand& cmd, const std::vector<Candidate>& found) {
  nlohmann::json list = nlohmann::json::array();
  for (const Candidate& c : found) {
    nlohmann::json j = c.p.as_json();
    j["layout"] = layout_name(c.o, cmd.devices);
    if (cmd.cfg.is_moe()) j["imbalance"] = cmd.skew.at(c.o.ep);  // what its expert rows were priced at
    list.push_back(j);
  }
  std::printf("%s\n", list.dump(2).c_str());
}

void print_table(const PlanCommand& cmd, const SearchResult& r) {
  std::printf("%s %s on %d devices of %s: global batch %lld x %lld tokens; %lld layouts, %lld evaluated (the rest "
              "cannot enter the top %lld: their compute and pipeline fill alone take longer), %lld of them the runtime accepts, "
              "%lld fit (%.2f s)\n\n", cmd.cfg.model_type().c_str(), cmd.precision.c_str(), cmd.devices, cmd.cluster.name.c_str(),
              (long long)cmd.global_batch, (long long)cmd.seq_len, (long long)r.layouts, (long long)r.evaluated,
              (long long)cmd.top, (long long)r.accepted, (long long)r.fitting, r.search_s);
  if (cmd.cfg.is_moe()) std::printf("routing imbalance (--imbalance): %s\n\n", cmd.skew.describe().c_str());
  std::printf("| layout | step s | tokens/s | MFU | memory per rank (largest) | compute s | bubble s | exposed comm s | dominant |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const Candidate& c : r.found) {
    std::string exposed;
    for (const auto& [axis, s] : c.p.exposed_s)
      if (s > 0) exposed += cat(exposed.empty() ? "" : ", ", axis, " ", s);
    std::printf("| %s | %.4g | %.4g | %.1f%% | %s (%s) | %.4g | %.4g | %s | %s |\n", layout_name(c.o, cmd.devices).c_str(),
                c.p.step_s, c.p.tokens_per_s, 100 * c.p.mfu, format_bytes(double(c.p.memory.total())).c_str(),
                c.p.memory.describe().c_str(), c.p.compute_s, c.p.bubble_s, exposed.empty() ? "-" : exposed.c_str(),
                c.p.dominant.c_str());
  }
}

// Each listed layout's step time by part, largest first.
void print_breakdowns(const PlanCommand& cmd, const std::vector<Candidate>& found) {
  for (const Candidate& c : found) {
    std::printf("\n%s: step %.4g s, MFU %.1f%%\n", layout_name(c.o, cmd.devices).c_str(), c.p.step_s, 100 * c.p.mfu);
    std::vector<std::pair<std::string, double>> parts = c.p.breakdown();
    std::stable_sort(parts.begin(), parts.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
    for (const auto& [name, seconds] : parts)
      if (seconds > 0) std::printf("  %-24s %10.4g s  %5.1f%%\n", name.c_str(), seconds, 100 * seconds / c.p.step_s);
  }
}

// The best layout as `origami train` options (train --plan reads them).
void write_plan_file(const PlanCommand& cmd, const Candidate& best) {
  const TrainOptions& b = best.o;
  nlohmann::json layout = {{"tp", b.tp}, {"cp", b.cp}, {"cp-comm", b.cp_comm}, {"ep", b.ep}, {"etp", b.etp},
                                 {"expert-sharding", b.expert_sharding}, {"fssdp-keep", b.fssdp_keep},
                                 {"pp", b.pp}, {"vpp", b.vpp}, {"vocab-parallel", b.vocab_parallel}, {"zero", b.zero},
                                 {"micro-batch", b.micro_batch},
                                 {"global-batch", b.global_batch}, {"seq-len", b.seq_len}, {"recompute", b.recompute},
                                 {"sequence-parallel", b.sequence_parallel}, {"precision", b.precision},
                                 {"grad-reduce-dtype", b.grad_reduce_dtype}};
  if (!b.pp_layers.empty()) layout["pp-layers"] = join_layers(b.pp_layers);
  if (!cmd.cfg.is_moe())  // (train refuses expert options for a model without experts)
    for (const char* key : {"ep", "etp", "expert-sharding", "fssdp-keep"}) layout.erase(key);
  // (the model too, whose config train --plan compares with its own, and the threads a rank the
  // prediction priced, which it compares with its own)
  nlohmann::json plan = {{"layout", layout}, {"description", layout_name(b, cmd.devices)}, {"devices", cmd.devices},
                         {"model", cmd.cfg.math_fields()}, {"cluster", cmd.cluster.name},
                         {"prediction", best.p.as_json()}};
  if (cmd.cluster.threads_per_rank > 0) plan["threads_per_rank"] = cmd.cluster.threads_per_rank;  // (stated: a CPU's)
  write_file_atomically(cmd.out, plan.dump(2) + "\n");
}

void plot_layouts(const PlanCommand& cmd, const std::vector<Candidate>& found) {
  std::vector<PlotRow> rows;
  for (const Candidate& c : found)
    rows.push_back({layout_name(c.o, cmd.devices), c.p.compute_s, c.p.bubble_s, c.p.exposed_s});
  plot_step_breakdown(rows, cat(cmd.cfg.model_type(), " on ", cmd.devices, " devices of ", cmd.cluster.name,
                                ": global batch ", cmd.global_batch, " x ", cmd.seq_len, " tokens, predicted step time"),
                      cmd.plot);
}

int run_plan(const PlanCommand& cmd) {
  const SearchResult r = search_layouts(cmd);
  if (cmd.json) print_json(cmd, r.found);
  else print_table(cmd, r);
  if (cmd.explain && !cmd.json) print_breakdowns(cmd, r.found);
  if (!cmd.out.empty()) write_plan_file(cmd, r.found.front());
  if (!cmd.plot.empty()) plot_layouts(cmd, r.found);
  return 0;
}

}  // namespace

int cmd_plan(int argc, char** argv) {
  const std::optional<PlanCommand> cmd = parse_plan_options(argc, argv);
  return cmd ? run_plan(*cmd) : 0;
}

}  // namespace origami
