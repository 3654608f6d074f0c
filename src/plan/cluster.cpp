#include "plan/cluster.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/files.h"

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

// A positive number at j[key] ("what" names it in messages).
double positive(const nlohmann::json& j, const char* key, const std::string& what) {
  ORIGAMI_CHECK(j.is_object() && j.contains(key) && j[key].is_number() && j[key].get<double>() > 0, what, ": '", key,
                "' must be a positive number", j.is_object() && j.contains(key) ? cat(", got ", j[key].dump()) : "");
  return j[key].get<double>();
}

LinkTier link_of(const nlohmann::json& j, const char* key, const std::string& source) {
  ORIGAMI_CHECK(j.contains(key) && j[key].is_object(), source, ": '", key,
                "' must be an object {\"bandwidth_gb_s\": .., \"latency_us\": ..}");
  const std::string what = cat(source, ": ", key);
  return {positive(j[key], "bandwidth_gb_s", what) * 1e9, positive(j[key], "latency_us", what) * 1e-6};
}

}  // namespace

Cluster Cluster::from_json(const nlohmann::json& j, const std::string& source) {
  ORIGAMI_CHECK(j.is_object(), source, ": a cluster file is a JSON object");
  Cluster c;
  c.name = j.value("name", source);
  c.source = j.value("source", "");
  c.nodes = int(positive(j, "nodes", source));
  c.devices_per_node = int(positive(j, "devices_per_node", source));
  ORIGAMI_CHECK(j.contains("device") && j["device"].is_object(), source, ": 'device' must be an object");
  const nlohmann::json& d = j["device"];
  const std::string dev = source + ": device";
  c.memory_bytes = positive(d, "memory_gb", dev) * 1e9;
  c.peak_flops = positive(d, "peak_tflops", dev) * 1e12;
  c.attention_flops = positive(d, "attention_tflops", dev) * 1e12;
  if (d.contains("gemm")) {
    ORIGAMI_CHECK(d["gemm"].is_array() && !d["gemm"].empty(), dev, ": 'gemm' must be a list of [gflop, tflops] pairs");
    for (const nlohmann::json& p : d["gemm"]) {
      ORIGAMI_CHECK(p.is_array() && p.size() == 2 && p[0].is_number() && p[1].is_number() && p[0].get<double>() > 0 &&
                        p[1].get<double>() > 0,
                    dev, ": 'gemm' entry ", p.dump(), " is not [gflop, tflops] with both positive");
      c.gemm.emplace_back(p[0].get<double>() * 1e9, p[1].get<double>() * 1e12);
    }
    std::sort(c.gemm.begin(), c.gemm.end());
    for (size_t i = 1; i < c.gemm.size(); ++i)
      ORIGAMI_CHECK(c.gemm[i].first > c.gemm[i - 1].first, dev, ": 'gemm' gives ", c.gemm[i].first / 1e9,
                    " GFLOP twice");
    if (d.contains("memory_bandwidth_gb_s")) c.memory_bandwidth = positive(d, "memory_bandwidth_gb_s", dev) * 1e9;
  } else {
    c.memory_bandwidth = positive(d, "memory_bandwidth_gb_s", dev + " (without measured 'gemm' rates)") * 1e9;
    c.gemm_efficiency = positive(d, "gemm_efficiency", dev + " (without measured 'gemm' rates)");
    ORIGAMI_CHECK(c.gemm_efficiency <= 1, dev, ": 'gemm_efficiency' is a fraction of the roofline, at most 1, got ",
                  c.gemm_efficiency);
  }
  if (j.contains("comm_overlap")) {
    const nlohmann::json& x = j["comm_overlap"];
    ORIGAMI_CHECK(x.is_number() && x.get<double>() >= 0 && x.get<double>() <= 1, source,
                  ": 'comm_overlap' must be a fraction in [0, 1], got ", x.dump());
    c.comm_overlap = x.get<double>();
  }
  c.intra = link_of(j, "intra_node", source);
  c.inter = c.nodes > 1 || j.contains("inter_node") ? link_of(j, "inter_node", source) : c.intra;
  return c;
}

Cluster Cluster::load(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file_bytes(path));
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
  return from_json(j, path);
}

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
