// The planner's cost model: what one layout of a training run costs on a cluster — step time by
// part, memory per rank, MFU — from the runtime's own functions where they exist and a stated model
// of time where they cannot (DESIGN.md, "Planner").
//
// Exact, because the runtime computes them the same way before it runs: the memory of every rank
// (rank_memory: weights, gradients, optimizer state, the schedule's activation peak, work buffers)
// and the bytes every rank sends per communicator (step_comm_bytes). Modelled:
//   compute   each layer's GEMMs (this rank's TP / ETP shards, its share of the tokens under CP and
//             of the routed rows under EP) at the cluster's achieved rate for that GEMM's size; the
//             attention core at its achieved rate (causal FLOPs); backward twice the forward; a
//             recomputed forward (full: the layer's, selective: the attention core's) again
//   exposed   communication on the critical path: TP regions and the MoE dispatcher are blocking
//             (counted whole, at the tier their group spans); the CP ring hides behind the attention
//             core (only what exceeds it shows); pipeline messages add to each forward and backward;
//             data-parallel buckets overlap backward except the last, and ZeRO's parameter gather
//             and the world's reductions follow the step
//   bubble    the stage schedules the executor runs, replayed (replay_schedules) with the busiest
//             stage's forward and backward times for every stage
// The MoE dispatcher's payload and expert rows assume evenly routed tokens times `imbalance`.
#pragma once
#include <map>
#include <string>

#include "model/config.h"
#include "plan/cluster.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

namespace origami {

struct Prediction {
  double step_s = 0;
  double compute_s = 0;                      // the busiest stage's compute in the step
  double bubble_s = 0;                       // that stage's idle time in the schedule
  std::map<std::string, double> exposed_s;   // per communicator: time not hidden behind compute
  double tokens_per_s = 0;
  double mfu = 0;                            // model FLOPs / (step time × devices × peak)
  MemoryParts memory;                        // the neediest rank's
  int memory_rank = 0;
  std::vector<MemoryParts> stage_memory;     // per pipeline stage: its first rank's
  std::map<std::string, double> comm_bytes;  // rank 0's per step
  std::string dominant;                      // the largest of compute, bubble and each exposed part
  nlohmann::json as_json() const;
};

// o: the options of the run (layout, batch, routing) on `devices` ranks of the cluster (ranks fill
// nodes in order); cfg with the run's routing options. Throws Error for a layout validate() refuses.
// runtime: the per-rank process memory to count (bytes).
Prediction predict(const ModelConfig& cfg, const TrainOptions& o, int devices, const Cluster& cluster,
                   int64_t runtime = 0, double imbalance = 1.0);

}  // namespace origami
