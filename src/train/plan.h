// The plan of a training run: what `origami train` decides from the model config, the options and
// the world size before it reads data or talks to another rank, validated once and derived once.
// run_training (train/trainer.h) builds every part of the run from it, in the order its comment
// lists; `origami train` with flags, with --run-config and with --plan all reach it through
// make_plan. (Not the planner's output: `origami plan --out` writes options, which become a Plan
// here like any others.)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/model.h"
#include "model/params.h"
#include "parallel/context_parallel.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"
#include "train/trainer.h"

namespace origami {

struct Plan {
  TrainOptions options;       // validated, with the derived values filled in (the global batch)
  bool default_global_batch;  // the global batch is the default, micro-batch x DP (--global-batch not given)
  // With the run's routing options. run_training adds the end-of-document id of --attention-mask
  // document once it has opened the data (the tokenizer that names it comes with the data).
  ModelConfig model;
  MeshShape mesh;                          // the attention and MoE meshes over the world's ranks
  std::vector<LayerRange> virtual_stages;  // the layers of each virtual stage (partition_layers)
  ScheduleKind schedule;
  int64_t micro_batches;  // per step and DP rank: G / (B·DP)
  Recompute recompute;
  CpComm cp_comm;
  int cp_a2a;  // ranks per all-to-all group of context parallelism (1: p2p)
  Precision precision;  // of the layer GEMMs (master weights, gradients and optimizer state stay fp32)

  // Pipeline stage `stage`'s chunks of layers, and whether it holds the embedding and the LM head.
  ModelPart part(int stage) const;
};

// Errors name the value and the rule (TrainOptions::validate's messages): options, and the layout
// against the model and the world size.
Plan make_plan(const ModelConfig& cfg, const TrainOptions& opts, int world_size);
// make_plan of o with the checkpoint's step size where o gives none (with_checkpoint_step_size), whose
// line `note` gets. An error that size causes (o without it plans, or breaks another rule) ends with
// that line, as the user gave no such size.
Plan make_resumed_plan(const ModelConfig& cfg, const TrainOptions& o, int world_size, std::string* note = nullptr);

}  // namespace origami
