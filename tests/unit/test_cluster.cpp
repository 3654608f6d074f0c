// Cluster files (plan/cluster.h): the shipped ones load, rates follow the roofline or the measured
// curve, and every mistake in a file is an error naming the field.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "plan/cluster.h"

using namespace origami;

namespace {

nlohmann::json base() {
  return nlohmann::json::parse(R"({"name": "t", "nodes": 2, "devices_per_node": 4,
    "device": {"memory_gb": 80, "peak_tflops": 100, "memory_bandwidth_gb_s": 1000, "gemm_efficiency": 0.5,
               "attention_tflops": 40},
    "intra_node": {"bandwidth_gb_s": 200, "latency_us": 2}, "inter_node": {"bandwidth_gb_s": 20, "latency_us": 5}})");
}

std::string error_of(const nlohmann::json& j) {
  try {
    Cluster::from_json(j, "c.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Cluster, ShippedFilesLoad) {
  for (const char* name : {"dgx-a100", "dgx-h100"}) {
    const Cluster c = Cluster::load(std::string(ORIGAMI_SOURCE_DIR) + "/configs/clusters/" + name + ".json");
    EXPECT_EQ(c.devices_per_node, 8) << name;
    EXPECT_GT(c.peak_flops, 3e14) << name;
    EXPECT_GT(c.intra.bandwidth, c.inter.bandwidth) << name;
    EXPECT_NE(c.source.find("datasheet"), std::string::npos) << name << ": figures name their source";
    // A large square GEMM is compute-bound: 0.8 of the peak.
    EXPECT_NEAR(c.gemm_rate(8192, 8192, 8192), 0.8 * c.peak_flops, 1e-6 * c.peak_flops) << name;
  }
}

TEST(Cluster, RooflineAndMeasuredRates) {
  const Cluster c = Cluster::from_json(base(), "c.json");
  EXPECT_EQ(c.devices(), 8);
  // 4096³: compute-bound, 0.5 × 100 TFLOP/s.
  EXPECT_NEAR(c.gemm_rate(4096, 4096, 4096), 0.5e14, 1e6);
  // 64×64×64: memory-bound, 2·64³ FLOPs over 2·3·64² bytes at 1e12 B/s, times 0.5.
  EXPECT_NEAR(c.gemm_rate(64, 64, 64), 0.5 * 2.0 * 64 * 64 * 64 / (6.0 * 64 * 64 / 1e12), 1.0);
  EXPECT_NEAR(c.transfer_seconds(2e9, 10, false), 10 * 2e-6 + 2e9 / 2e11, 1e-12);
  EXPECT_NEAR(c.transfer_seconds(2e9, 10, true), 10 * 5e-6 + 2e9 / 2e10, 1e-12);
  nlohmann::json j = base();
  j["device"]["gemm"] = {{1.0, 1.0}, {100.0, 3.0}};  // measured: 1 GFLOP at 1 TFLOP/s, 100 GFLOP at 3
  const Cluster m = Cluster::from_json(j, "c.json");
  EXPECT_NEAR(m.gemm_rate(1000, 1000, 500), 1e12, 1);    // 1 GFLOP
  EXPECT_NEAR(m.gemm_rate(1000, 1000, 5000), 2e12, 1e3);  // 10 GFLOP: halfway in log FLOPs
  EXPECT_NEAR(m.gemm_rate(10, 10, 10), 1e12, 1);          // flat beyond the ends
  EXPECT_NEAR(m.gemm_rate(1e5, 1e5, 1e5), 3e12, 1);
  EXPECT_EQ(m.memory_bandwidth, 1e12);  // kept beside measured rates: element-wise work and AdamW use it
  EXPECT_EQ(m.comm_overlap, 1);         // not given: transfers overlap compute
  j["comm_overlap"] = 0.25;
  j["device"].erase("memory_bandwidth_gb_s");
  const Cluster q = Cluster::from_json(j, "c.json");
  EXPECT_EQ(q.comm_overlap, 0.25);
  EXPECT_EQ(q.memory_bandwidth, 0);  // optional with measured rates
  EXPECT_EQ(Cluster::from_json(q.to_json(), "again").comm_overlap, 0.25);
  // The file form round-trips.
  const Cluster r = Cluster::from_json(m.to_json(), "again");
  EXPECT_EQ(r.gemm, m.gemm);
  EXPECT_DOUBLE_EQ(r.inter.latency, m.inter.latency);
  EXPECT_DOUBLE_EQ(r.memory_bytes, m.memory_bytes);
}

TEST(Cluster, MistakesNameTheField) {
  nlohmann::json j = base();
  j["nodes"] = 0;
  EXPECT_EQ(error_of(j), "c.json: field 'nodes': expected an integer in [1, 1048576], got 0");
  j = base();
  j["device"].erase("peak_tflops");
  EXPECT_EQ(error_of(j), "c.json: field 'device.peak_tflops': missing");
  j = base();
  j["device"]["gemm_efficiency"] = 1.5;
  EXPECT_EQ(error_of(j), "c.json: field 'device.gemm_efficiency': expected a number in (0, 1], got 1.5");
  j = base();
  j["device"]["gemm"] = {{1.0, -2.0}};
  EXPECT_EQ(error_of(j), "c.json: field 'device.gemm[0][1]': expected a positive number, got -2.0");
  j = base();
  j["comm_overlap"] = 1.5;
  EXPECT_EQ(error_of(j), "c.json: field 'comm_overlap': expected a number in [0, 1], got 1.5");
  j = base();
  j.erase("inter_node");
  EXPECT_EQ(error_of(j), "c.json: field 'inter_node': missing");
  j = base();
  j["intra_node"]["latency_us"] = "fast";
  EXPECT_EQ(error_of(j), "c.json: field 'intra_node.latency_us': expected a positive number, got \"fast\"");
  // Fields of the wrong type, which nlohmann's accessors would throw on.
  j = base();
  j["source"] = 5;
  EXPECT_EQ(error_of(j), "c.json: field 'source': expected a string, got 5");
  j = base();
  j["device"] = "H100";
  EXPECT_EQ(error_of(j), "c.json: field 'device': expected an object, got \"H100\"");
  j = base();
  j["device"].erase("gemm_efficiency");
  EXPECT_EQ(error_of(j), "c.json: field 'device.gemm_efficiency': missing (it is needed without measured 'gemm' rates)");
  j = base();
  j["devices_per_node"] = 2.5;
  EXPECT_EQ(error_of(j), "c.json: field 'devices_per_node': expected an integer in [1, 1024], got 2.5");
}

}  // namespace
