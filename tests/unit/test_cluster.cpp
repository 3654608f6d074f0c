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
    const Cluster b = c.at("bf16");
    EXPECT_GT(b.peak_flops, 3e14) << name;
    EXPECT_NEAR(b.peak_flops, 2 * c.peak_flops, 0.01 * b.peak_flops) << name << ": dense BF16 twice TF32";
    EXPECT_GT(c.intra.bandwidth, c.inter.bandwidth) << name;
    EXPECT_GT(c.sms, 100) << name;
    EXPECT_NE(c.source.find("datasheet"), std::string::npos) << name << ": figures name their source";
    // A large square GEMM is compute-bound: the efficiency times the peak, less its last partial wave.
    EXPECT_NEAR(b.gemm_rate(8192, 8192, 8192), b.gemm_efficiency * b.peak_flops * gemm_tile_share(8192, 8192, c.sms),
                1e-6 * b.peak_flops) << name;
    EXPECT_GT(gemm_tile_share(8192, 8192, c.sms), 0.95) << name;
  }
}

TEST(Cluster, RooflineAndMeasuredRates) {
  const Cluster c = Cluster::from_json(base(), "c.json");
  EXPECT_EQ(c.devices(), 8);
  // 4096³: compute-bound, 0.5 × 100 TFLOP/s.
  EXPECT_NEAR(c.gemm_rate(4096, 4096, 4096), 0.5e14, 1e6);
  // 64×64×64: memory-bound, 2·64³ FLOPs over 3·64² fp32 elements (4 bytes) at 1e12 B/s, times 0.5;
  // in bf16, 2-byte elements: twice the rate.
  EXPECT_NEAR(c.gemm_rate(64, 64, 64), 0.5 * 2.0 * 64 * 64 * 64 / (12.0 * 64 * 64 / 1e12), 1.0);
  EXPECT_NEAR(c.at("bf16").gemm_rate(64, 64, 64), 0.5 * 2.0 * 64 * 64 * 64 / (6.0 * 64 * 64 / 1e12), 1.0);
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

// In-cache rates plus operand traffic: a measured curve's call takes its FLOPs at the curve's rate
// and its operands' bytes at gemm_streaming, so fewer rows per call cost more per FLOP.
TEST(Cluster, OperandsStreamBeyondTheInCacheRates) {
  nlohmann::json j = base();
  j["device"]["gemm"] = {{0.001, 1.0}, {1000.0, 1.0}};  // 1 TFLOP/s in cache at every size
  j["device"]["gemm_streaming_gb_s"] = 10;
  j["device"]["bf16"] = {{"peak_tflops", 2}, {"gemm", {{0.001, 2.0}}}, {"gemm_streaming_gb_s", 5}, {"attention_tflops", 1}};
  const Cluster c = Cluster::from_json(j, "c.json");
  const double flops = 2.0 * 256 * 1024 * 1024, elements = 256.0 * 1024 + 1024.0 * 1024 + 256.0 * 1024;
  EXPECT_NEAR(2 * 256.0 * 1024 * 1024 / c.gemm_rate(256, 1024, 1024), flops / 1e12 + 4 * elements / 1e10, 1e-12);
  // bf16: its own curve and rate, 2-byte elements.
  EXPECT_NEAR(flops / c.at("bf16").gemm_rate(256, 1024, 1024), flops / 2e12 + 2 * elements / 5e9, 1e-12);
  // The same weight over four times the rows: fewer bytes per FLOP, a higher rate.
  EXPECT_GT(c.gemm_rate(1024, 1024, 1024), c.gemm_rate(256, 1024, 1024) * 1.2);
  EXPECT_EQ(Cluster::from_json(c.to_json(), "again").gemm_streaming, 1e10);
  EXPECT_EQ(Cluster::from_json(c.to_json(), "again").bf16->gemm_streaming, 5e9);
  // A weight gradient adds into C at its own rate where the file gives one, else at gemm_streaming.
  EXPECT_EQ(c.gemm_rate(1024, 1024, 256, true), c.gemm_rate(1024, 1024, 256));
  j["device"]["gemm_streaming_accumulating_gb_s"] = 2;
  const Cluster acc = Cluster::from_json(j, "c.json");
  EXPECT_NEAR(flops / acc.gemm_rate(1024, 1024, 256, true), flops / 1e12 + 4 * elements / 2e9, 1e-12);
  EXPECT_NEAR(flops / acc.gemm_rate(1024, 1024, 256), flops / 1e12 + 4 * elements / 1e10, 1e-12);
  EXPECT_EQ(Cluster::from_json(acc.to_json(), "again").gemm_streaming_accumulating, 2e9);
  j["device"].erase("gemm_streaming_gb_s");
  j["device"].erase("gemm_streaming_accumulating_gb_s");
  EXPECT_NEAR(Cluster::from_json(j, "c.json").gemm_rate(256, 1024, 1024), 1e12, 1);  // absent: in cache
  // The fit: extra seconds = bytes / rate; no slower cold calls, no term.
  EXPECT_NEAR(fit_streaming_rate({{1e6, 2e-4, 1e-4}, {4e6, 8e-4, 4e-4}}), 1e10, 1);
  EXPECT_EQ(fit_streaming_rate({{1e6, 0.5e-4, 1.5e-4}, {1e6, 1e-4, 0.5e-4}}), 0);
  EXPECT_EQ(fit_streaming_rate({}), 0);
  // Each call weighs by its relative error: a large call's 1e-5 s over 1e-2 (1e7 bytes: 1e12 B/s)
  // hardly moves the rate that a small call's 1e-4 over 2e-4 sets (1e6 bytes: 1e10 B/s). A plain
  // least squares in seconds would give 5.05e11 B/s, near the large call's.
  EXPECT_NEAR(fit_streaming_rate({{1e6, 2e-4, 1e-4}, {1e7, 1e-2, 0.999e-2}}), 1.0396e10, 1e6);
}

TEST(Cluster, PrecisionRatesAndOverlapPerKind) {
  nlohmann::json j = base();
  const Cluster plain = Cluster::from_json(j, "c.json");
  // Without bf16 rates, bf16 computes at the fp32 ones (with 2-byte elements).
  EXPECT_EQ(plain.at("bf16").peak_flops, plain.peak_flops);
  EXPECT_EQ(plain.at("bf16").element_bytes, 2);
  EXPECT_EQ(plain.at("fp32").element_bytes, 4);
  // A CPU (no SMs) runs bf16 as origami's kernels do: GEMM operands of 2 bytes, activations of 4.
  EXPECT_TRUE(plain.at("bf16").rounds_operands);
  EXPECT_EQ(plain.at("bf16").activation_bytes(), 4);
  EXPECT_FALSE(plain.at("fp32").rounds_operands);
  nlohmann::json gpu = base();
  gpu["device"]["sms"] = 108;
  EXPECT_FALSE(Cluster::from_json(gpu, "gpu.json").at("bf16").rounds_operands);
  EXPECT_EQ(Cluster::from_json(gpu, "gpu.json").at("bf16").activation_bytes(), 2);
  j["device"]["bf16"] = {{"peak_tflops", 400}, {"gemm_efficiency", 0.8}, {"attention_tflops", 160}};
  const Cluster c = Cluster::from_json(j, "c.json");
  EXPECT_EQ(c.peak_flops, 1e14);
  EXPECT_EQ(c.at("bf16").peak_flops, 4e14);
  EXPECT_EQ(c.at("bf16").attention_flops, 1.6e14);
  EXPECT_NEAR(c.at("bf16").gemm_rate(8192, 8192, 8192), 0.8 * 4e14, 1e3);
  EXPECT_EQ(Cluster::from_json(c.to_json(), "again").at("bf16").peak_flops, 4e14);
  // Overlap: dp and cp default to comm_overlap, the blocking kinds to 0; the file's per kind wins.
  EXPECT_EQ(c.overlap_of("dp"), 1);
  EXPECT_EQ(c.overlap_of("tp"), 0);
  EXPECT_EQ(c.overlap_of("param-gather"), 0);
  j["overlap"] = {{"dp", 0.25}, {"tp", 0.5}};
  const Cluster o = Cluster::from_json(j, "c.json");
  EXPECT_EQ(o.overlap_of("dp"), 0.25);
  EXPECT_EQ(o.overlap_of("tp"), 0.5);
  EXPECT_EQ(o.overlap_of("cp"), 1);
  EXPECT_EQ(Cluster::from_json(o.to_json(), "again").overlap_of("tp"), 0.5);
  j["overlap"] = {{"nvlink", 1}};
  EXPECT_EQ(error_of(j), "c.json: field 'overlap.nvlink': not one of dp, param-gather, cp, tp, ep, pp");
  j["overlap"] = {{"tp", 2}};
  EXPECT_EQ(error_of(j), "c.json: field 'overlap.tp': expected a number in [0, 1], got 2");
}

// The GPU terms: tile and wave quantization, attention by length and head size, an all-to-all over
// both tiers.
TEST(Cluster, GpuShapeTerms) {
  // 1024×1024 on 64 SMs: 128×128 tiles, 64 of them, one whole wave: all of the peak. 1025 columns
  // need a ninth column of tiles: 256×128's 4·9 = 36 tiles take one wave of 64 SMs (1024·1025 useful
  // of 64·256·128), as 128×128's 72 take two; the smaller tiles lose more to their reuse.
  EXPECT_DOUBLE_EQ(gemm_tile_share(1024, 1024, 64), 1.0);
  EXPECT_DOUBLE_EQ(gemm_tile_share(1024, 1025, 64), 1024.0 * 1025 / (64.0 * 256 * 128));
  // 100 rows: at best a 128-row tile: 100/128 of it (one wave of 64 SMs over N = 8192 in 64 tiles of 128).
  EXPECT_DOUBLE_EQ(gemm_tile_share(100, 8192, 64), 100.0 / 128);
  nlohmann::json j = base();
  j["device"]["sms"] = 64;
  const Cluster g = Cluster::from_json(j, "c.json");
  // bf16 (2-byte operands): compute-bound, less the quantization.
  EXPECT_NEAR(g.at("bf16").gemm_rate(100, 8192, 8192), 0.5 * 1e14 * 100.0 / 128, 1e3);
  // Attention: rate at long sequences and D = 128; T = 128 loses half to the diagonal tiles; D = 64
  // does (64/96)/(128/160) of D = 128's work per tile-time.
  EXPECT_NEAR(g.attention_rate(1e12, 128), 4e13, 1e4);
  EXPECT_NEAR(g.attention_rate(128, 128), 2e13, 1e3);
  EXPECT_NEAR(g.attention_rate(1e12, 64), 4e13 * (64.0 / 96) / 0.8, 1e4);
  EXPECT_EQ(Cluster::from_json(base(), "c.json").attention_rate(128, 64), 4e13);  // a CPU: as measured
  // All-to-all over 8 ranks, 4 in the node: 3/7 of the bytes over 200 GB/s, 4/7 over 20 GB/s, at once,
  // a latency step per message (2 calls, 4 messages each across nodes).
  EXPECT_NEAR(g.all_to_all_seconds(7e9, 2, 8, 4), 2 * 4 * 5e-6 + 4e9 / 2e10, 1e-12);
  EXPECT_NEAR(g.all_to_all_seconds(7e9, 2, 8, 8), 2 * 7 * 2e-6 + 7e9 / 2e11, 1e-12);  // all in the node
  EXPECT_EQ(g.all_to_all_seconds(7e9, 2, 1, 1), 0);
  // Kernel launches: microseconds in the file, seconds in the struct.
  j["device"]["kernel_overhead_us"] = 3;
  EXPECT_DOUBLE_EQ(Cluster::from_json(j, "c.json").kernel_overhead, 3e-6);
}

// Each collective at its own measured rate within a node; across nodes at the tier's.
TEST(Cluster, CollectivesAtTheirOwnRates) {
  nlohmann::json j = base();
  j["collectives"] = {{"reduce_scatter", {{"bandwidth_gb_s", 100}, {"latency_us", 1}}},
                      {"all_to_all", {{"bandwidth_gb_s", 400}, {"latency_us", 3}}}};
  const Cluster c = Cluster::from_json(j, "c.json");
  EXPECT_NEAR(c.transfer_seconds(1e9, 4, false, "reduce_scatter"), 4e-6 + 1e9 / 1e11, 1e-15);
  EXPECT_NEAR(c.transfer_seconds(1e9, 4, false, "all_gather"), 4 * 2e-6 + 1e9 / 2e11, 1e-15);  // none given: intra's
  EXPECT_NEAR(c.transfer_seconds(1e9, 4, true, "reduce_scatter"), 4 * 5e-6 + 1e9 / 2e10, 1e-15);  // across nodes
  EXPECT_NEAR(c.all_to_all_seconds(7e9, 2, 8, 8), 2 * 7 * 3e-6 + 7e9 / 4e11, 1e-15);  // 7 messages a call
  EXPECT_EQ(Cluster::from_json(c.to_json(), "again").collectives.at("all_to_all").bandwidth, 4e11);
  j["collectives"] = {{"broadcast", {{"bandwidth_gb_s", 1}, {"latency_us", 1}}}};
  EXPECT_EQ(error_of(j), "c.json: field 'collectives.broadcast': not one of all_gather, reduce_scatter, all_to_all, "
                         "send_recv (the all-reduce's rate is the tier's link)");
  // A one-node file without an inter-node link writes none back (so plan --nodes still refuses it).
  nlohmann::json one = base();
  one["nodes"] = 1;
  one.erase("inter_node");
  const Cluster single = Cluster::from_json(one, "c.json");
  EXPECT_FALSE(single.inter_given);
  EXPECT_FALSE(single.to_json().contains("inter_node"));
  EXPECT_FALSE(Cluster::from_json(single.to_json(), "again").inter_given);
}

// A collective's bandwidth by message size: each call at the rate of its bytes per step (interpolated
// in log size, flat beyond the ends); a step count of 0 is one message of all the bytes.
TEST(Cluster, CollectivesAtTheRateOfTheirMessageSize) {
  nlohmann::json j = base();
  j["collectives"] = {{"reduce_scatter", {{"bandwidth_gb_s", 1}, {"latency_us", 1},
                                          {"bandwidth_by_size", {{1.0, 4.0}, {1024.0, 2.0}, {65536.0, 1.0}}}}}};
  const Cluster c = Cluster::from_json(j, "c.json");
  const LinkTier& rs = c.collectives.at("reduce_scatter");
  EXPECT_DOUBLE_EQ(rs.bandwidth_at(100), 4e9);            // below the smallest: its rate
  EXPECT_DOUBLE_EQ(rs.bandwidth_at(1024 * 1024), 2e9);    // 1 MiB: a measured point
  EXPECT_NEAR(rs.bandwidth_at(8 * 1024 * 1024), 1.5e9, 1);  // 8 MiB: halfway in log size from 1 to 64 MiB
  EXPECT_DOUBLE_EQ(rs.bandwidth_at(1e12), 1e9);           // beyond the largest: its rate
  // 32 messages of 1 MiB (one step each), and one of 32 MiB.
  const double mib = 1024 * 1024;
  EXPECT_NEAR(c.transfer_seconds(32 * mib, 32, false, "reduce_scatter"), 32e-6 + 32 * mib / 2e9, 1e-15);
  EXPECT_NEAR(c.transfer_seconds(32 * mib, 0, false, "reduce_scatter"), 32 * mib / rs.bandwidth_at(32 * mib), 1e-15);
  EXPECT_EQ(Cluster::from_json(c.to_json(), "again").collectives.at("reduce_scatter").by_size, rs.by_size);
  // Without sizes: the one bandwidth at every size.
  EXPECT_EQ(c.intra.bandwidth_at(1), 2e11);
  j["collectives"]["reduce_scatter"]["bandwidth_by_size"] = {{1024.0, 2.0}, {1024.0, 1.0}};
  EXPECT_EQ(error_of(j), "c.json: field 'collectives.reduce_scatter.bandwidth_by_size[1]': sizes must ascend");
  j["collectives"]["reduce_scatter"]["bandwidth_by_size"] = {{1024.0, 0.0}};
  EXPECT_EQ(error_of(j), "c.json: field 'collectives.reduce_scatter.bandwidth_by_size[0][1]': expected a positive "
                         "number, got 0.0");
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
  j["device"]["gemm_streaming_gb_s"] = 10;
  EXPECT_EQ(error_of(j), "c.json: field 'device.gemm_streaming_gb_s': needs measured 'gemm' rates (the roofline "
                         "counts operand traffic itself)");
  j = base();
  j["device"]["first_touch_gb_s"] = 0;
  EXPECT_EQ(error_of(j), "c.json: field 'device.first_touch_gb_s': expected a positive number, got 0");
  j = base();
  j["devices_per_node"] = 2.5;
  EXPECT_EQ(error_of(j), "c.json: field 'devices_per_node': expected an integer in [1, 1024], got 2.5");
  // A node of several devices needs the link between them; one device per node has none (a one-rank
  // profile measures none, and writes none).
  j = base();
  j.erase("intra_node");
  EXPECT_EQ(error_of(j), "c.json: field 'intra_node': missing (a node of 4 devices needs the link between them; "
                         "profile on as many ranks as a node has devices)");
  j["devices_per_node"] = 1;
  const Cluster one = Cluster::from_json(j, "c.json");
  EXPECT_EQ(one.intra.bandwidth, 0);
  EXPECT_FALSE(one.to_json().contains("intra_node"));
  EXPECT_EQ(Cluster::from_json(one.to_json(), "again").inter.bandwidth, 20e9);
}

}  // namespace
