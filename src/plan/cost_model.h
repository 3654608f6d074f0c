// The planner's cost model: what one layout of a training run costs on a cluster — step time by
// part, memory per rank, MFU — from the runtime's own functions where they exist and a stated model
// of time where they cannot (DESIGN.md, "Planner").
//
// Exact, because the runtime computes them the same way before it runs: the memory of every rank
// (rank_memory: weights, gradients, optimizer state, the schedule's activation peak, work buffers)
// and the bytes every rank sends per communicator (step_comm_bytes). Modelled:
//   compute   each layer's GEMMs (this rank's TP / ETP shards, its share of the tokens under CP and
//             of the routed rows under EP) at the cluster's achieved rate for that GEMM's size and the
//             run's precision; the attention core at its achieved rate (causal FLOPs); element-wise
//             work at memory bandwidth; each kernel launch's overhead; backward twice the forward; a
//             recomputed forward (full: the layer's, selective: the attention core's) again
//   exposed   communication on the critical path, each kind less what the cluster overlaps of it
//             (Cluster::overlap_of): TP regions, the MoE dispatcher (all-to-alls split over the
//             tiers) and pipeline messages add to each forward and backward; the CP ring hides behind
//             the attention core; data-parallel buckets overlap backward except the last, and ZeRO's
//             parameter gather, the world's reductions and AdamW follow the step
//   bubble    the stage schedules the executor runs with the busiest stage's forward and backward
//             times for every stage: their fill and drain, (p − 1)/v of a micro-batch (what a replay
//             of them gives), and under vocabulary parallelism replayed (replay_schedules) with its
//             output passes placed as the executor places them (with_vocab_passes)
// The MoE dispatcher's payload and expert rows assume evenly routed tokens times the routing skew at
// the layout's EP degree (plan/routing_skew.h).
#pragma once
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "model/config.h"
#include "model/params.h"
#include "plan/cluster.h"
#include "plan/routing_skew.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

namespace origami {

struct Prediction {
  bool fits = true;                          // false: the neediest rank's memory is over the limit (nothing else filled in)
  double step_s = 0;
  double compute_s = 0;                      // the busiest stage's compute in the step
  double bubble_s = 0;                       // that stage's idle time in the schedule
  std::map<std::string, double> compute_parts;  // compute_s by term: gemm, attention, elementwise, kernels
  std::map<std::string, double> exposed_s;   // per communicator (and the optimizer, ZeRO-2's page faults): time
                                             // not hidden behind compute
  double tokens_per_s = 0;
  double mfu = 0;                            // model FLOPs / (step time × devices × peak)
  MemoryParts memory;                        // the neediest rank's
  int memory_rank = 0;
  std::vector<MemoryParts> stage_memory;     // per pipeline stage: its first rank's
  std::map<std::string, double> comm_bytes;  // rank 0's per step
  std::string dominant;                      // the largest of compute, bubble and each exposed part
  nlohmann::json as_json() const;
  // The step time's parts, adding up to step_s: each compute term, the bubble, each exposed part.
  std::vector<std::pair<std::string, double>> breakdown() const;
};

// One model on `devices` ranks of a cluster (ranks fill nodes in order). It keeps what layouts share —
// each stage's parameter tables and buffer figures, per-layer GEMM times — so a search over many
// layouts pays for each once. cfg: with the run's routing options; runtime: the per-rank process
// memory to count (bytes); skew: the busiest EP rank's routed rows over the mean at each EP degree.
class CostModel {
 public:
  struct Pass {  // seconds of a forward and of its backward
    double fwd = 0, bwd = 0;
    Pass& operator+=(const Pass& o) {
      fwd += o.fwd, bwd += o.bwd;
      return *this;
    }
  };

  CostModel(const ModelConfig& cfg, const Cluster& cluster, int devices, int64_t runtime = 0, RoutingSkew skew = {});

  // Validates o (an Error as validate() words it) and predicts. When the neediest rank needs more
  // than memory_limit bytes only the memory is filled in, and fits is false.
  Prediction predict(const TrainOptions& o, double memory_limit = std::numeric_limits<double>::infinity());

  // A lower bound of predict(o).step_s, at a fraction of its cost: the busiest stage's compute for
  // every micro-batch plus the pipeline's fill and drain, (m + (p − 1)/v)·(f + b), and under
  // vocabulary parallelism m output passes; no communication.
  // The search evaluates layouts in the order of this bound and stops when it exceeds the K-th best.
  // o: resolved, with degrees that divide the devices (not otherwise validated).
  double step_bound(const TrainOptions& o);
  // Why o's layers do not split over its pipeline (the error partition_layers or the stage parts
  // give), or null when they do: the search asks once per split, not per layout (an exception per
  // layout was ~15% of a search).
  const std::string* split_refusal(const TrainOptions& o);
  int64_t num_tensors() const { return num_tensors_; }  // of the whole model

 private:
  struct StageCompute {
    double fwd = 0, bwd = 0;  // one micro-batch through all the stage's chunks, recomputation included
    double attention = 0;     // forward + backward of its attention cores (what the CP ring hides behind)
    double vocab = 0;         // vocabulary parallelism: its output passes' compute (this rank's slice of the LM head)
  };
  // Per layer type, one micro-batch on this rank: the GEMMs' forward and backward, and the attention
  // core's forward + backward.
  struct LayerCosts {
    Pass attention_linears, dense_mlp, moe_mlp, head;
    Pass final_norm;  // what the last stage's final norm adds to the head (SP's reorders), vocabulary parallel or not
    double attention_core = 0;
  };
  // The terms of compute, for the breakdown (a mask; kAll: the whole).
  enum Terms { kGemm = 1, kAttention = 2, kStreamed = 4, kKernels = 8, kAll = 15 };
  const LayerCosts& layer_costs(const TrainOptions& o, const MeshDims& m, int terms);
  // Each stage's part of o's layers over pp stages, computed once per split; no parts when refused,
  // with why (partition_layers' or the stage parts' error).
  struct Split {
    std::vector<ModelPart> parts;
    std::string refusal;
  };
  const Split& split(const TrainOptions& o, int pp);
  const std::vector<ModelPart>& stage_parts(const TrainOptions& o, int pp);
  std::vector<StageCompute> stage_compute(const TrainOptions& o, const MeshDims& m, int terms = kAll);
  const Cluster& at(const TrainOptions& o) const { return o.precision == "bf16" ? bf16_ : cluster_; }
  std::map<std::string, double> stage_exposed(const TrainOptions& o, const MeshShape& mesh, const Cluster& cluster,
                                              int stage, const std::map<std::string, double>& bytes, double attention);
  double fssdp_staging_bytes(const TrainOptions& o, const BufferFigures& experts, const ModelPart& part, int n);
  std::map<std::string, double> gradient_exposed(const TrainOptions& o, const MeshShape& mesh, const Cluster& cluster,
                                                 double f, double b, int rank, const std::map<std::string, double>& bytes);
  double after_backward(const TrainOptions& o, const MeshShape& mesh, const Cluster& cluster, double f, double b,
                        const std::vector<std::map<std::string, double>>& stage_bytes, Prediction& out);
  double makespan_units(const TrainOptions& o, int64_t micro, double backward, double vocab);
  const RankBuffers& buffers(const TrainOptions& o, const MeshShape& mesh, int rank);

  ModelConfig cfg_;
  int64_t num_tensors_;  // of the whole model (make_param_table)
  Cluster cluster_, bf16_;  // as read (fp32), and at bf16
  int devices_;
  int64_t runtime_;
  RoutingSkew skew_;
  std::map<std::tuple<int, int, std::vector<int>, bool>, Split> splits_;  // (pp, vpp, pp_layers, vocab)
  std::map<std::tuple<int, int, int, int, int64_t, int64_t, bool, bool, int>, LayerCosts> layers_;  // (tp, cp, ep, etp, B, T, sp, bf16, terms)
  std::map<std::tuple<int, int, std::vector<int>, int, int, int, bool>, SplitTable> tables_;  // (pp, vpp, pp_layers, stage, ep, ep rank, vocab)
  // (tp, cp, dp, pp, ep, etp, vpp, bucket MiB, rank, mesh order, pp_layers)
  using BufferKey = std::tuple<int, int, int, int, int, int, int, double, int, int, std::string, std::vector<int>>;  // ... bucket_mb, unit buckets (1: ZeRO-3, 2: FSSDP's experts, 4: bf16, 8: vocabulary parallelism, 16: ZeRO's bf16 copy buckets, TrainOptions::param_layout), ...
  std::map<BufferKey, RankBuffers> buffers_;
  std::map<std::tuple<int, int, int64_t, int, double, double>, double> makespans_;  // (schedule, p, m, v, b/f, vocab/f): makespan / f
};

}  // namespace origami
