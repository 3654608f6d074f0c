// What one rank of a training run holds in memory, computed before anything large is allocated,
// from (model config, options, layout) by the functions that size the real buffers: plan_buffer
// (parameters and gradients, as Params allocates them), bucket_shards (ZeRO), slot_bytes /
// recompute_bytes / schedule_activation_peak (activations, as the pipeline keeps them),
// workspace_bytes (the model's work buffers) and Pipeline::buffer_bytes. The
// trainer checks it against the machine before building the model; the planner calls it for every
// layout it predicts, keeping rank_buffers' figures per stage and layout (they are the costly part).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/params.h"
#include "train/trainer.h"

namespace origami {

struct MemoryParts {
  int64_t weights = 0;      // this rank's parameter buffer (its TP shard of its stage, bucket padding), and
                            // in bf16 its bf16 copy
  int64_t grads = 0;        // gradient buffer of the same layout, plus ZeRO's reduced shard (and ZeRO-2's accumulator)
  int64_t optimizer = 0;    // AdamW moments of the elements this rank updates (its ZeRO shard)
  int64_t activations = 0;  // the schedule's activation peak (the act_bytes_computed metric)
  int64_t workspace = 0;    // model work buffers, pipeline message buffers, the step's tokens, the sampler, MPI's
                            // scratch for the gradient reductions in flight
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

// One parameter set's buffer on one rank, as plan_buffer lays it out and bucket_shards shares it.
struct BufferFigures {
  int64_t size = 0;        // floats of the buffer, padding included
  int64_t buckets = 0;     // floats of its buckets (what the data-parallel collectives move)
  int64_t data = 0;        // tensor elements (no padding)
  int64_t shard = 0;       // floats of this rank's shards of the buckets (ZeRO)
  int64_t shard_data = 0;  // tensor elements inside those shards
  int64_t largest = 0;      // floats of its largest bucket
  std::vector<int64_t> pass_buckets;  // per chunk: floats of the buckets its backward pass writes (pass_buckets)
  int64_t largest_pair = 0; // ZeRO ≥ 2's most floats of whole buckets resident beside the shards: the
                            // one reducing and those backward is writing (a replay of backward)
  // ZeRO-3 (unit-aligned buckets): floats of the buckets of each unit (param_unit) and of its copy
  // buckets (ParamLayout::copy_buckets: gathered as bf16), of those the LM head's gather takes (the
  // head unit's and the tied embedding's), and of this rank's shards of the copy buckets (whose copy
  // it keeps). gathered_held: the most bytes gathered beyond the shards at once — a unit and the next
  // one prefetched (forward: the embedding, then the layers in order; backward the same pairs
  // reversed), or the head alone —, a unit holding the other ranks' values (fp32; a copy bucket's as
  // bf16) and under bf16 the copy of its other buckets whole.
  std::map<int64_t, int64_t> unit_floats, unit_copy;
  int64_t head_gather = 0, head_gather_copy = 0, shard_copy = 0;
  int64_t copy = 0;  // floats of the copy buckets (ZeRO ≥ 1 under bf16: gathered as bf16)
  int64_t gathered_held = 0;
  int64_t largest_unit = 0;  // floats of the largest unit (FSSDP gathers one MoE layer's experts at a time)
  // Per unit: tensor elements, and those inside this rank's shards (FSSDP's traffic).
  std::map<int64_t, int64_t> unit_data, unit_shard_data;
};

// What a rank's memory and gradient traffic depend on in its parameter buffers: the dense tensors
// (TP shard, buckets over DP × CP) and its experts (ETP shard, buckets over EDP).
struct RankBuffers {
  BufferFigures dense, experts;
  // Dense elements whose gradients TP sums (DataParallel): token-partial ones whenever TP has more
  // than one rank, sequence-partial ones under SP; [0] in the whole buffer (what ZeRO 0 updates),
  // [1] in this rank's shards (ZeRO 1 and 2).
  int64_t token_partial[2] = {0, 0}, seq_only_partial[2] = {0, 0};
  std::vector<int64_t> shared_buckets;  // floats of each dense bucket holding the tied embedding (pp_shared)
  // Those this rank updates and TP sums in a layout with ZeRO stage `zero`, TP degree `tp`, SP `sp`.
  int64_t tp_partial(int zero, int tp, bool sp) const {
    const int owned = zero > 0 ? 1 : 0;
    return (tp > 1 ? token_partial[owned] : 0) + (sp && tp > 1 ? seq_only_partial[owned] : 0);
  }
};

// The tables come from the stage's make_param_table cut by split_experts for this rank's EP rank (the
// planner keeps them per stage); the first form builds them. The figures do not depend on the ZeRO
// stage or SP. Throws Error for an invalid layout, and naming size_inputs for a size that overflows.
RankBuffers rank_buffers(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank);
RankBuffers rank_buffers(const TrainOptions& o, int world_size, int rank, const SplitTable& tables,
                         const std::vector<LayerRange>& chunks);

// The inputs that size a run, in words, for the error when a size overflows 64-bit arithmetic
// (core/checked.h): the model's dimensions and, given options, --micro-batch and --seq-len.
std::string size_inputs(const ModelConfig& cfg, const TrainOptions* o = nullptr);
// The model's parameter count; an Error naming size_inputs when it overflows.
int64_t checked_num_parameters(const ModelConfig& cfg);

// The pipeline message buffers of [Nl, C] stage `stage` of `pp` holds at most in a step
// (Pipeline::buffer_bytes' count, with or without vocabulary parallelism's passes) over every count of
// micro-batches a step may take: `micro`, or under document batching any up to it (each step packs its
// own, and the count is not monotone in it: a list with no forward after a backward counts all its
// sends). What the memory check counts, and what the trainer holds each step to.
int64_t pipeline_message_buffers(const TrainOptions& o, int pp, int stage, int micro, bool vocab);

// Rank `rank` of a `world_size`-rank run with options `o`; `runtime` is that rank's measured resident
// memory before the run (resident_bytes()), `sampler` what its WindowSampler will take
// (WindowSampler::bytes()). Throws Error for an invalid layout, and naming size_inputs for a size that
// overflows. `buffers`: rank_buffers' figures.
MemoryParts rank_memory(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank, int64_t runtime,
                        int64_t sampler = 0);
MemoryParts rank_memory(const ModelConfig& cfg, const TrainOptions& o, int world_size, int rank,
                        const RankBuffers& buffers, int64_t runtime, int64_t sampler = 0);

}  // namespace origami
