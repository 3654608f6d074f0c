#include "plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "model/model.h"
#include "model/params.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"
#include "train/comm_volume.h"

namespace origami {

nlohmann::json Prediction::as_json() const {
  nlohmann::json exposed = nlohmann::json::object();
  for (const auto& [axis, s] : exposed_s) exposed[axis] = s;
  nlohmann::json mem = memory.as_json(), stages = nlohmann::json::array();
  mem["rank"] = memory_rank;
  mem["total"] = memory.total();
  for (const MemoryParts& m : stage_memory) stages.push_back(m.as_json());
  return {{"step_time_s", step_s}, {"tokens_per_s", tokens_per_s}, {"mfu", mfu}, {"compute_s", compute_s},
          {"bubble_s", bubble_s}, {"exposed_s", exposed}, {"memory_bytes_per_rank", mem},
          {"memory_bytes_per_stage", stages}, {"comm_bytes", comm_bytes},
          {"dominant", dominant}};
}

namespace {

// Seconds of one GEMM y[M, N] = x[M, K]·W (2·M·N·K FLOPs) at the cluster's rate for its size.
double gemm_s(const Cluster& c, double M, double N, double K) {
  return M > 0 && N > 0 && K > 0 ? 2 * M * N * K / c.gemm_rate(M, N, K) : 0;
}
// A linear layer of `rows` rows, in → out features: forward, and backward (input and weight gradients).
struct Pass {
  double fwd = 0, bwd = 0;
  Pass& operator+=(const Pass& o) {
    fwd += o.fwd, bwd += o.bwd;
    return *this;
  }
};
Pass linear(const Cluster& c, double rows, double in, double out) {
  return {gemm_s(c, rows, out, in), gemm_s(c, rows, in, out) + gemm_s(c, out, in, rows)};
}

// Whether the ranks of `rank`'s group along `axes` sit on more than one node.
bool spans_nodes(const MeshShape& mesh, int rank, const std::string& axes, int per_node) {
  std::set<int> nodes;
  for (int r : mesh.group(rank, axes)) nodes.insert(r / per_node);
  return nodes.size() > 1;
}

}  // namespace

Prediction predict(const ModelConfig& cfg, const TrainOptions& options, int devices, const Cluster& cluster,
                   int64_t runtime, double imbalance) {
  const TrainOptions o = options.resolved(devices);
  o.validate(cfg, devices);
  const MeshShape mesh(devices, o.layout_dims(devices), o.mesh_order);
  const MeshDims& m = mesh.dims();
  const int t = m.tp, c = m.cp, p = m.pp, v = o.vpp;
  const bool sp = o.sequence_parallel && t > 1;
  const int64_t B = o.micro_batch, T = o.seq_len, G = o.global_batch, micro = o.micro_batches(devices);
  const double N = double(B * T / c), C = double(cfg.hidden), D = double(cfg.head_dim);
  const double H = double(cfg.num_heads / t), KV = double(cfg.num_kv_heads / t);
  const Recompute rc = parse_recompute(o.recompute);
  const std::vector<LayerRange> stages = partition_layers(int(cfg.num_layers), p, v, o.pp_layers);
  const int per_node = cluster.devices_per_node;
  auto tier = [&](int rank, const std::string& axes) { return spans_nodes(mesh, rank, axes, per_node); };

  Prediction out;
  // Each stage's representative, its first rank: every other coordinate 0 (rank 0's pipeline group).
  const std::vector<int> stage_ranks = mesh.group(0, "pp");
  // Per stage: compute and blocking communication of one micro-batch (all its chunks).
  double worst_f = 0, worst_b = 0, worst_compute = 0;
  std::map<std::string, double> worst_exposed;
  for (int s = 0; s < p; ++s) {
    const int rank = stage_ranks[size_t(s)];
    const ModelPart part = ModelPart::of_stage(stages, p, s);
    Pass compute;
    double attention = 0;  // forward + backward of the stage's attention cores
    for (const LayerRange& r : part.chunks)
      for (int64_t l = r.begin; l < r.end; ++l) {
        compute += linear(cluster, N, C, (H + 2 * KV) * D);  // q|k|v
        compute += linear(cluster, N, H * D, C);             // attention output
        attention += 6 * double(T) * H * D * N / cluster.attention_flops;
        if (!cfg.is_moe_layer(l)) {
          const double F = double(cfg.ffn / t);
          compute += linear(cluster, N, C, cfg.is_gpt2() ? F : 2 * F);
          compute += linear(cluster, N, F, C);
          continue;
        }
        // The router on this rank's share of the tokens; the local experts on the rows routed to them.
        const double share = N / t, E = double(cfg.num_experts), El = E / m.ep, Fe = double(cfg.expert_ffn / m.etp);
        compute += linear(cluster, share, C, E);
        const double rows = share * double(cfg.top_k) * m.etp * imbalance / El;  // per local expert
        for (int e = 0; e < int(El); ++e) {
          compute += linear(cluster, rows, C, 2 * Fe);
          compute += linear(cluster, rows, Fe, C);
        }
        if (cfg.shared_ffn > 0) {
          const double Fs = double(cfg.shared_ffn / t);
          compute += linear(cluster, N, C, 2 * Fs);
          compute += linear(cluster, N, Fs, C);
        }
      }
    if (part.head) compute += linear(cluster, N, C, double((cfg.vocab_size + t - 1) / t));
    // Recomputation: the layer's forward (full) or the attention core's (selective) again in backward.
    double fwd = compute.fwd + attention / 3, bwd = compute.bwd + 2 * attention / 3;
    if (rc == Recompute::full) bwd += compute.fwd + attention / 3;
    if (rc == Recompute::selective) bwd += attention / 3;
    const double busy = fwd + bwd;
    // Blocking communication per micro-batch, from the stage rank's bytes per step.
    const std::map<std::string, double> bytes = step_comm_bytes(cfg, o, devices, rank, imbalance);
    if (s == 0) out.comm_bytes = bytes;
    auto per_micro = [&](const std::string& key, const std::string& axes, int steps) {
      const auto it = bytes.find(key);
      return it == bytes.end() ? 0.0 : cluster.transfer_seconds(it->second / double(micro), steps, tier(rank, axes));
    };
    std::map<std::string, double> exposed;
    const double layers = double(part.num_layers());
    exposed["tp"] = per_micro("tp", "tp", int(layers * 6 + 3) * 2 * (t - 1));
    exposed["tp-cp"] = per_micro("tp-cp", "tp-cp", int(layers) * 2 * (t * c - 1));
    exposed["ep"] = per_micro("ep", "ep", int(layers) * 6 * (m.ep - 1)) + per_micro("etp", "etp", int(layers) * 6 * (m.etp - 1));
    exposed["cp"] = std::max(0.0, per_micro("cp", "cp", int(layers) * 2 * c) - attention);
    if (p > 1)  // one message after each forward and backward of a chunk
      exposed["pp"] = 2 * v * cluster.transfer_seconds(4 * (sp ? N / t : N) * C, 1, tier(rank, "pp"));
    double blocking = 0;
    for (const auto& [k, x] : exposed) blocking += x;
    const double f = fwd + blocking * fwd / busy, b = bwd + blocking * bwd / busy;
    if (f + b > worst_f + worst_b) worst_f = f, worst_b = b, worst_compute = busy, worst_exposed = exposed;
  }
  // The schedule with the busiest stage's times on every stage.
  std::vector<std::vector<Action>> lists;
  for (int s = 0; s < p; ++s) lists.push_back(make_schedule(o.schedule_kind(), p, s, int(micro), v));
  const Replay replay = replay_schedules(lists, p, int(micro), v, worst_f / v, worst_b / v);
  out.compute_s = double(micro) * worst_compute;
  for (const auto& [k, x] : worst_exposed)
    if (x > 0) out.exposed_s[k] = double(micro) * x;
  out.bubble_s = replay.makespan - double(micro) * (worst_f + worst_b);

  // After backward: the gradient buckets' tail (the last bucket of each set; ZeRO's parameter gather
  // whole), the tied embedding and the world's reductions; then AdamW's pass over the owned state.
  double after = 0;
  const double bucket = o.bucket_mb * 1024 * 1024;  // bytes of fp32 gradients per bucket
  for (const char* key : {"dp", "dp-cp", "edp"}) {
    const auto it = out.comm_bytes.find(key);
    if (it == out.comm_bytes.end()) continue;
    const std::string axes = key;
    const int group = axes == "edp" ? m.edp : axes == "dp" ? m.dp : m.dp * c;
    const bool inter = tier(0, axes == "edp" ? "edp" : "dp-cp");
    const double total = it->second, gather = o.zero > 0 ? total / (o.zero == 2 ? double(micro * v) + 1 : 2) : 0;
    const double tail = std::min(total - gather, all_reduce_bytes(group, bucket));
    out.exposed_s[axes] = cluster.transfer_seconds(tail + gather, 2 * (group - 1), inter);
    after += out.exposed_s[axes];
  }
  for (const char* key : {"embedding", "world"}) {
    const auto it = out.comm_bytes.find(key);
    if (it == out.comm_bytes.end()) continue;
    // A few doubles: latency-bound, a tree's 2·log2(n) steps per all-reduce (two of them for the world).
    const int n = std::string(key) == "world" ? devices : 2, steps = 2 * int(std::ceil(std::log2(double(n))));
    out.exposed_s[key] = cluster.transfer_seconds(it->second, (std::string(key) == "world" ? 2 : 1) * steps,
                                                  std::string(key) == "world" ? devices > per_node : tier(0, "pp"));
    after += out.exposed_s[key];
  }
  // Memory: every stage's first rank (the others differ only by ZeRO padding and shards).
  for (int r : stage_ranks) {
    out.stage_memory.push_back(rank_memory(cfg, o, devices, r, runtime));
    if (out.stage_memory.back().total() > out.memory.total()) out.memory = out.stage_memory.back(), out.memory_rank = r;
  }
  if (cluster.memory_bandwidth > 0)  // AdamW: weights, gradients and two moments read, three written
    out.exposed_s["optimizer"] = double(out.memory.weights) * 7 / cluster.memory_bandwidth, after += out.exposed_s["optimizer"];
  out.step_s = replay.makespan + after;
  out.tokens_per_s = double(G * T) / out.step_s;
  out.mfu = train_flops_per_token(cfg, T) * double(G * T) / (out.step_s * devices * cluster.peak_flops);
  double largest = out.compute_s;
  out.dominant = "compute";
  if (out.bubble_s > largest) largest = out.bubble_s, out.dominant = "bubble";
  for (const auto& [k, x] : out.exposed_s)
    if (x > largest) largest = x, out.dominant = k;
  return out;
}

}  // namespace origami
