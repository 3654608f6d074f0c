#include "plan/cluster.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/json_fields.h"
#include "train/trainer.h"  // kMaxThreads

namespace origami {

namespace {

// A measured curve of (x, y) points, x ascending (not empty), at x: interpolated in log x, flat
// beyond its ends.
double interpolated(const std::vector<std::pair<double, double>>& curve, double x) {
  if (x <= curve.front().first) return curve.front().second;
  if (x >= curve.back().first) return curve.back().second;
  const auto hi = std::lower_bound(curve.begin(), curve.end(), std::make_pair(x, 0.0));
  const auto lo = hi - 1;
  const double f = (std::log(x) - std::log(lo->first)) / (std::log(hi->first) - std::log(lo->first));
  return lo->second + f * (hi->second - lo->second);
}

}  // namespace

double Cluster::gemm_rate(double M, double N, double K, bool accumulate) const {
  const double flops = 2 * M * N * K, traffic = element_bytes * (M * K + K * N + M * N);
  if (!gemm.empty()) {  // in-cache rates, and the operands streamed
    const double rate = accumulate && gemm_streaming_accumulating > 0 ? gemm_streaming_accumulating : gemm_streaming;
    return flops / (flops / interpolated(gemm, flops) + (rate > 0 ? traffic / rate : 0));
  }
  const double peak = peak_flops * (sms > 0 ? gemm_tile_share(M, N, sms) : 1.0);
  const double seconds = std::max(flops / peak, traffic / memory_bandwidth);
  return gemm_efficiency * flops / seconds;
}

double fit_streaming_rate(const std::vector<StreamedCall>& calls) {
  // d/dx Σ ((extra − bytes·x) / cold)² = 0 for x = 1/r.
  double bb = 0, bt = 0;
  for (const StreamedCall& c : calls) {
    const double w = 1 / (c.cold_s * c.cold_s);
    bb += w * c.bytes * c.bytes, bt += w * c.bytes * (c.cold_s - c.hot_s);
  }
  return bt > 0 ? bb / bt : 0;
}

double gemm_tile_share(double M, double N, int sms) {
  static constexpr double kTiles[][2] = {{256, 128}, {128, 256}, {128, 128}, {128, 64}, {64, 128}, {64, 64}};
  double best = 0;
  for (const auto& [tm, tn] : kTiles) {
    const double tiles = std::ceil(M / tm) * std::ceil(N / tn), waves = std::ceil(tiles / sms);
    const double useful = M * N / (waves * sms * tm * tn), reuse = std::min(1.0, tm * tn / (tm + tn) / 64);
    best = std::max(best, useful * reuse);
  }
  return best;
}

double Cluster::attention_rate(double T, double D) const {
  if (sms == 0) return attention_flops;  // a CPU: measured at the run's window and heads
  return attention_flops * T / (T + 128) * (D / (D + 32)) / (128.0 / 160);
}

Cluster Cluster::at(const std::string& precision) const {
  Cluster c = *this;
  if (precision == "bf16") {
    if (bf16) static_cast<ComputeRates&>(c) = *bf16;
    // A GPU's bf16 kernels read and write bf16 activations. origami's CPU kernels keep them in fp32
    // (the norms have no bf16 versions; pipeline messages carry fp32) and round GEMM operands.
    c.element_bytes = 2;
    c.rounds_operands = sms == 0;
  }
  return c;
}

double Cluster::overlap_of(const std::string& kind) const {
  const auto it = overlap.find(kind);
  if (it != overlap.end()) return it->second;
  return kind == "dp" || kind == "cp" ? comm_overlap : 0.0;
}

double Cluster::transfer_seconds(double bytes, double steps, bool inter_node, const std::string& collective,
                                 double step_bytes) const {
  const auto own = collectives.find(collective);
  const LinkTier& t = inter_node ? inter : own != collectives.end() ? own->second : intra;
  if (step_bytes <= 0) step_bytes = steps > 0 ? bytes / steps : bytes;
  const double bandwidth = t.bandwidth_at(step_bytes);
  ORIGAMI_ASSERT(bandwidth > 0);  // (a link the file has: the planner prices only the devices it describes)
  return steps * t.latency + bytes / bandwidth;
}

double LinkTier::bandwidth_at(double step_bytes) const {
  return by_size.empty() ? bandwidth : interpolated(by_size, step_bytes);
}

double Cluster::all_to_all_seconds(double bytes, double calls, int group, int in_node) const {
  if (group <= 1) return 0;
  const double message = bytes / (std::max(calls, 1.0) * (group - 1));  // to one peer in one call
  // A latency step per message, as `origami profile` fits it (its all-to-all's latency over n − 1 steps)
  if (in_node >= group) return transfer_seconds(bytes, calls * (group - 1), false, "all_to_all", message);
  const double local = bytes * double(in_node - 1) / double(group - 1),
               remote = bytes * double(group - in_node) / double(group - 1);
  const double local_s = local > 0 ? transfer_seconds(local, calls * (in_node - 1), false, "all_to_all", message) : 0.0;
  return std::max(local_s, transfer_seconds(remote, calls * (group - in_node), true, "all_reduce", message));
}

namespace {

// Devices a cluster may have: far beyond any machine, and nodes × devices_per_node fits an int.
constexpr int64_t kMaxNodes = int64_t(1) << 20, kMaxDevicesPerNode = 1024;

// A positive figure of the file, in its human unit, times `unit` (to SI).
double positive(const JsonField& f, double unit) { return f.number(NumberRange::positive()) * unit; }

// A link or collective: bandwidth and latency, and optionally the bandwidth by message size
// ([KiB per step, GB/s] pairs, both positive, sizes ascending).
LinkTier link_of(const JsonField& f) {
  f.only_keys({"bandwidth_gb_s", "latency_us", "bandwidth_by_size"});
  LinkTier t{positive(f["bandwidth_gb_s"], 1e9), positive(f["latency_us"], 1e-6), {}};
  if (!f["bandwidth_by_size"].present()) return t;
  f["bandwidth_by_size"].array(1);
  f["bandwidth_by_size"].for_each_element([&](const JsonField& p) {
    p.array(2, 2);
    const double bytes = positive(p[0], 1024);
    ORIGAMI_CHECK(t.by_size.empty() || bytes > t.by_size.back().first, p.where(), ": sizes must ascend");
    t.by_size.emplace_back(bytes, positive(p[1], 1e9));
  });
  return t;
}

// Measured GEMM rates: [gflop, tflops] pairs, both positive, each size once; ascending in size.
std::vector<std::pair<double, double>> gemm_curve(const JsonField& f) {
  std::vector<std::pair<double, double>> gemm;
  f.array(1);
  f.for_each_element([&](const JsonField& p) {
    p.array(2, 2);
    gemm.emplace_back(positive(p[0], 1e9), positive(p[1], 1e12));
  });
  std::sort(gemm.begin(), gemm.end());
  for (size_t i = 1; i < gemm.size(); ++i)
    ORIGAMI_CHECK(gemm[i].first > gemm[i - 1].first, f.where(), ": gives ", gemm[i].first / 1e9, " GFLOP twice");
  return gemm;
}

// A precision's rates: the peak, the attention core and the GEMMs, measured by size or as a roofline's
// efficiency (which then needs the device's memory bandwidth).
ComputeRates rates_of(const JsonField& d, double memory_bandwidth) {
  ComputeRates r;
  r.peak_flops = positive(d["peak_tflops"], 1e12);
  r.attention_flops = positive(d["attention_tflops"], 1e12);
  if (d["gemm"].present()) {
    r.gemm = gemm_curve(d["gemm"]);
    r.gemm_streaming = d["gemm_streaming_gb_s"].number_or(0, NumberRange::positive()) * 1e9;
    r.gemm_streaming_accumulating = d["gemm_streaming_accumulating_gb_s"].number_or(0, NumberRange::positive()) * 1e9;
    return r;
  }
  for (const char* rate : {"gemm_streaming_gb_s", "gemm_streaming_accumulating_gb_s"})
    ORIGAMI_CHECK(!d[rate].present(), d[rate].where(),
                  ": needs measured 'gemm' rates (the roofline counts operand traffic itself)");
  ORIGAMI_CHECK(d["gemm_efficiency"].present(), d["gemm_efficiency"].where(),
                ": missing (it is needed without measured 'gemm' rates)");
  ORIGAMI_CHECK(memory_bandwidth > 0, d.where(), ": 'gemm_efficiency' needs the device's memory_bandwidth_gb_s");
  r.gemm_efficiency = d["gemm_efficiency"].number({0, 1, true});  // a fraction of the roofline
  return r;
}

nlohmann::json rates_json(const ComputeRates& r) {
  nlohmann::json d = {{"peak_tflops", r.peak_flops / 1e12}, {"attention_tflops", r.attention_flops / 1e12}};
  if (r.gemm.empty()) {
    d["gemm_efficiency"] = r.gemm_efficiency;
  } else {
    d["gemm"] = nlohmann::json::array();
    for (const auto& [flops, rate] : r.gemm) d["gemm"].push_back({flops / 1e9, rate / 1e12});
    if (r.gemm_streaming > 0) d["gemm_streaming_gb_s"] = r.gemm_streaming / 1e9;
    if (r.gemm_streaming_accumulating > 0) d["gemm_streaming_accumulating_gb_s"] = r.gemm_streaming_accumulating / 1e9;
  }
  return d;
}

}  // namespace

Cluster Cluster::from_json(const nlohmann::json& j, const std::string& source) {
  const JsonField f(j, source);
  f.only_keys({"name", "source", "nodes", "devices_per_node", "threads_per_rank", "device", "comm_overlap", "overlap",
               "intra_node", "inter_node", "collectives"});
  Cluster c;
  c.name = f["name"].string_or(source);
  c.source = f["source"].string_or("");
  c.nodes = int(f["nodes"].integer(1, kMaxNodes));
  c.devices_per_node = int(f["devices_per_node"].integer(1, kMaxDevicesPerNode));
  c.threads_per_rank = int(f["threads_per_rank"].integer_or(0, 1, kMaxThreads));
  const JsonField d = f["device"];
  d.only_keys({"memory_gb", "memory_bandwidth_gb_s", "first_touch_gb_s", "bf16", "sms", "kernel_overhead_us",
               "peak_tflops", "attention_tflops", "gemm", "gemm_streaming_gb_s", "gemm_streaming_accumulating_gb_s",
               "gemm_efficiency"});
  c.memory_bytes = positive(d["memory_gb"], 1e9);
  if (!d["gemm"].present())
    ORIGAMI_CHECK(d["memory_bandwidth_gb_s"].present(), d["memory_bandwidth_gb_s"].where(),
                  ": missing (it is needed without measured 'gemm' rates)");
  c.memory_bandwidth = d["memory_bandwidth_gb_s"].number_or(0, NumberRange::positive()) * 1e9;
  c.first_touch = d["first_touch_gb_s"].number_or(0, NumberRange::positive()) * 1e9;
  static_cast<ComputeRates&>(c) = rates_of(d, c.memory_bandwidth);
  if (d["bf16"].present())
    c.bf16 = rates_of(d["bf16"].only_keys({"peak_tflops", "attention_tflops", "gemm", "gemm_streaming_gb_s",
                                           "gemm_streaming_accumulating_gb_s", "gemm_efficiency"}),
                      c.memory_bandwidth);
  c.sms = int(d["sms"].integer_or(0, 1, 1 << 16));  // (absent: 0, no tile model)
  c.kernel_overhead = d["kernel_overhead_us"].number_or(0, NumberRange::between(0, 1e6)) * 1e-6;  // up to a second
  c.comm_overlap = f["comm_overlap"].number_or(c.comm_overlap, NumberRange::between(0, 1));
  if (f["overlap"].present())
    f["overlap"].for_each_member([&](const std::string& kind, const JsonField& x) {
      ORIGAMI_CHECK(kind == "dp" || kind == "param-gather" || kind == "cp" || kind == "tp" || kind == "ep" ||
                        kind == "pp",
                    x.where(), ": not one of dp, param-gather, cp, tp, ep, pp");
      c.overlap[kind] = x.number(NumberRange::between(0, 1));
    });
  // One device per node has no link within its node (a one-rank `origami profile` measures none).
  ORIGAMI_CHECK(c.devices_per_node == 1 || f["intra_node"].present(), f["intra_node"].where(),
                ": missing (a node of ", c.devices_per_node, " devices needs the link between them; profile on as "
                "many ranks as a node has devices)");
  if (f["intra_node"].present()) c.intra = link_of(f["intra_node"]);
  if (f["collectives"].present())
    f["collectives"].for_each_member([&](const std::string& name, const JsonField& x) {
      ORIGAMI_CHECK(name == "all_gather" || name == "reduce_scatter" || name == "all_to_all" || name == "send_recv",
                    x.where(), ": not one of all_gather, reduce_scatter, all_to_all, send_recv (the all-reduce's rate "
                    "is the tier's link)");
      c.collectives[name] = link_of(x);
    });
  c.inter_given = f["inter_node"].present();
  c.inter = c.nodes > 1 || c.inter_given ? link_of(f["inter_node"]) : c.intra;
  return c;
}

Cluster Cluster::load(const std::string& path) { return from_json(parse_json_file(path), path); }

nlohmann::json Cluster::to_json() const {
  nlohmann::json d = rates_json(*this);
  d["memory_gb"] = memory_bytes / 1e9;
  if (memory_bandwidth > 0) d["memory_bandwidth_gb_s"] = memory_bandwidth / 1e9;
  if (first_touch > 0) d["first_touch_gb_s"] = first_touch / 1e9;
  if (bf16) d["bf16"] = rates_json(*bf16);
  if (sms > 0) d["sms"] = sms;
  if (kernel_overhead > 0) d["kernel_overhead_us"] = kernel_overhead * 1e6;
  auto link = [](const LinkTier& t) {
    nlohmann::json j = {{"bandwidth_gb_s", t.bandwidth / 1e9}, {"latency_us", t.latency * 1e6}};
    for (const auto& [bytes, rate] : t.by_size) j["bandwidth_by_size"].push_back({bytes / 1024, rate / 1e9});
    return j;
  };
  nlohmann::json links = nlohmann::json::object();
  for (const auto& [name, t] : collectives) links[name] = link(t);
  nlohmann::json j = {{"name", name},         {"source", source},   {"nodes", nodes},
                      {"devices_per_node", devices_per_node}, {"device", d}, {"comm_overlap", comm_overlap},
                      {"overlap", overlap}, {"collectives", links}};
  if (threads_per_rank > 0) j["threads_per_rank"] = threads_per_rank;
  if (intra.bandwidth > 0) j["intra_node"] = link(intra);  // (none measured on one rank)
  if (inter_given || nodes > 1) j["inter_node"] = link(inter);  // (one node without it: none to join nodes with)
  return j;
}

}  // namespace origami
