// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
// al. 2022) for one model replica: the TP communicator and the communication a layer performs at
// the borders of a tensor-parallel region, each forward next to its backward.
//
// Activations are [N, C] with N = B·T tokens in [B, T] order. Outside TP regions (norms, residual
// adds) every TP rank holds all N tokens — or with sequence parallelism only its sequence shard:
// positions [r·T/t, (r+1)·T/t) of every row, Nl = N/t tokens. Inside a region (between a column-
// parallel and a row-parallel layer) every rank holds all N tokens and its slice of the features.
//
//   region    forward                                   backward
//   enter     copy_to_tp: identity                      all-reduce of the partial input gradients
//             (SP) gather_from_sp: all-gather           (SP) reduce-scatter
//   exit      reduce_from_tp: all-reduce of partials    identity
//             (SP) reduce_scatter_to_sp                 (SP) all-gather
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm.h"

namespace origami {

// Vocab-parallel cross-entropy: each rank's per-row (max, sum-exp, target logit) → the statistics of
// the vocabulary rows of every rank of `group` (an all-gather of 3 floats per row, then
// merge_vocab_stats). Over TP, and under vocabulary parallelism then over the pipeline group.
void combine_vocab_stats(Comm& group, float* stats_n3, int64_t n);

class TensorParallel {
 public:
  TensorParallel();  // one rank, no communication
  TensorParallel(Comm& tp, bool sequence_parallel);

  Comm& comm() const { return *comm_; }
  int size() const { return comm_->size(); }
  int rank() const { return comm_->rank(); }
  bool sp() const { return sp_; }
  // Tokens a rank holds outside TP regions.
  int64_t local_tokens(int64_t N) const { return sp_ ? N / size() : N; }
  // The buffers on either side of a region border: without SP both sides hold all N tokens and are
  // one buffer; with SP the other side is `scratch`.
  // full(): the [N, C] buffer for the side inside the region, given the outside (local) buffer.
  float* full(float* local, float* scratch) const { return sp_ ? scratch : local; }
  // local(): the [Nl, C] buffer for the side outside the region, given the inside (full) buffer.
  float* local(float* full, float* scratch) const { return sp_ ? scratch : full; }

  // enter: full_NC ← local (local == full_NC without SP: nothing to do).
  void enter(float* full_NC, const float* local, int64_t B, int64_t T, int64_t C);
  // enter's backward: the partial gradients d_full_NC (summed over TP ranks) → d_local
  // (without SP: all-reduce in place, d_local == d_full_NC).
  void enter_backward(float* d_local, float* d_full_NC, int64_t B, int64_t T, int64_t C);
  // exit: the partial sums partial_NC (summed over TP ranks) → local (without SP: in place).
  void exit(float* local, float* partial_NC, int64_t B, int64_t T, int64_t C);
  // exit's backward: d_local → d_full_NC; returns the full gradient (d_local itself without SP).
  const float* exit_backward(float* d_full_NC, const float* d_local, int64_t B, int64_t T, int64_t C);

  // All-reduce (sum) of values that are partial sums over the TP ranks.
  void all_reduce(float* x, int64_t n) { comm_->all_reduce(x, n); }
  // Layers split by tokens rather than features (MoE: each TP rank routes its own share, so no
  // token's expert work runs twice). A rank's share is its sequence shard, N/t tokens: with SP the
  // tokens it holds outside regions, without SP the same positions cut from the full buffer.
  int64_t share_tokens(int64_t N) const { return N / size(); }
  // This rank's share of `local` ([Nl, C]): local itself with SP or one rank, else copied into scratch.
  const float* share(const float* local, float* scratch, int64_t B, int64_t T, int64_t C) const;
  // Where a share-sized result goes before gather_shares: local itself with SP or one rank, else scratch.
  float* share_buffer(float* local, float* scratch) const { return whole_shares() ? local : scratch; }
  // local ([Nl, C]) ← every rank's share (an all-gather without SP; nothing when share is local).
  void gather_shares(float* local, const float* share, int64_t B, int64_t T, int64_t C);

 private:
  // [B, T, C] ↔ [t][B, T/t, C] (rank-major shards); the identity when B == 1.
  void to_shards(float* out, const float* in, int64_t B, int64_t T, int64_t C) const;
  void from_shards(float* out, const float* in, int64_t B, int64_t T, int64_t C) const;
  // full_NC ← every rank's sequence shard (all-gather, reordered when B > 1).
  void gather(float* full_NC, const float* shard, int64_t B, int64_t T, int64_t C);
  bool whole_shares() const { return sp_ || size() == 1; }  // a share is the whole local buffer
  Comm* comm_;
  bool sp_ = false;
  std::vector<float> buf_;
};

}  // namespace origami
