#include "plan/cluster.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/json_fields.h"

namespace origami {

double Cluster::gemm_rate(double M, double N, double K) const {
  const double flops = 2 * M * N * K;
  if (!gemm.empty()) {
    if (flops <= gemm.front().first) return gemm.front().second;
    if (flops >= gemm.back().first) return gemm.back().second;
    const auto hi = std::lower_bound(gemm.begin(), gemm.end(), std::make_pair(flops, 0.0));
    const auto lo = hi - 1;
    const double f = (std::log(flops) - std::log(lo->first)) / (std::log(hi->first) - std::log(lo->first));
    return lo->second + f * (hi->second - lo->second);
  }
  const double seconds = std::max(flops / peak_flops, 2 * (M * K + K * N + M * N) / memory_bandwidth);
  return gemm_efficiency * flops / seconds;
}

double Cluster::transfer_seconds(double bytes, int steps, bool inter_node) const {
  const LinkTier& t = inter_node ? inter : intra;
  return steps * t.latency + bytes / t.bandwidth;
}

namespace {

// Devices a cluster may have: far beyond any machine, and nodes × devices_per_node fits an int.
constexpr int64_t kMaxNodes = int64_t(1) << 20, kMaxDevicesPerNode = 1024;

// A positive figure of the file, in its human unit, times `unit` (to SI).
double positive(const JsonField& f, double unit) { return f.number(NumberRange::positive()) * unit; }

LinkTier link_of(const JsonField& f) {
  f.object();
  return {positive(f["bandwidth_gb_s"], 1e9), positive(f["latency_us"], 1e-6)};
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

}  // namespace

Cluster Cluster::from_json(const nlohmann::json& j, const std::string& source) {
  const JsonField f(j, source);
  Cluster c;
  c.name = f["name"].string_or(source);
  c.source = f["source"].string_or("");
  c.nodes = int(f["nodes"].integer(1, kMaxNodes));
  c.devices_per_node = int(f["devices_per_node"].integer(1, kMaxDevicesPerNode));
  const JsonField d = f["device"];
  d.object();
  c.memory_bytes = positive(d["memory_gb"], 1e9);
  c.peak_flops = positive(d["peak_tflops"], 1e12);
  c.attention_flops = positive(d["attention_tflops"], 1e12);
  if (d["gemm"].present()) {
    c.gemm = gemm_curve(d["gemm"]);
    c.memory_bandwidth = d["memory_bandwidth_gb_s"].number_or(0, NumberRange::positive()) * 1e9;
  } else {
    for (const char* key : {"memory_bandwidth_gb_s", "gemm_efficiency"})
      ORIGAMI_CHECK(d[key].present(), d[key].where(), ": missing (it is needed without measured 'gemm' rates)");
    c.memory_bandwidth = positive(d["memory_bandwidth_gb_s"], 1e9);
    c.gemm_efficiency = d["gemm_efficiency"].number({0, 1, true});  // a fraction of the roofline
  }
  c.comm_overlap = f["comm_overlap"].number_or(c.comm_overlap, NumberRange::between(0, 1));
  c.intra = link_of(f["intra_node"]);
  c.inter = c.nodes > 1 || f["inter_node"].present() ? link_of(f["inter_node"]) : c.intra;
  return c;
}

Cluster Cluster::load(const std::string& path) { return from_json(parse_json_file(path), path); }

nlohmann::json Cluster::to_json() const {
  nlohmann::json d = {{"memory_gb", memory_bytes / 1e9}, {"peak_tflops", peak_flops / 1e12},
                      {"attention_tflops", attention_flops / 1e12}};
  if (memory_bandwidth > 0) d["memory_bandwidth_gb_s"] = memory_bandwidth / 1e9;
  if (gemm.empty()) {
    d["gemm_efficiency"] = gemm_efficiency;
  } else {
    d["gemm"] = nlohmann::json::array();
    for (const auto& [flops, rate] : gemm) d["gemm"].push_back({flops / 1e9, rate / 1e12});
  }
  auto link = [](const LinkTier& t) {
    return nlohmann::json{{"bandwidth_gb_s", t.bandwidth / 1e9}, {"latency_us", t.latency * 1e6}};
  };
  return {{"name", name},  {"source", source},      {"nodes", nodes},           {"devices_per_node", devices_per_node},
          {"device", d},   {"intra_node", link(intra)}, {"inter_node", link(inter)}, {"comm_overlap", comm_overlap}};
}

}  // namespace origami
