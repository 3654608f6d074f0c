// Data parallelism with ZeRO over the flat gradient buffer (ZeRO, Rajbhandari et al. 2020;
// Megatron's distributed optimizer). Gradients are reduced per bucket — a contiguous range of the
// buffer, see Params::buckets() — as soon as backward has finished writing it, with non-blocking
// collectives that overlap the rest of backward.
//
//   --zero 0  all-reduce each bucket; every rank updates every parameter
//   --zero 1  reduce-scatter each bucket; rank d updates only its shard (1/dp of every bucket),
//             keeps optimizer state for it only, then all-gathers the updated parameters
//   --zero 2  as 1, and gradients are reduce-scattered after every micro-batch into a shard
//             accumulator: the full gradient buffer is released (its pages returned) after each
//             reduction, so only this rank's shard stays resident between micro-batches and steps
//
// The gradient norm is the true global one: each element counted once over TP × DP (TP-replicated
// parameters on TP rank 0 only; DP-replicated gradients within this rank's shard only).
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "model/params.h"

namespace origami {

class DataParallel {
 public:
  // dp: data-parallel group; tp: tensor-parallel group (sequence-parallel gradients are reduced over it);
  // world: every rank that holds distinct gradients (for the norm).
  DataParallel(Params& params, Comm& dp, Comm& tp, Comm& world, int zero_stage, bool sequence_parallel);

  int zero_stage() const { return zero_; }
  // The buffer ranges this rank updates: everything (ZeRO 0) or its shard of each bucket.
  const std::vector<Range>& owned() const { return owned_; }

  // Before a micro-batch: zeroes gradients as needed and arms the reduction (ZeRO 0/1 reduce after the
  // last micro-batch of a step only; ZeRO-2 after every one).
  void begin_micro_batch(bool first, bool last);
  // The model's gradients-ready hook: starts the reduction of every armed bucket at offsets ≥ offset.
  void grads_ready(int64_t offset);
  // After a micro-batch's backward: waits for the reductions it started.
  void end_micro_batch();

  // After the step's last micro-batch: completes sequence-parallel gradients over TP and returns the
  // global gradient norm. Clipping is left to the optimizer (clip_coefficient, AdamW::step's grad_scale).
  double finish_gradients();
  // After the optimizer updated the owned ranges (ZeRO ≥ 1): all-gathers every bucket's parameters.
  void gather_params();

 private:
  void start_bucket(size_t b);
  void complete_bucket(size_t b);

  Params& params_;
  Comm &dp_, &tp_, &world_;
  int zero_;
  bool sp_;
  std::vector<Range> owned_;         // optimizer ranges
  std::vector<Range> shards_;        // this rank's shard of each bucket (norm ranges, whatever the stage)
  std::vector<int64_t> shard_at_;    // where bucket b's shard starts in recv_ / acc_
  std::vector<Segment> sp_segs_;     // owned segments of sequence-partial tensors (reduced over TP under SP)
  std::vector<Segment> norm_segs_;   // shard segments this rank counts in the norm (TP-replicated: TP rank 0)
  std::vector<float> recv_;          // ZeRO ≥ 1: reduce-scatter output, one shard per bucket
  std::vector<float> acc_;           // ZeRO-2: gradient shard accumulated over micro-batches
  std::vector<Request> pending_;     // per bucket
  std::vector<uint8_t> started_;
  bool armed_ = false, last_ = false;
};

}  // namespace origami
