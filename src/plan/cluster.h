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
//                                                            then optional: element-wise work and AdamW use it),
//               "gemm_streaming_gb_s": ..,                   with them: the rate a call's operands stream from
//                                                            memory at beyond the in-cache rates (M·K + K·N + M·N
//                                                            elements; absent: operands cost nothing more)
//               "gemm_streaming_accumulating_gb_s": ..,      the same for calls that add into C (weight
//                                                            gradients: C is read and written; absent: the above)
//               "first_touch_gb_s": ..,                      writing into pages returned to the system (ZeRO ≥ 2's
//                                                            gradient buffer, refilled every micro-batch; absent:
//                                                            not priced)
//               "attention_tflops": ..,                      the attention core's achieved rate (causal FLOPs; on a
//                                                            GPU at long sequences and head size 128)
//               "sms": ..,                                   GPU: streaming multiprocessors, for the GEMMs' tile and
//                                                            wave quantization and attention's diagonal tiles
//               "kernel_overhead_us": ..,                    what each kernel launch adds (default 0)
//               "bf16": {"peak_tflops", "gemm_efficiency" or "gemm" (and the streaming rates),
//                        "attention_tflops"}},
//                                                            the rates under --precision bf16 (absent: the ones above)
//    "comm_overlap": ..,                                      the part of a transfer that proceeds while the device
//                                                            computes (1: a copy engine or NCCL's own SMs; default 1)
//    "overlap": {"dp": .., "cp": .., "param-gather": .., "tp": .., "ep": .., "pp": ..},   per kind (each
//                                                            optional): the data-parallel buckets behind backward,
//                                                            CP's ring behind attention (default comm_overlap for
//                                                            both); ZeRO-1/2's parameter gather behind the next
//                                                            forward, TP/SP regions, the MoE dispatcher, pipeline
//                                                            messages (default 0: blocking, as origami runs them)
//    "intra_node": {"bandwidth_gb_s": .., "latency_us": ..},  per device, as Comm counts bytes (comm.h: a ring
//    "inter_node": {"bandwidth_gb_s": .., "latency_us": ..},  all-reduce of S bytes over n sends 2(n−1)/n·S);
//                                                            intra_node may be absent with one device per node,
//                                                            inter_node with one node
//    "collectives": {"all_gather": {"bandwidth_gb_s", "latency_us"}, "reduce_scatter": .., "all_to_all": ..,
//                    "send_recv": ..}}                       optional, within a node: the other collectives' own
//                                                            rates (`origami profile` measures them; the tiers'
//                                                            links are the all-reduce's)
//    Each link or collective may add "bandwidth_by_size": [[KiB per message step, GB/s], ...], its
//    bandwidth measured by message size (ascending; `origami profile` writes it: on a CPU messages that
//    stay in the caches move several times faster than large ones); "bandwidth_gb_s" is then the
//    largest message's.
//
// Units in the file are human ones (GB = 1e9 bytes, TFLOP/s, µs); the struct holds SI units.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace origami {

struct LinkTier {
  double bandwidth = 0;  // bytes/s one device sends (the bytes Comm counts)
  double latency = 0;    // seconds per message step
  // Measured bandwidth by size: (bytes per message step, bytes/s), ascending (empty: `bandwidth`).
  std::vector<std::pair<double, double>> by_size;
  // The bandwidth of messages of `step_bytes` per step: by_size interpolated in log size, flat
  // beyond its ends.
  double bandwidth_at(double step_bytes) const;
};

// The compute rates of one element type: the device's, and under bf16 its "bf16" object's.
struct ComputeRates {
  double peak_flops = 0;              // per device: the dense matmul peak MFU is measured against
  double gemm_efficiency = 1;         // of the roofline
  std::vector<std::pair<double, double>> gemm;  // (FLOPs of one GEMM, achieved FLOP/s), ascending
  double gemm_streaming = 0;          // bytes/s a measured curve's calls read operands from memory at (0: free)
  double gemm_streaming_accumulating = 0;  // the same for calls that add into C (0: gemm_streaming)
  double attention_flops = 0;         // achieved FLOP/s of the attention core
};

struct Cluster : ComputeRates {  // (the rates of the precision it is at: fp32 as read, at(bf16) for bf16)
  std::string name, source;
  int nodes = 1, devices_per_node = 1;
  int threads_per_rank = 0;           // a CPU rank's threads, as profiled (each may hold attention scratch; 0:
                                      // not stated, priced as 1)
  double memory_bytes = 0;            // per device
  double memory_bandwidth = 0;        // bytes/s (roofline, element-wise work, AdamW; 0: not known)
  double first_touch = 0;             // bytes/s written into fresh pages (0: not priced)
  std::optional<ComputeRates> bf16;   // the file's bf16 rates (none: bf16 GEMMs run at the fp32 rates)
  int element_bytes = 4;              // of a GEMM operand: 4 (fp32), 2 (bf16)
  bool rounds_operands = false;       // bf16 on a CPU, as origami's kernels run it: activations stay fp32
                                      // (4 bytes), GEMM operands are rounded to bf16
  int activation_bytes() const { return rounds_operands ? 4 : element_bytes; }  // streamed, and sent between stages
  int sms = 0;                        // GPU: streaming multiprocessors (0: no tile model, a CPU)
  double kernel_overhead = 0;         // seconds each kernel launch adds
  LinkTier intra, inter;
  std::map<std::string, LinkTier> collectives;  // within a node, by collective (none: every one at intra's rate)
  bool inter_given = false;           // the file describes the link between nodes
  double comm_overlap = 1;            // of a transfer that can hide behind compute, [0, 1]
  std::map<std::string, double> overlap;  // per kind, as the file gives it

  int devices() const { return nodes * devices_per_node; }
  // The same cluster computing in `precision` ("fp32" | "bf16"): bf16 takes the file's bf16 rates
  // where it has them, and 2-byte elements.
  Cluster at(const std::string& precision) const;
  // The part of a transfer of `kind` ("dp", "param-gather", "cp", "tp", "ep", "pp") that hides behind compute.
  double overlap_of(const std::string& kind) const;
  // Achieved FLOP/s of one GEMM of M×N×K (2·M·N·K FLOPs): from the measured curve (interpolated in
  // log FLOPs, flat beyond its ends; those are in-cache rates, so the call's operands, M·K + K·N + M·N
  // elements, add their bytes over gemm_streaming, or gemm_streaming_accumulating for a call that adds
  // into C), or the roofline of peak (on a GPU less its tile and wave quantization, gemm_tile_share)
  // and memory bandwidth (the same traffic) times gemm_efficiency.
  double gemm_rate(double M, double N, double K, bool accumulate = false) const;
  // Achieved FLOP/s of the attention core at sequence length T and head size D: attention_flops,
  // on a GPU less the causal diagonal's half-empty 128-row tiles, T / (T + 128), and the per-tile
  // softmax work that does not scale with D, (D / (D + 32)) relative to D = 128.
  double attention_rate(double T, double D) const;
  // Seconds of a collective that sends `bytes` (as Comm counts them) in `steps` latency-bound
  // message steps (a count; a double, as a huge layout's exceed 2^31), over the tier the group
  // spans: within a node at the collective's own measured rate ("all_reduce", "all_gather",
  // "reduce_scatter", "all_to_all", "send_recv") where the file gives one, else at the tier's; at the bandwidth of messages of `step_bytes` per step (0: bytes/steps,
  // or with steps 0 one message of all the bytes).
  double transfer_seconds(double bytes, double steps, bool inter_node, const std::string& collective = "all_reduce",
                          double step_bytes = 0) const;
  // An all-to-all over `group` ranks of which `in_node` share the sender's node: each peer gets an
  // equal part of `bytes`, the ones in the node over its links and the rest across nodes, both at once.
  // `calls`: the all-to-alls `bytes` is the sum of (each sends group − 1 messages, a latency step each:
  // the latency per message step that `origami profile` measures, as the rings' tiers give theirs).
  double all_to_all_seconds(double bytes, double calls, int group, int in_node) const;

  // Errors name the file, the field and the rule.
  static Cluster from_json(const nlohmann::json& j, const std::string& source);
  static Cluster load(const std::string& path);
  nlohmann::json to_json() const;
};

// A streaming rate from timings of the same calls in cache and cold. Per call: its operand bytes, its
// seconds cold and in cache. The rate r minimizes the relative error of the cold times predicted as
// in-cache + bytes / r: Σ ((cold − hot − bytes/r) / cold)², so the calls whose operands weigh most
// against their work (few rows) decide it, rather than the largest calls' small, noisy differences.
// 0 when the cold calls are not slower.
struct StreamedCall {
  double bytes, cold_s, hot_s;
};
double fit_streaming_rate(const std::vector<StreamedCall>& calls);

// The best share of a GPU's peak an output of M×N rows and columns can use: over cuBLAS's tile shapes
// (NVIDIA, Matrix Multiplication Background User's Guide: tile and wave quantization), the useful part
// of the tiles the SMs run in whole waves, times the tile's operand reuse tm·tn/(tm + tn) relative to
// a 128×128 tile's (smaller tiles wait on shared memory; larger ones gain nothing more).
double gemm_tile_share(double M, double N, int sms);

}  // namespace origami
