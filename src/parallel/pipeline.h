// Pipeline-parallel executor: runs one stage's action list (make_schedule, schedule.h) for one
// training step — the same lists the planner's simulator replays.
//
// Transfers are non-blocking point-to-point on the pipeline communicator (stage = its rank): each
// receive is posted before the compute action preceding the one that needs it, so the transfer
// overlaps that compute; sends return at once and are completed before their buffer is reused.
// A message carries the residual stream between virtual stages, [Nl, C] — with sequence
// parallelism only this TP rank's sequence shard crosses stages.
//
// Gradients: before each backward the executor tells DataParallel whether it is the chunk's final
// backward of the step (no later backward writes its gradients), so bucket reductions start there.
// With the interleaved schedule chunk c's final backward precedes chunk c−1's, which keeps the
// gradients-ready offsets (higher chunks sit higher in the buffer) valid.
//
// Vocabulary parallelism (the model's ModelPart::vocab_parallel; Yeung et al. 2024): every stage holds
// a slice of the vocabulary, so every stage takes part in three passes per micro-batch, collectives
// over this group placed into every stage's list by with_vocab_passes:
//   - vocab_embed (Model::vocab_embed): the embedding; the first stage keeps the input of its first
//     chunk's forward;
//   - vocab (Model::vocab_head): the LM head and its loss over all slices; the last stage keeps
//     ∂/∂(its head chunk's output) for that chunk's backward;
//   - vocab_embed_grad (Model::vocab_embed_backward): the embedding's backward, from the gradient the
//     first stage kept from its first chunk's backward.
// The embedding's gradients are final only after the last pass: ZeRO 0/1 reduce their buckets when the
// step's gradients are completed (DataParallel::complete_gradients).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "comm/comm.h"
#include "core/checked.h"
#include "model/model.h"
#include "parallel/data_parallel.h"
#include "parallel/schedule.h"

namespace origami {

// The executor's own timers for the last step (seconds).
struct PipelineTimes {
  double busy = 0;   // in forward and backward compute
  double vocab = 0;  // vocabulary parallelism: in the embedding and output passes (their collectives included)
  double wait = 0;   // blocked on receives and send completion
  double total = 0;  // the whole schedule
  int64_t message_buffers = 0;  // message buffers of [Nl, C] the step allocated (its peak: they are reused)
};

class Pipeline {
 public:
  // pp: this rank's pipeline group (stage = pp.rank()); model: this stage's part (its chunks are
  // virtual stages chunk·stages + stage); dp: gradient reduction hooks, one per parameter set.
  Pipeline(Model& model, Comm& pp, std::vector<DataParallel*> dp, ScheduleKind kind, int microbatches, int chunks);

  // One step: micro-batch m reads tokens[m] (B rows: ModelConfig::row_stride); gradients of
  // loss_scale·loss of each micro-batch accumulate. The schedule is remade when the number of
  // micro-batches differs from the last step's (document batching). Returns the losses summed over micro-batches as seen by this stage: the LM
  // loss on the last stage, router losses of this stage's MoE layers; `loss` is their sum.
  Losses run(const std::vector<const int32_t*>& tokens, int64_t B, int64_t T, float loss_scale);
  // Called before each backward pass of a step (tests: a slow stage, train/test_hooks.h).
  void before_backward(std::function<void()> f) { before_backward_ = std::move(f); }

  // Evaluation, forward only: micro-batch m reads tokens[m]; every stage runs its (micro-batch,
  // chunk) forwards in order — micro-batch by micro-batch, chunk by chunk, the order in which data
  // flows through the virtual stages, so no stage waits on one that waits on it — and keeps nothing.
  // Returns the LM loss summed over the micro-batches on the last stage (0 elsewhere).
  Losses evaluate(const std::vector<const int32_t*>& tokens, int64_t B, int64_t T);

  // Bytes of the message buffers a stage of `stages` running `actions` (stage_actions) holds at most
  // for messages of `floats` floats. In a step: a received input, the next receive posted ahead, and
  // the backward sends in flight (forward sends go out of the model's slot). A backward send
  // completes once the previous stage has posted its receive, which that stage does one action
  // ahead of the backward that reads it, so a stage that runs ahead of a slower previous one piles
  // its sends up through its backwards after its last forward. Where every backward comes after
  // every forward (GPipe) that is all of them, and they are counted. Elsewhere (1f1b, interleaved)
  // the forwards between backwards keep balanced stages within kMaxBackwardSends (measured: 1f1b
  // and interleaved PP2 with one stage slowed stayed within it), which is counted; the worst case,
  // the cooldown's (1f1b's p − s + 1, interleaved's (p − s − 1)·2 + (v − 1)·p + 1), would refuse
  // layouts that run (GPT-3's 530B at PP35 × VPP3 by 23 GB), and a step that allocates more says so
  // (train/memory_plan.h, pipeline_message_buffers). The executor does not bound them: a wait for the previous stage's
  // receive could close a cycle (the interleaved schedule's wrap-around, vocabulary parallelism's
  // collectives, ZeRO-2's and ZeRO-3's blocking collectives among a stage's ranks). In an
  // evaluation: an input and two sends. None without pipeline parallelism.
  static constexpr int64_t kMaxBackwardSends = 2;
  static int64_t buffer_bytes(const std::vector<Action>& actions, int stages, int64_t floats);
  // Vocabulary parallelism: the most bytes its passes keep at once on stage `stage` of `stages` running
  // `actions` (with_vocab_passes), for messages of `local` floats ([Nl, C]) and rows of `full` ([N, C]):
  // the first stage's embeddings from vocab_embed until their forward and gradients from its first
  // chunk's backward until vocab_embed_grad; the last stage's head gradients from vocab until their
  // backward.
  static int64_t vocab_bytes(const std::vector<Action>& actions, int stages, int stage, int chunks, int64_t local,
                             int64_t full);
  // Vocabulary parallelism's embeddings and head gradients the current list of this stage allocates as
  // message buffers (vocab_bytes' [Nl, C] ones), beside buffer_bytes' (PipelineTimes::message_buffers
  // counts both).
  int64_t vocab_message_buffers() const;

  // Error naming the values when one step's messages would need more MPI tags than MPI guarantees
  // (one per micro-batch, chunk and direction: tag()); one stage sends no messages.
  static void check_tags(int stages, int64_t microbatches, int chunks);
  // The tag of micro-batch `microbatch`'s message over the boundary between virtual stages
  // `boundary` and `boundary` + 1, forward or backward, in a pipeline of `stages` × `chunks`.
  static int message_tag(int microbatch, int boundary, bool backward, int stages, int chunks);

  const std::vector<Action>& actions() const { return actions_; }
  const PipelineTimes& times() const { return times_; }

 private:
  struct Transfer;
  class Step;  // one run(): its transfers in flight and its actions
  int tag(int microbatch, int boundary, bool backward) const;

  Model& model_;
  Comm& pp_;
  std::vector<DataParallel*> dp_;
  void set_microbatches(int microbatches);  // the schedule's actions for this many

  ScheduleKind kind_;
  bool vocab_ = false;  // vocabulary parallelism
  int chunks_, microbatches_ = 0;
  std::vector<Action> actions_;
  std::vector<uint8_t> final_;  // per action: a backward no later backward of its chunk follows
  PipelineTimes times_;
  std::function<void()> before_backward_;
};

}  // namespace origami
