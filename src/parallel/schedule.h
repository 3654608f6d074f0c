// Pipeline-parallel schedules as pure functions (DESIGN.md convention 7): make_schedule() returns
// the ordered list of actions one pipeline stage runs in one training step; the MPI executor runs
// these lists, the planner's simulator replays them (replay_schedules below). No MPI here.
//
// Terms: p = stages (physical pipeline ranks), M = micro-batches per step, v = model chunks per
// stage. Stage s holds chunks 0..v-1; chunk c of stage s is virtual stage u = c*p + s, so the model
// runs through virtual stages 0, 1, ..., p*v-1: stage 0 chunk 0, stage 1 chunk 0, ..., stage p-1
// chunk 0, stage 0 chunk 1, ... The next virtual stage of (stage p-1, chunk c) is (stage 0, chunk c+1).
//
// Schedules (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
// Clusters"; Megatron-LM schedules.py):
//   gpipe        all M forwards (micro-batch 0..M-1), then all M backwards in the same order 0..M-1.
//   1f1b         warm-up of min(p-s-1, M) forwards, then one forward + one backward alternating,
//                then the remaining backwards; backwards in micro-batch order.
//   interleaved  1F1B over M*v "virtual micro-batches" in Megatron's order (see schedule.cpp).
// Bubble with zero-cost communication: (p-1)/M for gpipe and 1f1b, (p-1)/(v*M) for interleaved,
// exactly and for any ratio of backward to forward cost (the reason is in test_schedule.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace origami {

enum class ScheduleKind { gpipe, one_f_one_b, interleaved };

// "gpipe" | "1f1b" | "interleaved"; anything else is an Error naming the value.
ScheduleKind parse_schedule_kind(const std::string& s);
const char* schedule_kind_name(ScheduleKind k);

enum class ActionType {
  recv_forward, forward, send_forward, recv_backward, backward, send_backward,
  vocab_embed, vocab, vocab_embed_grad  // vocabulary parallelism's passes (with_vocab_passes)
};
inline bool is_vocab_pass(ActionType t) {
  return t == ActionType::vocab_embed || t == ActionType::vocab || t == ActionType::vocab_embed_grad;
}
const char* action_type_name(ActionType t);

// recv_forward:  receive the activation of (microbatch, chunk) from the previous virtual stage;
// send_forward:  send this chunk's output activation to the next virtual stage;
// recv_backward: receive the gradient w.r.t. this chunk's output from the next virtual stage;
// send_backward: send the gradient w.r.t. this chunk's input to the previous virtual stage.
// Vocabulary parallelism's passes of a micro-batch (chunk 0), each a collective over the pipeline group
// that every stage runs once per micro-batch (with_vocab_passes places them):
// vocab_embed:   the embedding over every stage's slice of the vocabulary, before the first virtual
//                stage's forward of the micro-batch;
// vocab:         the output pass: the LM head and its loss over every slice, after the last virtual
//                stage's forward and before its backward;
// vocab_embed_grad: the embedding's backward into every slice, after the first virtual stage's backward.
// No send/recv appears for the first virtual stage's input or the last virtual stage's output.
// Receives sit immediately before the compute that needs them (the executor posts non-blocking
// receives earlier itself); sends immediately after the compute that produced them (non-blocking).
struct Action {
  ActionType type;
  int microbatch;  // 0..M-1
  int chunk;       // local model chunk 0..v-1 on this stage (virtual stage = chunk*stages + stage)
  bool operator==(const Action&) const = default;
};
std::string to_string(const Action& a);  // e.g. "recv_forward(mb 3, chunk 1)"

// Throws origami::Error naming the values and the rule for impossible inputs: stages < 1,
// microbatches < 1, chunks < 1, chunks > 1 with a kind other than interleaved, interleaved with
// stages < 2, interleaved with microbatches not a multiple of stages (Megatron's rule).
// (The stage index is checked by make_schedule, the only function that takes one.)
void check_schedule(ScheduleKind kind, int stages, int microbatches, int chunks);

// The ordered list of actions stage `stage` (0-based) executes in one training step.
// Throws like check_schedule, and for stage outside 0..stages-1.
std::vector<Action> make_schedule(ScheduleKind kind, int stages, int stage, int microbatches, int chunks = 1);

// Number of forwards stage `stage` runs before its first backward (the warm-up), from the formulas
// above: gpipe M; 1f1b min(p-s-1, M); interleaved min((p-s-1)*2 + (v-1)*p, M*v).
int num_warmup_forwards(ScheduleKind kind, int stages, int stage, int microbatches, int chunks = 1);

// ---- Replay simulator (reused by the planner) ----

struct StageTiming {
  std::vector<double> starts;  // per action: when it began (a receive: before its wait; a pass: after it)
  double busy = 0;    // time spent in forward/backward compute
  double idle = 0;    // time spent blocked in receives before this stage's last action (= finish - busy)
  double finish = 0;  // time this stage's last action completes
  int max_in_flight = 0;  // most (micro-batch, chunk) pairs forwarded but not yet backwarded at once
};
struct Replay {
  std::vector<StageTiming> stages;
  double makespan = 0;  // max over stages of finish; a stage's bubble is makespan - busy
};

// Runs all stages' action lists together from time 0. Sends are non-blocking: a message is
// available to its receiver at the moment its send action runs. Receives block. A forward of one
// chunk costs t_forward, a backward t_backward, an output pass (vocab) t_vocab on every stage once all
// have reached it (a collective; the embedding passes cost 0), sends and receives cost 0. Checks
// every dependency
// and throws origami::Error naming the stage, the action and the rule if one is broken:
//  - a receive matches the earliest unmatched send on its channel (from-stage, to-stage,
//    direction) and that send must be for the same (micro-batch, virtual stage);
//  - a forward of a non-first virtual stage only after its recv_forward, a send_forward only after
//    its forward; a backward only after this stage's forward of the same (micro-batch, chunk) and,
//    on a non-last virtual stage, after its recv_backward; a send_backward only after its backward;
//    no send/recv across the model's two ends;
//  - every (micro-batch, chunk) forward and backward, and each needed send/recv, exactly once per
//    stage; no message left unreceived at the end;
//  - when the lists hold vocabulary passes: each kind once per micro-batch on every stage, in the
//    same order on all; the embedding pass before the first virtual stage's forward of its
//    micro-batch and its gradient pass after that pair's backward; the output pass after the last
//    virtual stage's forward and before that pair's backward;
//  - if no stage can progress before all are done: Error("deadlock: ...") naming the stuck actions.
Replay replay_schedules(const std::vector<std::vector<Action>>& per_stage, int stages, int microbatches, int chunks,
                        double t_forward, double t_backward, double t_vocab = 0);

// Vocabulary parallelism (Yeung et al. 2024, "Balancing Pipeline Parallelism with Vocabulary
// Parallelism"): the stages' lists with the three passes of every micro-batch m added to each, each at
// a time of a replay of the lists (forward 1, backward 2): vocab(m) when the last virtual stage's
// forward of m ends; vocab_embed(m) at the latest of those times not after the first virtual stage's
// forward of m starts (0 if none), vocab_embed_grad(m) at the earliest not before that pair's
// backward ends (after everything if none), so the embedding passes add no synchronisation of their
// own. A pass goes before the first compute action that starts at or after its time (and before the
// receive that precedes it), passes of one time in a fixed order. Every action placed before a pass
// began earlier, so none depends on it, and every action after it began later, so none the pass
// needs can depend on them: the passes line the stages up where the pipeline already is, with no
// deadlock (the result is replayed to check it). The first stage keeps the embeddings and gradients
// of about as many micro-batches as the schedule has in flight (Pipeline::vocab_bytes counts them).
std::vector<std::vector<Action>> with_vocab_passes(const std::vector<std::vector<Action>>& per_stage, int stages,
                                                   int microbatches, int chunks);
// One stage's list as the executor runs it: make_schedule's, with the vocabulary passes when `vocab`.
std::vector<Action> stage_actions(ScheduleKind kind, int stages, int stage, int microbatches, int chunks, bool vocab);

// Activation bytes a stage holds over one step: replays its action list, the forward of chunk c
// taking a slot of slot_bytes[c] and that pair's backward returning it to its pool. Chunks of one
// slot_class (model.h: slot_classes; equal slot_bytes) share a pool, each pool keeping the most slots
// it ever had out at once: the sum over the pools. (One class: the peak of what is in flight.)
int64_t schedule_activation_peak(const std::vector<Action>& actions, const std::vector<int64_t>& slot_bytes,
                                 const std::vector<int>& slot_class);

}  // namespace origami

namespace origami {

// Stage partitioning: the layers [begin, end) of each virtual stage (stages·chunks of them, in
// virtual-stage order). With `sizes` (--pp-layers 5,6,6,5) the layers per virtual stage are given
// explicitly — the embedding and LM head make the first and last stage heavier; otherwise the
// layers are split evenly, which needs num_layers to be a multiple of stages·chunks. Errors name
// the values and the rule.
std::vector<LayerRange> partition_layers(int num_layers, int stages, int chunks, const std::vector<int>& sizes = {});

}  // namespace origami
