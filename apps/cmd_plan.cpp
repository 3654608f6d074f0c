// origami plan: predicts step time, memory and MFU of training layouts on a cluster, searches the
// layouts the runtime accepts, and prints the best (plan/cost_model.h).
//
//   origami plan --config HF_CONFIG --cluster cluster.json --devices N --global-batch G --seq-len T
//                [--layout "tp2 cp1 ep8 etp1 pp4 vpp1 zero1 mb1 recompute=selective sp cp-comm=a2a"]
//                [--top K] [--json] [--out plan.json] [--plot FILE.png]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/files.h"
#include "core/memory.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/plot.h"
#include "train/trainer.h"

namespace origami {
namespace {

// The axes --layout fixes; -1 (or empty): searched.
struct Fixed {
  int tp = -1, cp = -1, ep = -1, etp = -1, pp = -1, vpp = -1, zero = -1, sp = -1;
  int64_t mb = -1;
  std::string recompute, cp_comm;
};

Fixed parse_layout(const std::string& spec) {
  Fixed f;
  std::istringstream in(spec);
  for (std::string w; in >> w;) {
    auto number = [&](size_t skip, int64_t least = 1) {
      const std::string digits = w.substr(skip);
      ORIGAMI_CHECK(!digits.empty() && digits.size() < 10 && std::all_of(digits.begin(), digits.end(), ::isdigit) &&
                        std::stoll(digits) >= least,
                    "--layout: '", w, "' needs an integer of at least ", least, " after '", w.substr(0, skip), "'");
      return std::stoll(digits);
    };
    if (w.rfind("recompute=", 0) == 0) f.recompute = w.substr(10), parse_recompute(f.recompute);
    else if (w.rfind("cp-comm=", 0) == 0) f.cp_comm = w.substr(8), parse_cp_comm(f.cp_comm);
    else if (w == "sp") f.sp = 1;
    else if (w == "nosp") f.sp = 0;
    else if (w.rfind("etp", 0) == 0) f.etp = int(number(3));
    else if (w.rfind("tp", 0) == 0) f.tp = int(number(2));
    else if (w.rfind("cp", 0) == 0) f.cp = int(number(2));
    else if (w.rfind("ep", 0) == 0) f.ep = int(number(2));
    else if (w.rfind("vpp", 0) == 0) f.vpp = int(number(3));
    else if (w.rfind("pp", 0) == 0) f.pp = int(number(2));
    else if (w.rfind("mb", 0) == 0) f.mb = number(2);
    else if (w.rfind("zero", 0) == 0) f.zero = int(number(4, 0));
    else fail("--layout: '", w, "' is not one of tpN cpN epN etpN ppN vppN zeroN mbN sp nosp recompute=MODE cp-comm=MODE");
  }
  ORIGAMI_CHECK(f.zero == -1 || (f.zero >= 0 && f.zero <= 2), "--layout: zero must be 0, 1 or 2, got ", f.zero);
  return f;
}

std::vector<int> divisors(int64_t n) {
  std::vector<int> d;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(int(k));
  return d;
}

std::string layout_name(const TrainOptions& o, int devices) {
  const MeshDims d = o.layout_dims(devices);
  std::string s = cat("tp", o.tp, " cp", o.cp, " dp", d.dp, " pp", o.pp);
  if (o.vpp > 1) s += cat(" vpp", o.vpp);
  if (o.ep > 1 || o.etp > 1) s += cat(" ep", o.ep, " etp", o.etp);
  s += cat(" zero", o.zero, " mb", o.micro_batch);
  if (o.sequence_parallel) s += " sp";
  if (o.cp > 1) s += " cp-comm=" + o.cp_comm;
  if (o.recompute != "none") s += " recompute=" + o.recompute;
  return s;
}

struct Candidate {
  TrainOptions o;
  Prediction p;
};

}  // namespace

int cmd_plan(int argc, char** argv) {
  Args a("plan",
         "Predict step time, memory per rank and MFU of training layouts (TP, CP, EP, ETP, DP with ZeRO, PP\n"
         "and VPP, micro-batch, sequence parallelism, recomputation) on a cluster, and list the best that fit.\n"
         "Step time, memory and communication come from the runtime's own functions and the cluster's\n"
         "measured or documented rates (DESIGN.md, \"Planner\").");
  a.option("config", "FILE", "model config.json (Hugging Face)")
      .option("cluster", "FILE", "cluster.json (configs/clusters/, or written by 'origami profile')")
      .option("devices", "N", "ranks of the run (default: every device of the cluster)")
      .option("global-batch", "G", "rows per optimizer step")
      .option("seq-len", "T", "tokens per row")
      .option("layout", "AXES", "fix these axes and search the rest, e.g. \"tp2 pp4 zero1 mb1 recompute=selective\"")
      .option("top", "K", "layouts to print", "10")
      .option("imbalance", "X", "MoE: the busiest EP rank's routed rows over the mean", "1.0")
      .flag("json", "print a JSON list, best first")
      .option("out", "FILE", "write the best layout as a plan file (its options and prediction)")
      .option("plot", "FILE.png", "draw the predicted step time breakdown of the listed layouts (gnuplot)");
  if (!a.parse(argc, argv)) return 0;
  for (const char* required : {"config", "cluster", "global-batch", "seq-len"})
    ORIGAMI_CHECK(a.has(required), "--", required, " is required (see 'origami plan --help')");
  const ModelConfig cfg = load_model_config(a.str("config"));
  const Cluster cluster = Cluster::load(a.str("cluster"));
  const int devices = a.has("devices") ? int(a.integer("devices")) : cluster.devices();
  ORIGAMI_CHECK(devices >= 1 && devices <= cluster.devices(), "--devices must be in [1, ", cluster.devices(),
                "] (the cluster's devices), got ", devices);
  const int64_t G = a.integer("global-batch"), T = a.integer("seq-len"), top = a.integer("top");
  ORIGAMI_CHECK(G >= 1 && T >= 1 && top >= 1, "--global-batch, --seq-len and --top must be positive");
  const double imbalance = a.number("imbalance");
  ORIGAMI_CHECK(imbalance >= 1, "--imbalance is the busiest rank's rows over the mean: at least 1, got ", imbalance);
  const Fixed fixed = parse_layout(a.str("layout"));
  if (a.has("plot")) require_gnuplot();
  auto choices = [](int fixed_value, std::vector<int> all) { return fixed_value >= 0 ? std::vector<int>{fixed_value} : all; };

  const auto t0 = std::chrono::steady_clock::now();
  TrainOptions base;
  base.global_batch = G;
  base.seq_len = T;
  base.data = "plan";  // not read: validate() only asks that there is one
  CostModel model(cfg, cluster, devices, 0, imbalance);
  const std::vector<std::string> recompute_modes = fixed.recompute.empty()
      ? std::vector<std::string>{"none", "selective", "full"} : std::vector<std::string>{fixed.recompute};
  // Every layout of the devices: first what decides compute (the mesh, micro-batch, recomputation),
  // each with its lower bound; ZeRO stage and CP mechanism are expanded when it is evaluated.
  struct Shape {
    int tp, cp, pp, vpp, ep, etp, mb, recompute;  // recompute: index into recompute_modes
    double bound;
    TrainOptions options(const TrainOptions& base, const std::vector<std::string>& modes, int sp) const {
      TrainOptions o = base;
      o.tp = tp, o.cp = cp, o.pp = pp, o.vpp = vpp, o.ep = ep, o.etp = etp, o.micro_batch = mb;
      o.recompute = modes[size_t(recompute)];
      o.sequence_parallel = sp >= 0 ? sp == 1 && tp > 1 : tp > 1;
      return o;
    }
  };
  auto zero_choices = [&](int dp, int cp) { return choices(fixed.zero, dp * cp > 1 ? std::vector<int>{0, 1, 2} : std::vector<int>{0}); };
  // The all-to-all splits a rank's heads over CP (Ulysses): offered when they divide.
  auto comm_choices = [&](int tp, int cp) {
    return !fixed.cp_comm.empty() ? std::vector<std::string>{fixed.cp_comm}
           : cp > 1 && cfg.num_heads / tp % cp == 0 ? std::vector<std::string>{"p2p", "a2a"}
                                                    : std::vector<std::string>{"p2p"};
  };
  std::vector<Shape> shapes;
  int64_t layouts = 0, evaluated = 0, accepted = 0, fitting = 0;
  std::string first_refusal;  // why the runtime refused the first layout it refused
  // TP splits the heads (validate() refuses any other degree, and would be asked a million times).
  const std::vector<int> dev_div = divisors(devices);
  std::vector<int> tp_div;
  for (int tp : dev_div)
    if (cfg.num_heads % tp == 0 && cfg.num_kv_heads % tp == 0) tp_div.push_back(tp);
  for (int tp : choices(fixed.tp, tp_div))
    for (int cp : choices(fixed.cp, dev_div))
      for (int pp : choices(fixed.pp, dev_div)) {
        if (devices % (int64_t(tp) * cp * pp) != 0 || pp > cfg.num_layers) continue;
        const int dp = devices / (tp * cp * pp), stage = devices / pp;
        const int64_t expansions = int64_t(zero_choices(dp, cp).size() * comm_choices(tp, cp).size());
        for (int vpp : choices(fixed.vpp, pp > 1 ? std::vector<int>{1, 2} : std::vector<int>{1}))
          for (int ep : choices(fixed.ep, cfg.is_moe() ? divisors(cfg.num_experts) : std::vector<int>{1}))
            for (int etp : choices(fixed.etp, cfg.is_moe() ? divisors(stage) : std::vector<int>{1})) {
              if (stage % (ep * etp) != 0) continue;  // the experts' mesh must cover a stage's ranks
              for (int mb : choices(int(fixed.mb), divisors(std::max<int64_t>(G / dp, 1))))
                for (int rc = 0; rc < int(recompute_modes.size()); ++rc) {
                  Shape shape{tp, cp, pp, vpp, ep, etp, mb, rc, 0};
                  layouts += expansions;
                  try {
                    shape.bound = model.step_bound(shape.options(base, recompute_modes, fixed.sp));
                    shapes.push_back(shape);
                  } catch (const Error& e) {  // its layers do not split over the stages: refused
                    evaluated += expansions;
                    if (first_refusal.empty()) first_refusal = e.what();
                  }
                }
            }
      }
  // Best bound first; a layout whose bound is above the K-th best prediction cannot enter the list,
  // nor can any after it.
  std::sort(shapes.begin(), shapes.end(), [](const Shape& x, const Shape& y) { return x.bound < y.bound; });
  auto better = [](const Candidate& x, const Candidate& y) {  // faster; when as fast, less memory
    return x.p.step_s != y.p.step_s ? x.p.step_s < y.p.step_s : x.p.memory.total() < y.p.memory.total();
  };
  std::vector<Candidate> found;  // the best `top`, best first
  for (const Shape& shape : shapes) {
    if (int64_t(found.size()) >= top && shape.bound > found.back().p.step_s) break;
    for (int zero : zero_choices(devices / (shape.tp * shape.cp * shape.pp), shape.cp))
      for (const std::string& comm : comm_choices(shape.tp, shape.cp)) {
        Candidate c{shape.options(base, recompute_modes, fixed.sp), {}};
        c.o.zero = zero, c.o.cp_comm = comm;
        ++evaluated;
        try {
          c.p = model.predict(c.o, cluster.memory_bytes);
        } catch (const Error& e) {
          if (first_refusal.empty()) first_refusal = e.what();
          continue;  // a layout the runtime refuses
        }
        ++accepted;
        if (!c.p.fits) continue;
        ++fitting;
        found.insert(std::upper_bound(found.begin(), found.end(), c, better), std::move(c));
        if (int64_t(found.size()) > top) found.pop_back();
      }
  }
  const double search_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ORIGAMI_CHECK(accepted > 0, "the runtime accepts none of the ", evaluated, " layouts",
                a.has("layout") ? " of --layout '" + a.str("layout") + "'" : "", "; the first refused: ", first_refusal);
  ORIGAMI_CHECK(!found.empty(), "none of the ", accepted, " layouts the runtime accepts",
                a.has("layout") ? " with --layout '" + a.str("layout") + "'" : "", " fits in ",
                format_bytes(cluster.memory_bytes), " per device; more devices, a smaller --global-batch or --seq-len, "
                "or a cluster with more memory");
  if (a.on("json")) {
    nlohmann::json list = nlohmann::json::array();
    for (const Candidate& c : found) {
      nlohmann::json j = c.p.as_json();
      j["layout"] = layout_name(c.o, devices);
      list.push_back(j);
    }
    std::printf("%s\n", list.dump(2).c_str());
  } else {
    std::printf("%s on %d devices of %s: global batch %lld x %lld tokens; %lld layouts, %lld evaluated (the rest "
                "cannot enter the top %lld: their compute and pipeline fill alone take longer), %lld of them the runtime accepts, "
                "%lld fit (%.2f s)\n\n", cfg.model_type().c_str(), devices, cluster.name.c_str(), (long long)G,
                (long long)T, (long long)layouts, (long long)evaluated, (long long)top, (long long)accepted,
                (long long)fitting, search_s);
    std::printf("| layout | step s | tokens/s | MFU | memory per rank (largest) | compute s | bubble s | exposed comm s | dominant |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    for (const Candidate& c : found) {
      std::string exposed;
      for (const auto& [axis, s] : c.p.exposed_s)
        if (s > 0) exposed += cat(exposed.empty() ? "" : ", ", axis, " ", s);
      std::printf("| %s | %.4g | %.4g | %.1f%% | %s (%s) | %.4g | %.4g | %s | %s |\n", layout_name(c.o, devices).c_str(),
                  c.p.step_s, c.p.tokens_per_s, 100 * c.p.mfu, format_bytes(double(c.p.memory.total())).c_str(),
                  c.p.memory.describe().c_str(), c.p.compute_s, c.p.bubble_s, exposed.empty() ? "-" : exposed.c_str(),
                  c.p.dominant.c_str());
    }
  }
  if (a.has("out")) {  // the best layout as `origami train` options (train --plan reads them)
    const TrainOptions& b = found.front().o;
    const nlohmann::json layout = {{"tp", b.tp}, {"cp", b.cp}, {"cp-comm", b.cp_comm}, {"ep", b.ep}, {"etp", b.etp},
                                   {"pp", b.pp}, {"vpp", b.vpp}, {"zero", b.zero}, {"micro-batch", b.micro_batch},
                                   {"global-batch", b.global_batch}, {"seq-len", b.seq_len}, {"recompute", b.recompute},
                                   {"sequence-parallel", b.sequence_parallel}};
    const nlohmann::json plan = {{"layout", layout}, {"description", layout_name(b, devices)}, {"devices", devices},
                                 {"cluster", cluster.name}, {"prediction", found.front().p.as_json()}};
    write_file_atomically(a.str("out"), plan.dump(2) + "\n");
  }
  if (a.has("plot")) {
    std::vector<PlotRow> rows;
    for (const Candidate& c : found)
      rows.push_back({layout_name(c.o, devices), c.p.compute_s, c.p.bubble_s, c.p.exposed_s});
    plot_step_breakdown(rows, cat(cfg.model_type(), " on ", devices, " devices of ", cluster.name, ": global batch ", G,
                                  " x ", T, " tokens, predicted step time"), a.str("plot"));
  }
  return 0;
}

}  // namespace origami
