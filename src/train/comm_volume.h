// The bytes one rank sends on each communicator in one training step, predicted from the model,
// the options and the layout by the rules the runtime follows — the figures `origami train
// --metrics` measures as comm_bytes (comm.h's accounting: a ring all-reduce of S bytes over n ranks
// sends 2(n−1)/n·S, an all-gather or reduce-scatter of a full buffer of S bytes (n−1)/n·S, an
// all-to-all the bytes for the others). The planner's communication times start from these.
//
// Keys are the metrics': "tp", "cp" (the attention's own groups), "dp" or "dp-cp" (dense gradients),
// "edp" (experts' gradients), "tp" or "tp-cp" (the router's counts), "ep" and "etp" (the token
// dispatcher), "pp" (activations between stages), "embedding" (the tied embedding's gradient between
// the first and last stage) and "world" (the gradient norm and the step's metrics). A group of one
// rank sends nothing and has no entry.
//
// Exact for every layout except the dispatcher's payloads, which depend on where the router sends
// tokens: they are counted for tokens spread evenly over the experts, times `imbalance` (the busiest
// EP rank's rows over the mean). The dispatcher's row-count exchanges are exact.
#pragma once
#include <map>
#include <string>

#include "model/config.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

namespace origami {

// o: the run's options (resolved: global batch set); cfg: with the run's routing options
// (TrainOptions::with_routing). Throws Error for a layout validate() refuses.
std::map<std::string, double> step_comm_bytes(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank,
                                              double imbalance = 1.0);
// The same from the rank's buffer figures (rank_buffers, which the planner keeps per stage); o validated.
std::map<std::string, double> step_comm_bytes(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank,
                                              const RankBuffers& buffers, double imbalance = 1.0);

// ZeRO-1/2's parameter all-gather in a step, the part of a parameter set's data-parallel bytes that is
// not a gradient reduction (over `group` ranks; fp32 values but for the copy buckets' bf16 copy); 0
// under ZeRO 0 and 3 (whose gathers are per unit, in the passes) and on one rank.
double zero_gather_bytes(const BufferFigures& buffer, int group, int zero);

}  // namespace origami
