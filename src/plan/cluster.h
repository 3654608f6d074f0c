// A cluster the planner predicts for: its devices and the links between them, read from a
// cluster.json. GPU clusters are described from documented hardware figures (configs/clusters/);
// `origami profile` measures this machine and writes the same format (DESIGN.md, "Planner").
//
//   {"name": ..., "source": "where every figure comes from",
//    "nodes": N, "devices_per_node": D,
//    "device": {"memory_gb": .., "peak_tflops": ..,          the dense matmul peak MFU is measured against
//               "memory_bandwidth_gb_s": .., "gemm_efficiency": ..,   a GEMM's rate: the roofline of peak and
//                                                            memory bandwidth times the efficiency ...
//               "gemm": [[gflop, tflops], ...],               ... or measured rates by GEMM size (FLOPs of one
//                                                            call), which take precedence (the bandwidth is
//                                                            then optional: element-wise work and AdamW use it)
//               "attention_tflops": ..},                     the attention core's achieved rate (causal FLOPs)
//    "comm_overlap": ..,                                      the part of a transfer that proceeds while the device
//                                                            computes (1: a copy engine or NCCL's own SMs; default 1)
//    "intra_node": {"bandwidth_gb_s": .., "latency_us": ..},  per device, as Comm counts bytes (comm.h: a ring
//    "inter_node": {"bandwidth_gb_s": .., "latency_us": ..}}  all-reduce of S bytes over n sends 2(n−1)/n·S)
//
// Units in the file are human ones (GB = 1e9 bytes, TFLOP/s, µs); the struct holds SI units.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace origami {

struct LinkTier {
  double bandwidth = 0;  // bytes/s one device sends (the bytes Comm counts)
  double latency = 0;    // seconds per message step
};

struct Cluster {
  std::string name, source;
  int nodes = 1, devices_per_node = 1;
  double memory_bytes = 0;            // per device
  double peak_flops = 0;              // per device
  double memory_bandwidth = 0;        // bytes/s (roofline, element-wise work, AdamW; 0: not known)
  double gemm_efficiency = 1;         // of the roofline
  std::vector<std::pair<double, double>> gemm;  // (FLOPs of one GEMM, achieved FLOP/s), ascending
  double attention_flops = 0;         // achieved FLOP/s of the attention core
  LinkTier intra, inter;
  double comm_overlap = 1;            // of a transfer that can hide behind compute, [0, 1]

  int devices() const { return nodes * devices_per_node; }
  // Achieved FLOP/s of one GEMM of M×N×K (2·M·N·K FLOPs; 2-byte elements for the roofline's traffic
  // M·K + K·N + M·N): from the measured curve (interpolated in log FLOPs, flat beyond its ends), or
  // the roofline of peak and memory bandwidth times gemm_efficiency.
  double gemm_rate(double M, double N, double K) const;
  // Seconds of a collective step that sends `bytes` (as Comm counts them) in `steps` latency-bound
  // message steps, over the tier the group spans.
  double transfer_seconds(double bytes, int steps, bool inter_node) const;

  // Errors name the file, the field and the rule.
  static Cluster from_json(const nlohmann::json& j, const std::string& source);
  static Cluster load(const std::string& path);
  nlohmann::json to_json() const;
};

}  // namespace origami
