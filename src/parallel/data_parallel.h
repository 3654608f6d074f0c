// Data parallelism with ZeRO over the flat gradient buffer (ZeRO, Rajbhandari et al. 2020;
// Megatron's distributed optimizer). Gradients are reduced per bucket — a contiguous range of the
// buffer, see Params::buckets() — as soon as backward has finished writing it, with non-blocking
// collectives that overlap the rest of backward.
//
//   --zero 0  all-reduce each bucket; every rank updates every parameter
//   --zero 1  reduce-scatter each bucket (in place: no second copy of the shard); rank d updates only
//             its shard (1/dp of every bucket), keeps optimizer state for it only, then all-gathers
//             the updated parameters (under bf16 a bucket of GEMM weights, ParamLayout::copy_buckets,
//             gathers its bf16 copy alone — each rank rounds its shard first — and its fp32 values
//             outside the shard are returned: the GEMMs read only the copy)
//   --zero 2  as 1, and gradients are reduce-scattered after every micro-batch, accumulating in the
//             shard's own place in the buffer; once a bucket's reduction is complete every page of it
//             but the shard's is returned, and a bucket starts only after the one before it has
//             completed: besides the shards, at most two buckets are resident (one reducing, one
//             being written by backward)
//   --zero 3  as 2, and the parameters too are sharded: between uses a rank holds only its shard of
//             each bucket. The model announces each unit (a layer, the embedding, the head;
//             Model::on_weights) before it reads it: use_weights(need) all-gathers the unit's
//             buckets in place (a prefetch starts the next unit's gather early), use_weights(done)
//             returns every page but the shard's. Buckets are unit-aligned (ParamLayout::unit_buckets),
//             so a rank holds its shards plus two units (the one in use, the one prefetched). Under
//             bf16 a unit's GEMM weights have buckets of their own (ParamLayout::copy_buckets), which
//             gather their bf16 copy alone (half the bytes; each rank keeps its shard's copy current
//             after the update); the other buckets gather fp32 values and round their copy after.
//
// --grad-reduce-dtype bf16 (`wire` DType::bf16): each bucket is rounded to bf16 before its reduction,
// which then sends half the bytes and sums in bf16 (comm.h). ZeRO 0 widens the all-reduced bucket back
// to fp32. Under ZeRO ≥ 1 a rank's own block of the bucket never travels, so it is not rounded: its
// place in the bf16 copy is zeroed, and the reduce-scatter's result (the other ranks' sum) is widened
// and added to it in fp32. The gradients are accumulated over micro-batches in fp32 (ZeRO 0/1 reduce
// after the last one; ZeRO-2 adds each pass's result to the fp32 shard). A group of one rank reduces
// nothing and rounds nothing.
//
// Under pipeline parallelism a tied embedding lives on the first and the last stage, in a bucket of
// its own on both: after the DP reduction its gradient (or this rank's DP shard of it — the shards
// line up) is summed over the two stages, which then apply identical updates.
//
// The gradient norm is the true global one: each element counted once over TP × DP × PP (TP-replicated
// parameters on TP rank 0 only; DP-replicated gradients within this rank's shard only; the tied
// embedding on the first stage only).
//
// FSSDP (--expert-sharding fssdp; Hecate's fully sharded sparse data parallelism): the routed experts'
// set is held as under ZeRO-3 (values, gradients and moments sharded over EDP, every rank's shard of
// each bucket), but nothing is gathered or reduced per bucket. An MoE layer, once routing says which
// of its experts this rank's rows reach, calls gather_experts: the ranks exchange those sets (an
// all-gather of one flag per expert) and each receives exactly the pieces of its experts that others
// own (an all-to-all of point-to-point messages, one per run of adjacent pieces, sizes known only
// now, straight from the owners' shards), into a staging area of one layer's experts that stays
// resident (so no page is faulted in and returned per layer), with its own pieces copied beside them.
// Backward gathers again and accumulates the gradients in the staging area; reduce_experts then
// sends each owner the pieces of its shard (the same kind of exchange), which it adds to its shard, adds its
// own pieces, and clears the staging gradients. An expert no row of a rank reached costs that rank
// nothing. The gradient pieces travel in the reduction's wire type; when the GEMMs read bf16 copies
// (--precision bf16) the parameter pieces travel as bf16, and only the copy is staged.
//
// MoE parallel folding: a rank has two parameter sets, each with its own DataParallel — the dense
// one (attention mesh: TP, reduced over DP) and the routed experts (MoE mesh: split over ETP, one
// EP rank's experts, reduced over EDP). finish_gradients takes both and forms one global norm with
// one all-reduce over the world, each element counted once under any folding.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "core/memory.h"
#include "kernels/cpu/bf16.h"
#include "model/params.h"

namespace origami {

// Data-parallel rank r's shard of each bucket: [begin + r·n, begin + (r+1)·n), n = length / dp
// (bucket lengths are multiples of dp, see plan_buffer).
std::vector<Range> bucket_shards(const std::vector<Range>& buckets, int dp, int dp_rank);

// The buckets each chunk's backward pass writes ([chunk][bucket] = 1), from each tensor's buffer
// range (its offset, its TP shard's length): a layer's tensors in the pass of the chunk holding the layer; any other tensor (embedding,
// final norm and head, the tied embedding's copy, vocabulary slices) in passes that depend on the
// stage and schedule, so its buckets count as every pass's. ZeRO ≥ 2 reduces a pass's buckets alone:
// under interleaving the other chunks' buckets hold zeros (DataParallel::begin_backward).
std::vector<std::vector<char>> pass_buckets(const std::vector<ParamSpec>& table, const std::vector<int64_t>& offsets,
                                            int tp, const std::vector<Range>& buckets,
                                            const std::vector<LayerRange>& chunks);

class DataParallel {
 public:
  // dp: data-parallel group; tp: tensor-parallel group (TP-partial gradients are reduced over it:
  // sequence-partial ones under SP, token-partial ones whenever it has more than one rank);
  // embedding: the first and last pipeline stage of this rank's pipeline when it holds a pp_shared
  // tensor (the tied embedding), else null.
  // wire: the element type of the DP reduction, DType::f32 or DType::bf16 (--grad-reduce-dtype).
  // sparse: FSSDP (zero_stage must be 3); keep: FSSDP keeps what it gathered until the step's update;
  // bf16: FSSDP's gathers stage the values the GEMMs read as bf16 (under --precision bf16; the
  // experts keep no bf16 copy of their own: Model::set_precision).
  // chunks: the stage's chunks of layers (pass_buckets; empty: every pass writes every bucket).
  DataParallel(Params& params, Comm& dp, Comm& tp, int zero_stage, bool sequence_parallel, Comm* embedding = nullptr,
               DType wire = DType::f32, bool sparse = false, bool keep = false, bool bf16 = false,
               const std::vector<LayerRange>& chunks = {});

  int zero_stage() const { return zero_; }
  // The buffer ranges this rank updates: everything (ZeRO 0) or its shard of each bucket.
  const std::vector<Range>& owned() const { return owned_; }
  // The ranges whose bf16 copy the optimizer writes as it updates them (AdamW's copy_ranges): all it
  // updates when that is every value, else the copy buckets' shards (written where there is a copy).
  const std::vector<Range>& copy_written_by_update() const { return copy_from_update_; }

  // A step, whatever the schedule (one forward-backward per micro-batch, or a pipeline's chunks):
  //   begin_step(); { begin_backward(final); <backward: the model calls grads_ready> end_backward(); }...
  //   finish_gradients({sets}); <optimizer>; gather_params()
  void begin_step();
  // Before a backward pass of `chunk`. `final`: no later backward of this step writes the gradients
  // this one writes (the last micro-batch; under interleaving, the chunk's last). ZeRO 0/1 reduce
  // during final passes only; ZeRO ≥ 2 after every pass the buckets it writes (pass_buckets), its
  // gradient buffer holding one pass's gradients.
  void begin_backward(bool final, int chunk = 0);
  // The model's gradients-ready hook: starts the reduction of every armed bucket at offsets ≥ offset.
  void grads_ready(int64_t offset);
  // After a backward pass (ZeRO-2: reduces what is left and waits, then releases the buffer).
  void end_backward();

  // After the step's last backward: completes the reductions, sums the tied embedding over the
  // embedding group and TP-partial gradients over TP; returns this rank's part of the squared global
  // norm — NaN when a gradient element it applies but does not count (a TP replica on TP rank ≥ 1)
  // is not finite, so no rank updates with it. finish_gradients (below) calls it.
  double complete_gradients();
  // After the optimizer updated the owned ranges (and wrote copy_written_by_update's bf16 copy):
  // ZeRO 1/2 over several ranks all-gather every bucket's parameters (a copy bucket's bf16 copy) and
  // round the other buckets' bf16 copy (if kept) from the gathered values; ZeRO 0 and one rank have
  // nothing to gather. ZeRO-3 gathers units when needed (FSSDP forgets the experts --fssdp-keep kept).
  void gather_params();
  // ZeRO-3 (a no-op below): the parameters of the buffer ranges `unit` (Model::on_weights).
  void use_weights(WeightUse use, const std::vector<Range>& unit);

  // FSSDP, collective over the group (every rank calls each, in the same order, with the same layer):
  // need[j] is 1 when this rank's rows reach block j of x. gather_experts stages those blocks and says
  // where (valid until the next gather; with keep, until the step's update, and a block staged
  // earlier in the step is not gathered again); reduce_experts sends the staged gradients of the
  // needed blocks to their owners, adds its own to its shards and clears them.
  ExpertPlace gather_experts(const ExpertBlocks& x, const std::vector<int32_t>& need);
  void reduce_experts(const ExpertBlocks& x, const std::vector<int32_t>& need);
  // Since begin_step: the bytes this rank sent gathering parameters (ZeRO ≥ 1, FSSDP) and reducing
  // gradients (comm.h's accounting), and under FSSDP the expert blocks it gathered.
  struct Traffic {
    double gathered_bytes = 0, reduced_bytes = 0;
    int64_t expert_gathers = 0;
  };
  const Traffic& traffic() const { return traffic_; }

 private:
  void start_bucket(size_t b);
  void complete_bucket(size_t b);
  std::vector<size_t> buckets_of(const std::vector<Range>& unit) const;
  // Bucket b's parameters all-gathered in place (the shard already sits at its place): a copy bucket's
  // bf16 copy (ParamLayout::copy_buckets), another's fp32 values.
  Request all_gather_bucket(size_t b);
  void start_gather(size_t b);  // ZeRO-3: all_gather_bucket unless gathered or in flight
  // Returns bucket b's pages outside this rank's shard: its values, and with `with_copy` (ZeRO-3) its
  // bf16 copy (a copy bucket's outside the shard; another's whole, made again when it is gathered).
  void drop_values(size_t b, bool with_copy);
  // Bucket b's two ranges outside this rank's shard: before it and after it (either may be empty).
  std::array<Range, 2> outside_shard(size_t b) const;
  // FSSDP: calls fn(peer, begin, end) for each piece this rank sends in one exchange: outward (a
  // gather) the pieces of its shards that each peer's needed blocks cover; to the owners (a
  // reduction) the pieces of its own needed blocks each peer owns. With `to_owners` flipped it lists,
  // in the same order, what the rank receives.
  template <typename Fn>
  void sparse_walk(const ExpertBlocks& x, bool to_owners, Fn&& fn) const;
  // The pieces of one exchange merged into runs (adjacent pieces for one peer), as (peer, range).
  std::vector<std::pair<int, Range>> sparse_runs(const ExpertBlocks& x, bool to_owners) const;
  // One exchange of elements of type T, one message per run (no packing where the elements travel as
  // they are stored): src(begin, end, scratch) gives a run's elements to send (where they are, or
  // converted into scratch); dst(begin, end, scratch) where a received run lands (its place, or
  // scratch), and done(begin, end, landed) consumes it once everything has arrived. Returns the bytes sent.
  // Scratch exists only where the callers use it (the memory plan counts the same): sends in bf16
  // (values rounded from the fp32 shard, gradients rounded to the wire type) and the receives of a
  // reduction (added after all arrive); elsewhere src and dst get a null scratch pointer.
  template <typename T, typename Src, typename Dst, typename Done>
  double sparse_exchange(const ExpertBlocks& x, bool to_owners, Src&& src, Dst&& dst, Done&& done);
  // Calls fn(begin, end) for the pieces of this rank's shards inside the blocks `need` marks.
  template <typename Fn>
  void own_pieces(const ExpertBlocks& x, const std::vector<int32_t>& need, Fn&& fn) const;

  Params& params_;
  Comm &dp_, &tp_;
  Comm* embedding_;
  std::vector<size_t> shared_buckets_;  // buckets of pp_shared tensors (summed over embedding_)
  int zero_;
  bool sp_;
  std::vector<Range> owned_;         // optimizer ranges
  std::vector<Range> copy_from_update_;  // copy_written_by_update()
  std::vector<Range> shards_;        // this rank's shard of each bucket (norm ranges, whatever the stage)
  std::vector<Segment> partial_segs_;  // owned segments of TP-partial tensors (reduced over TP)
  std::vector<Segment> norm_segs_;   // shard segments this rank counts in the norm (TP-replicated: TP rank 0)
  std::vector<Segment> copy_segs_;   // TP replicas it applies but does not count (checked for finiteness)
  DType wire_;                       // the reduction's element type
  ReleasablePages low_;              // wire bf16: the gradient buffer rounded, each bucket's range returned
                                     // once its reduction is complete
  std::vector<Request> pending_;     // per bucket
  std::vector<std::vector<char>> pass_buckets_;  // [chunk][bucket]: written by the chunk's pass (ZeRO ≥ 2)
  enum : uint8_t { kIdle, kInFlight, kDone };
  std::vector<uint8_t> started_;     // per bucket, this pass
  // ZeRO-3, per bucket: its all-gather, the units using it, whether its values are all present.
  std::vector<Request> gathers_;
  std::vector<int> held_;
  std::vector<uint8_t> gathered_;
  std::map<std::vector<int64_t>, std::vector<size_t>> unit_buckets_;  // a unit's ranges (begin, end, ...) → its buckets
  bool armed_ = false;
  // FSSDP: every rank's shard of each bucket ([rank][bucket]), the last gather's needs ([rank][block]);
  // the staging area (one layer's experts: values or their bf16 copy, and gradients, kept zero
  // between uses) and the exchanges' scratch for the runs they convert, each grown to the largest use and kept.
  // Under keep the values' staging area spans the whole buffer, and kept_ marks, per layer (its first
  // offset), the blocks staged since begin_step.
  void exchange_needs(const std::vector<int32_t>& need);  // → needs_
  bool sparse_, keep_;
  bool stage_bf16_;  // FSSDP: gathers stage bf16 values
  std::vector<std::vector<Range>> rank_shards_;
  std::vector<int32_t> needs_;
  std::map<int64_t, std::vector<int32_t>> kept_;
  std::vector<float> stage_values_, stage_grads_;
  std::vector<bf16> stage_low_;
  std::vector<char> scratch_out_, scratch_in_;
  Traffic traffic_;
};

// The step's gradients over every parameter set of this rank (complete_gradients of each), with one
// all-reduce over the world: the global norm (before clipping; clipping is the optimizer's,
// clip_coefficient), and whether any rank's loss (`local_loss`: this rank's part of the step's loss)
// or gradients were not finite.
struct Gradients {
  double norm;       // global gradient norm; not finite if any rank's gradients are not
  bool loss_finite;  // every rank's local loss was finite
  bool finite() const { return loss_finite && std::isfinite(norm); }
};
Gradients finish_gradients(const std::vector<DataParallel*>& sets, Comm& world, double local_loss);

}  // namespace origami
