#include "parallel/schedule.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <mutex>
#include <tuple>

#include "core/checked.h"
#include "core/error.h"

namespace origami {

ScheduleKind parse_schedule_kind(const std::string& s) {
  if (s == "gpipe") return ScheduleKind::gpipe;
  if (s == "1f1b") return ScheduleKind::one_f_one_b;
  if (s == "interleaved") return ScheduleKind::interleaved;
  fail("--pp-schedule '", s, "' is not one of gpipe, 1f1b, interleaved");
}

const char* schedule_kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::gpipe: return "gpipe";
    case ScheduleKind::one_f_one_b: return "1f1b";
    case ScheduleKind::interleaved: return "interleaved";
  }
  return "?";
}

const char* action_type_name(ActionType t) {
  switch (t) {
    case ActionType::recv_forward: return "recv_forward";
    case ActionType::forward: return "forward";
    case ActionType::send_forward: return "send_forward";
    case ActionType::recv_backward: return "recv_backward";
    case ActionType::backward: return "backward";
    case ActionType::send_backward: return "send_backward";
    case ActionType::vocab_embed: return "vocab_embed";
    case ActionType::vocab: return "vocab";
    case ActionType::vocab_embed_grad: return "vocab_embed_grad";
  }
  return "?";
}

std::string to_string(const Action& a) {
  return cat(action_type_name(a.type), "(mb ", a.microbatch, ", chunk ", a.chunk, ")");
}

void check_schedule(ScheduleKind kind, int stages, int microbatches, int chunks) {
  const char* name = schedule_kind_name(kind);
  ORIGAMI_CHECK(stages >= 1, "pipeline stages must be >= 1, got stages=", stages);
  ORIGAMI_CHECK(microbatches >= 1, "micro-batches per step must be >= 1, got microbatches=", microbatches);
  ORIGAMI_CHECK(chunks >= 1, "model chunks per stage must be >= 1, got chunks=", chunks);
  ORIGAMI_CHECK(chunks == 1 || kind == ScheduleKind::interleaved, "schedule ", name,
                " runs one model chunk per stage, got chunks=", chunks, " (only interleaved takes chunks > 1)");
  if (kind == ScheduleKind::interleaved) {
    ORIGAMI_CHECK(stages >= 2, "the interleaved schedule needs stages >= 2, got stages=", stages);
    ORIGAMI_CHECK(microbatches % stages == 0, "the interleaved schedule needs micro-batches to be a multiple of "
                  "pipeline stages (Megatron's rule: micro-batches enter each chunk in groups of `stages`), got "
                  "microbatches=", microbatches, " with stages=", stages);
  }
}

int num_warmup_forwards(ScheduleKind kind, int stages, int stage, int microbatches, int chunks) {
  const int p = stages, s = stage, m = microbatches, v = chunks;
  switch (kind) {
    case ScheduleKind::gpipe: return m;
    case ScheduleKind::one_f_one_b: return std::min(p - s - 1, m);
    case ScheduleKind::interleaved: return std::min((p - s - 1) * 2 + (v - 1) * p, m * v);
  }
  return 0;
}

namespace {

// Appends the compute of (microbatch, chunk) with the receive right before it and the send right
// after it, leaving out the transfers across the model's two ends (first and last virtual stage).
struct Builder {
  int stages, stage, chunks;
  std::vector<Action> out;

  int virtual_stage(int chunk) const { return chunk * stages + stage; }
  bool first(int chunk) const { return virtual_stage(chunk) == 0; }
  bool last(int chunk) const { return virtual_stage(chunk) == stages * chunks - 1; }

  void forward(int mb, int chunk) {
    if (!first(chunk)) out.push_back({ActionType::recv_forward, mb, chunk});
    out.push_back({ActionType::forward, mb, chunk});
    if (!last(chunk)) out.push_back({ActionType::send_forward, mb, chunk});
  }
  void backward(int mb, int chunk) {
    if (!last(chunk)) out.push_back({ActionType::recv_backward, mb, chunk});
    out.push_back({ActionType::backward, mb, chunk});
    if (!first(chunk)) out.push_back({ActionType::send_backward, mb, chunk});
  }
};

}  // namespace

std::vector<Action> make_schedule(ScheduleKind kind, int stages, int stage, int microbatches, int chunks) {
  check_schedule(kind, stages, microbatches, chunks);
  ORIGAMI_CHECK(stage >= 0 && stage < stages, "pipeline stage ", stage, " out of range for stages=", stages,
                " (valid: 0..", stages - 1, ")");
  const int p = stages, m = microbatches, v = chunks;
  Builder b{p, stage, v, {}};
  const int warmup = num_warmup_forwards(kind, p, stage, m, v);

  if (kind != ScheduleKind::interleaved) {
    // gpipe is 1F1B with a warm-up of all M forwards: every forward, then every backward, both
    // in micro-batch order 0..M-1. 1F1B: warm-up, then steady state "forward warmup+i, backward i",
    // then the last `warmup` backwards (cool-down).
    for (int i = 0; i < warmup; ++i) b.forward(i, 0);
    for (int i = 0; i < m - warmup; ++i) {
      b.forward(warmup + i, 0);
      b.backward(i, 0);
    }
    for (int i = m - warmup; i < m; ++i) b.backward(i, 0);
    return std::move(b.out);
  }

  // Interleaved 1F1B (Megatron's forward_backward_pipelining_with_interleaving), derived:
  // Each stage runs M*v "virtual micro-batches" k = 0..M*v-1, a (micro-batch, chunk) pair each.
  // They come in groups of p*v consecutive k: a group takes the p micro-batches g*p..g*p+p-1
  // through chunk 0, then the same p through chunk 1, ..., chunk v-1. Why p at a time: micro-batch
  // j's output of chunk c on stage 0 travels through stages 1..p-1 (p-1 forward steps) before it
  // comes back to stage 0 as the input of chunk c+1, so doing p micro-batches on a chunk keeps
  // stage 0 busy until the first one returns. Groups must be full, hence M % p == 0.
  //   forward k:  chunk (k / p) % v,          micro-batch (k / (p*v))*p + k % p
  //   backward k: chunk v-1 - (k / p) % v,    micro-batch (k / (p*v))*p + k % p
  // Backwards visit chunks in reverse because gradients enter at the last virtual stage (chunk v-1).
  // Warm-up: the first backward anywhere is (micro-batch 0, chunk v-1) on stage p-1; its forward is
  // k = (v-1)*p, so stage p-1 runs (v-1)*p forwards and then the 1F1B steady state (whose first
  // forward is that k). A stage further up keeps running forwards until that gradient comes back
  // from the stages below it. Megatron counts 2 forwards per stage below: its steady state ends
  // each step with one combined exchange with both neighbours, so a message moves one stage per
  // step (a forward + a backward) each way and a round trip to the next stage takes 2 steps. Hence
  // (p-s-1)*2 + (v-1)*p, capped at M*v (then the schedule is all forwards, then all backwards).
  // (With sends that do not wait, as replay_schedules models them, (p-s-1) + (v-1)*p already reaches
  // the same bubble with p-s-1 fewer chunks in flight; we keep Megatron's count, so our memory and
  // message pattern match Megatron's.)
  const auto fwd_chunk = [&](int k) { return (k / p) % v; };
  const auto bwd_chunk = [&](int k) { return v - 1 - (k / p) % v; };
  const auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
  const int total = m * v;
  for (int k = 0; k < warmup; ++k) b.forward(microbatch(k), fwd_chunk(k));
  for (int i = 0; i < total - warmup; ++i) {
    const int k = warmup + i;
    b.forward(microbatch(k), fwd_chunk(k));
    b.backward(microbatch(i), bwd_chunk(i));
  }
  for (int k = total - warmup; k < total; ++k) b.backward(microbatch(k), bwd_chunk(k));
  return std::move(b.out);
}

// ---- Replay ----

namespace {

// What one stage has done for one (micro-batch, chunk); bits.
enum : uint8_t { got_input = 1, forwarded = 2, sent_output = 4, got_grad = 8, backwarded = 16, sent_grad = 32 };

struct Message {
  int microbatch;
  int to_virtual;  // virtual stage the message is for
  double time;     // when it becomes available (the send's time)
};

struct StageState {
  size_t next = 0;  // index of the next action to run
  double clock = 0;
  int in_flight = 0;
  std::vector<uint8_t> done;   // [microbatch * chunks + chunk]
  std::vector<uint8_t> vocab;  // [microbatch]: which of its vocabulary passes have run (vocab_bit)
};

enum Direction { fwd = 0, bwd = 1 };

uint8_t vocab_bit(ActionType t) {
  return t == ActionType::vocab_embed ? 1 : t == ActionType::vocab ? 2 : 4;
}

// All stages' action lists run together: each stage's state, and the channels between stages.
class Replayer {
 public:
  Replayer(const std::vector<std::vector<Action>>& per_stage, int stages, int microbatches, int chunks,
           double t_forward, double t_backward, double t_vocab)
      : per_stage_(per_stage), p_(stages), m_(microbatches), v_(chunks), t_forward_(t_forward),
        t_backward_(t_backward), t_vocab_(t_vocab), channels_(size_t(p_) * p_ * 2), st_(p_) {
    r_.stages.resize(p_);
    for (int s = 0; s < p_; ++s) {
      st_[s].done.assign(size_t(m_) * v_, 0), st_[s].vocab.assign(size_t(m_), 0);
      r_.stages[s].starts.assign(per_stage[s].size(), 0.0);
      for (const Action& a : per_stage[s]) vocab_ = vocab_ || is_vocab_pass(a.type);
    }
  }

  // Sweep: run every stage as far as it can go, until all are done or none moves. The result does
  // not depend on the sweep order: a stage's times depend only on its own list and the send times.
  void sweep() {
    for (bool moved = true; moved;) {
      moved = false;
      for (int s = 0; s < p_; ++s)
        while (st_[s].next < per_stage_[s].size() && step(s)) moved = true;
    }
  }

  // After the sweep: an Error if a stage is stuck, a message is never received, or a forward or a
  // backward never runs; otherwise the stages' timings.
  Replay result();

 private:
  bool step(int s);
  bool receive(int s, int from, Direction dir);
  bool vocab_pass(int s);
  void once(int s, uint8_t& done, uint8_t bit) {
    ORIGAMI_CHECK(!(done & bit), where(s), "runs twice");
    done |= bit;
  }
  std::string where(int s) const {
    return cat("stage ", s, " action ", st_[s].next, " ", to_string(per_stage_[s][st_[s].next]), ": ");
  }
  // Channel (from-stage, to-stage, direction): FIFO of messages sent and not yet received.
  std::deque<Message>& channel(int from, int to, int dir) { return channels_[(size_t(from) * p_ + to) * 2 + dir]; }
  void check_no_deadlock() const;
  void check_all_received();
  void check_all_computed() const;

  const std::vector<std::vector<Action>>& per_stage_;
  const int p_, m_, v_;
  const double t_forward_, t_backward_, t_vocab_;
  bool vocab_ = false;  // the lists hold vocab passes
  std::vector<std::deque<Message>> channels_;
  std::vector<StageState> st_;
  Replay r_;
};

// Runs stage s's next action; returns false if it is a receive whose message has not been sent yet.
bool Replayer::step(int s) {
  StageState& S = st_[s];
  StageTiming& T = r_.stages[s];
  const Action& a = per_stage_[s][S.next];
  const int last_virtual = p_ * v_ - 1;
  ORIGAMI_CHECK(a.microbatch >= 0 && a.microbatch < m_ && a.chunk >= 0 && a.chunk < v_, where(s),
                "micro-batch must be in 0..", m_ - 1, " and chunk in 0..", v_ - 1);
  const int u = a.chunk * p_ + s;
  uint8_t& done = S.done[size_t(a.microbatch) * v_ + a.chunk];
  T.starts[S.next] = S.clock;
  switch (a.type) {
    case ActionType::recv_forward:
      ORIGAMI_CHECK(u != 0, where(s), "the first virtual stage has no input to receive");
      ORIGAMI_CHECK(!(done & got_input), where(s), "runs twice");
      if (!receive(s, (u - 1) % p_, fwd)) return false;
      done |= got_input;
      break;
    case ActionType::forward:
      ORIGAMI_CHECK(u == 0 || (done & got_input), where(s), "runs before its recv_forward");
      ORIGAMI_CHECK(u != 0 || !vocab_ || (S.vocab[size_t(a.microbatch)] & vocab_bit(ActionType::vocab_embed)),
                    where(s), "runs before its micro-batch's vocab_embed pass");
      once(s, done, forwarded);
      S.clock += t_forward_;
      T.busy += t_forward_;
      T.max_in_flight = std::max(T.max_in_flight, ++S.in_flight);
      break;
    case ActionType::send_forward:
      ORIGAMI_CHECK(u != last_virtual, where(s), "the last virtual stage has no output to send");
      ORIGAMI_CHECK(done & forwarded, where(s), "runs before its forward");
      once(s, done, sent_output);
      channel(s, (u + 1) % p_, fwd).push_back({a.microbatch, u + 1, S.clock});
      break;
    case ActionType::recv_backward:
      ORIGAMI_CHECK(u != last_virtual, where(s), "the last virtual stage has no output gradient to receive");
      ORIGAMI_CHECK(!(done & got_grad), where(s), "runs twice");
      if (!receive(s, (u + 1) % p_, bwd)) return false;
      done |= got_grad;
      break;
    case ActionType::backward:
      ORIGAMI_CHECK(done & forwarded, where(s), "runs before this stage's forward of the same micro-batch and chunk");
      ORIGAMI_CHECK(u == last_virtual || (done & got_grad), where(s), "runs before its recv_backward");
      ORIGAMI_CHECK(u != last_virtual || !vocab_ || (S.vocab[size_t(a.microbatch)] & vocab_bit(ActionType::vocab)),
                    where(s), "runs before its micro-batch's vocab pass");
      once(s, done, backwarded);
      S.clock += t_backward_;
      T.busy += t_backward_;
      --S.in_flight;
      break;
    case ActionType::send_backward:
      ORIGAMI_CHECK(u != 0, where(s), "the first virtual stage has no input gradient to send");
      ORIGAMI_CHECK(done & backwarded, where(s), "runs before its backward");
      once(s, done, sent_grad);
      channel(s, (u - 1 + p_) % p_, bwd).push_back({a.microbatch, u - 1, S.clock});
      break;
    case ActionType::vocab_embed:
    case ActionType::vocab:
    case ActionType::vocab_embed_grad: return vocab_pass(s);
  }
  ++S.next;
  return true;
}

// Stage s is at a vocabulary pass: a collective, so it runs (on every stage at once, from the latest
// arrival) only when every stage is at the same pass.
bool Replayer::vocab_pass(int s) {
  const Action& a = per_stage_[s][st_[s].next];
  const size_t m = size_t(a.microbatch);
  ORIGAMI_CHECK(!(st_[s].vocab[m] & vocab_bit(a.type)), where(s), "runs twice");
  for (int r = 0; r < p_; ++r)
    if (st_[r].next >= per_stage_[r].size() || per_stage_[r][st_[r].next] != a) return false;
  ORIGAMI_CHECK(a.type != ActionType::vocab || (st_[p_ - 1].done[m * v_ + v_ - 1] & forwarded), where(p_ - 1),
                "runs before the last virtual stage's forward of its micro-batch");
  ORIGAMI_CHECK(a.type != ActionType::vocab_embed_grad || (st_[0].done[m * v_] & backwarded), where(0),
                "runs before the first virtual stage's backward of its micro-batch");
  const double cost = a.type == ActionType::vocab ? t_vocab_ : 0.0;
  double start = 0;
  for (int r = 0; r < p_; ++r) start = std::max(start, st_[r].clock);
  for (int r = 0; r < p_; ++r) {
    StageState& S = st_[r];
    r_.stages[r].idle += start - S.clock;
    r_.stages[r].busy += cost;
    r_.stages[r].starts[S.next] = start;
    S.clock = start + cost;
    S.vocab[m] |= vocab_bit(a.type);
    ++S.next;
  }
  return true;
}

// A receive of stage s's next action: match the earliest unmatched send on the channel, wait for it
// if needed.
bool Replayer::receive(int s, int from, Direction dir) {
  StageState& S = st_[s];
  const Action& a = per_stage_[s][S.next];
  const int u = a.chunk * p_ + s;
  auto& q = channel(from, s, dir);
  if (q.empty()) return false;
  const Message msg = q.front();
  ORIGAMI_CHECK(msg.microbatch == a.microbatch && msg.to_virtual == u, where(s),
                "the earliest unmatched message from stage ", from, " is for mb ", msg.microbatch,
                ", virtual stage ", msg.to_virtual, ", not mb ", a.microbatch, ", virtual stage ", u);
  q.pop_front();
  if (msg.time > S.clock) {
    r_.stages[s].idle += msg.time - S.clock;
    S.clock = msg.time;
  }
  return true;
}

void Replayer::check_no_deadlock() const {
  std::string stuck;
  for (int s = 0; s < p_; ++s)
    if (st_[s].next < per_stage_[s].size())
      stuck += cat(stuck.empty() ? "" : "; ", "stage ", s, " waits at action ", st_[s].next, " ",
                   to_string(per_stage_[s][st_[s].next]));
  ORIGAMI_CHECK(stuck.empty(), "deadlock: no stage can progress: ", stuck);
}

void Replayer::check_all_received() {
  for (int from = 0; from < p_; ++from)
    for (int to = 0; to < p_; ++to)
      for (int dir : {fwd, bwd}) {
        const auto& q = channel(from, to, dir);
        ORIGAMI_CHECK(q.empty(), "stage ", from, " sent ", dir == fwd ? "an activation" : "a gradient", " (mb ",
                      q.front().microbatch, ", to virtual stage ", q.front().to_virtual, ") that stage ", to,
                      " never receives");  // (arguments are evaluated only when the check fails)
      }
}

void Replayer::check_all_computed() const {
  for (int s = 0; s < p_; ++s)
    for (int mb = 0; mb < m_; ++mb)
      for (int c = 0; c < v_; ++c) {
        const uint8_t done = st_[s].done[size_t(mb) * v_ + c];
        ORIGAMI_CHECK(done & forwarded, "stage ", s, " never runs forward(mb ", mb, ", chunk ", c, ")");
        ORIGAMI_CHECK(done & backwarded, "stage ", s, " never runs backward(mb ", mb, ", chunk ", c, ")");
        ORIGAMI_CHECK(!vocab_ || st_[s].vocab[size_t(mb)] == 7, "stage ", s, " never runs one of the vocabulary "
                      "passes of mb ", mb);
      }
}

Replay Replayer::result() {
  check_no_deadlock();
  check_all_received();
  check_all_computed();
  for (int s = 0; s < p_; ++s) {
    r_.stages[s].finish = st_[s].clock;
    r_.makespan = std::max(r_.makespan, st_[s].clock);
  }
  return r_;
}

}  // namespace

Replay replay_schedules(const std::vector<std::vector<Action>>& per_stage, int stages, int microbatches, int chunks,
                        double t_forward, double t_backward, double t_vocab) {
  ORIGAMI_CHECK(stages >= 1 && microbatches >= 1 && chunks >= 1, "replay needs stages, microbatches, chunks >= 1, got ",
                stages, ", ", microbatches, ", ", chunks);
  ORIGAMI_CHECK(int(per_stage.size()) == stages, "replay got ", per_stage.size(), " action lists for stages=", stages);
  Replayer replay(per_stage, stages, microbatches, chunks, t_forward, t_backward, t_vocab);
  replay.sweep();
  return replay.result();
}

std::vector<std::vector<Action>> with_vocab_passes(const std::vector<std::vector<Action>>& per_stage, int stages,
                                                   int microbatches, int chunks) {
  const Replay base = replay_schedules(per_stage, stages, microbatches, chunks, 1.0, 2.0);
  struct Pass {
    double time;
    Action action;
  };
  // The output passes' times: each head forward's end.
  std::vector<Pass> passes;
  std::vector<double> times;
  const size_t last = size_t(stages) - 1;
  for (size_t i = 0; i < per_stage[last].size(); ++i)
    if (per_stage[last][i].chunk == chunks - 1 && per_stage[last][i].type == ActionType::forward) {
      passes.push_back({base.stages[last].starts[i] + 1.0, {ActionType::vocab, per_stage[last][i].microbatch, 0}});
      times.push_back(passes.back().time);
    }
  std::sort(times.begin(), times.end());
  // The embedding passes join them, adding no synchronisation of their own: vocab_embed(m) at the
  // latest output pass not after the first forward of m starts (or at the start), vocab_embed_grad(m)
  // at the first one not before the first backward of m ends (or at the end).
  const double never = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < per_stage[0].size(); ++i) {
    const Action& a = per_stage[0][i];
    if (a.chunk != 0 || (a.type != ActionType::forward && a.type != ActionType::backward)) continue;
    const double start = base.stages[0].starts[i];
    if (a.type == ActionType::forward) {
      const auto after = std::upper_bound(times.begin(), times.end(), start);
      passes.push_back({after == times.begin() ? 0.0 : *(after - 1), {ActionType::vocab_embed, a.microbatch, 0}});
    } else {
      const auto at = std::lower_bound(times.begin(), times.end(), start + 2.0);
      passes.push_back({at == times.end() ? never : *at, {ActionType::vocab_embed_grad, a.microbatch, 0}});
    }
  }
  std::sort(passes.begin(), passes.end(), [](const Pass& x, const Pass& y) {
    return std::tuple(x.time, int(x.action.type), x.action.microbatch) <
           std::tuple(y.time, int(y.action.type), y.action.microbatch);
  });
  std::vector<std::vector<Action>> out(per_stage.size());
  for (size_t s = 0; s < per_stage.size(); ++s) {
    size_t next = 0;  // the next pass to place
    for (size_t i = 0; i < per_stage[s].size(); ++i) {
      const Action& a = per_stage[s][i];
      const bool compute = a.type == ActionType::forward || a.type == ActionType::backward;
      for (; compute && next < passes.size() && base.stages[s].starts[i] >= passes[next].time; ++next) {
        const bool after_recv = !out[s].empty() && (out[s].back().type == ActionType::recv_forward ||
                                                    out[s].back().type == ActionType::recv_backward);
        out[s].insert(out[s].end() - (after_recv ? 1 : 0), passes[next].action);
      }
      out[s].push_back(a);
    }
    for (; next < passes.size(); ++next) out[s].push_back(passes[next].action);
  }
  replay_schedules(out, stages, microbatches, chunks, 1.0, 2.0, 0.5);  // throws if the passes deadlock
  return out;
}

std::vector<Action> stage_actions(ScheduleKind kind, int stages, int stage, int microbatches, int chunks, bool vocab) {
  if (!vocab) return make_schedule(kind, stages, stage, microbatches, chunks);
  // Placing the passes replays every stage's list; the memory check asks for each stage of a layout
  // in turn (and the planner for many layouts of the same pipeline), so the last few are kept.
  using Key = std::tuple<int, int, int, int>;
  static std::mutex mutex;
  static std::deque<std::pair<Key, std::vector<std::vector<Action>>>> kept;
  const Key key{int(kind), stages, microbatches, chunks};
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = std::find_if(kept.begin(), kept.end(), [&](const auto& k) { return k.first == key; });
  if (it == kept.end()) {
    std::vector<std::vector<Action>> all;
    for (int s = 0; s < stages; ++s) all.push_back(make_schedule(kind, stages, s, microbatches, chunks));
    kept.emplace_front(key, with_vocab_passes(all, stages, microbatches, chunks));
    if (kept.size() > 4) kept.pop_back();
    it = kept.begin();
  }
  return it->second[size_t(stage)];
}

}  // namespace origami

namespace origami {

int64_t schedule_activation_peak(const std::vector<Action>& actions, const std::vector<int64_t>& slot_bytes,
                                 const std::vector<int>& slot_class) {
  ORIGAMI_ASSERT(slot_class.size() == slot_bytes.size());
  const size_t classes = size_t(*std::max_element(slot_class.begin(), slot_class.end())) + 1;
  std::vector<int64_t> out(classes, 0), most(classes, 0), bytes(classes, 0);
  for (const Action& a : actions) {
    const size_t k = size_t(slot_class.at(size_t(a.chunk)));
    bytes[k] = slot_bytes[size_t(a.chunk)];
    if (a.type == ActionType::forward) most[k] = std::max(most[k], ++out[k]);
    if (a.type == ActionType::backward) --out[k];
  }
  Size held = 0;  // checked (core/checked.h)
  for (size_t k = 0; k < classes; ++k) held += Size(most[k]) * bytes[k];
  return held.get();
}

std::vector<LayerRange> partition_layers(int num_layers, int stages, int chunks, const std::vector<int>& sizes) {
  const int parts = stages * chunks;
  ORIGAMI_CHECK(stages >= 1 && chunks >= 1, "pipeline stages and chunks must be at least 1, got stages=", stages,
                " chunks=", chunks);
  std::vector<int> n = sizes;
  if (n.empty()) {
    ORIGAMI_CHECK(num_layers % parts == 0, "the model's ", num_layers, " layers cannot be split evenly over ", parts,
                  " pipeline stages (", stages, " stages x ", chunks,
                  " chunks): give a multiple, or an explicit split with --pp-layers");
    n.assign(size_t(parts), num_layers / parts);
  }
  ORIGAMI_CHECK(int(n.size()) == parts, "--pp-layers lists ", n.size(), " stage sizes but the pipeline has ", parts,
                " (virtual) stages");
  std::vector<LayerRange> out;
  int64_t at = 0;  // (a sum of ints; the ranges are used only once it is the model's layers)
  for (int k : n) {
    ORIGAMI_CHECK(k >= 1, "--pp-layers: every stage needs at least one layer, got ", k);
    out.push_back({int(at), int(at + k)});
    at += k;
  }
  ORIGAMI_CHECK(at == num_layers, "--pp-layers sums to ", at, " layers but the model has ", num_layers);
  return out;
}

}  // namespace origami
