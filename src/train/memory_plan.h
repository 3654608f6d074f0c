// What one rank of a training run holds in memory, computed before anything large is allocated,
// from (model config, options, layout) by the functions that size the real buffers: plan_buffer
// (parameters and gradients, as Params allocates them), bucket_shards (ZeRO), slot_bytes /
// recompute_bytes / schedule_activation_peak (activations, as the pipeline keeps them),
// workspace_bytes (the model's work buffers) and Pipeline::buffer_bytes. The
// trainer checks it against the machine before building the model; the planner will call it too.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "train/trainer.h"

namespace origami {

struct MemoryParts {
  int64_t weights = 0;      // this rank's parameter buffer (its TP shard of its stage, bucket padding)
  int64_t grads = 0;        // gradient buffer of the same layout, plus ZeRO's reduced shard (and ZeRO-2's accumulator)
  int64_t optimizer = 0;    // AdamW moments of the elements this rank updates (its ZeRO shard)
  int64_t activations = 0;  // the schedule's activation peak (the act_bytes_computed metric)
  int64_t workspace = 0;    // model work buffers, pipeline message buffers, the step's tokens, the sampler
  int64_t checkpoint = 0;   // what a save (--save) adds: an asynchronous save's host copy of this rank's pieces
  int64_t runtime = 0;      // the process before the run allocates (code, libraries, MPI, thread pool), measured
  static constexpr int kCount = 7;
  static const char* name(int i);    // "weights", "gradients", ...
  static const char* advice(int i);  // what shrinks part i (for the memory check's message)
  int64_t& operator[](int i) { return this->*kMembers[size_t(i)]; }
  int64_t operator[](int i) const { return this->*kMembers[size_t(i)]; }
  int64_t total() const;
  int largest() const;          // index of the largest part
  std::string describe() const;  // "weights 7.2 MiB, gradients 7.2 MiB, ..."
  nlohmann::json as_json() const;

 private:
  static constexpr std::array<int64_t MemoryParts::*, kCount> kMembers = {
      &MemoryParts::weights,   &MemoryParts::grads,      &MemoryParts::optimizer, &MemoryParts::activations,
      &MemoryParts::workspace, &MemoryParts::checkpoint, &MemoryParts::runtime};
};

// Rank `rank` of a `world_size`-rank run with options `o`; `runtime` is that rank's measured resident
// memory before the run (resident_bytes()), `sampler` what its WindowSampler will take
// (WindowSampler::bytes()). Throws Error for an invalid layout.
MemoryParts rank_memory(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank, int64_t runtime,
                        int64_t sampler = 0);

}  // namespace origami
