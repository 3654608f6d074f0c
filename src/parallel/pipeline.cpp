#include "parallel/pipeline.h"

#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include "core/error.h"

namespace origami {

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

// A message buffer [Nl, C] with its pending request.
struct Pipeline::Transfer {
  std::vector<float> buf;
  Request req;
};

Pipeline::Pipeline(Model& model, Comm& pp, std::vector<DataParallel*> dp, ScheduleKind kind, int microbatches,
                   int chunks)
    : model_(model), pp_(pp), dp_(std::move(dp)), kind_(kind), vocab_(model.part().vocab_parallel()), chunks_(chunks) {
  ORIGAMI_ASSERT(int(model.part().chunks.size()) == chunks);
  ORIGAMI_ASSERT(!vocab_ || model.part().vocab_stages == pp.size());
  if (vocab_) model_.set_vocab_group(pp_);
  set_microbatches(microbatches);
}

int64_t Pipeline::vocab_bytes(const std::vector<Action>& actions, int stages, int stage, int chunks, int64_t local,
                              int64_t full) {
  Size live = 0, peak = 0;  // checked (core/checked.h)
  for (const Action& a : actions) {
    const bool first = stage == 0 && a.chunk == 0, last = stage == stages - 1 && a.chunk == chunks - 1;
    if ((stage == 0 && a.type == ActionType::vocab_embed) || (stage == stages - 1 && a.type == ActionType::vocab))
      peak = std::max(peak, live += local);
    if ((first && a.type == ActionType::forward) || (last && a.type == ActionType::backward)) live -= local;
    if (first && a.type == ActionType::backward) peak = std::max(peak, live += full);
    if (stage == 0 && a.type == ActionType::vocab_embed_grad) live -= full;
  }
  return (4 * peak).get();
}

int64_t Pipeline::buffer_bytes(const std::vector<Action>& actions, int stages, int64_t floats) {
  if (stages <= 1) return 0;
  int64_t sends = 0;
  bool backward_seen = false, forward_after_backward = false;
  for (const Action& a : actions) {
    sends += a.type == ActionType::send_backward ? 1 : 0;
    forward_after_backward = forward_after_backward || (backward_seen && a.type == ActionType::forward);
    backward_seen = backward_seen || a.type == ActionType::backward;
  }
  const int64_t in_flight = forward_after_backward ? std::min(sends, kMaxBackwardSends) : sends;
  return (4 * Size(floats) * std::max<int64_t>(3, 2 + in_flight)).get();
}

int64_t Pipeline::vocab_message_buffers() const {
  return vocab_ ? vocab_bytes(actions_, pp_.size(), pp_.rank(), chunks_, 1, 0) / 4 : 0;
}

void Pipeline::set_microbatches(int microbatches) {
  if (microbatches == microbatches_) return;
  check_tags(pp_.size(), microbatches, chunks_);
  microbatches_ = microbatches;
  actions_ = stage_actions(kind_, pp_.size(), pp_.rank(), microbatches, chunks_, vocab_);
  // A backward is final when no later backward of the same chunk follows; finals in decreasing chunk order.
  final_.assign(actions_.size(), 0);
  std::set<int> seen;
  int last_final_chunk = chunks_;
  for (size_t i = actions_.size(); i-- > 0;)
    if (actions_[i].type == ActionType::backward && seen.insert(actions_[i].chunk).second) final_[i] = 1;
  for (size_t i = 0; i < actions_.size(); ++i)
    if (final_[i]) {
      ORIGAMI_ASSERT(actions_[i].chunk < last_final_chunk);
      last_final_chunk = actions_[i].chunk;
    }
}

void Pipeline::check_tags(int stages, int64_t microbatches, int chunks) {
  ORIGAMI_CHECK(stages == 1 || 2 * microbatches * chunks <= 32767, "a pipeline with ", microbatches,
                " micro-batches per step and ", chunks, " chunks per stage needs more MPI tags than the 32767 every MPI "
                "library provides; use fewer micro-batches (a larger --micro-batch, a smaller --global-batch or "
                "--tokens-per-step) or fewer chunks (--vpp)");
}

// Message tags: unique per (micro-batch, boundary between virtual stages b and b+1, direction) among
// the messages one rank sends another. Every boundary a rank sends over to the same peer in the same
// direction is b ≡ r (mod stages) for one r (virtual stage c·stages + s is stage s's chunk c), so
// b / stages, the chunk on the boundary's lower side, tells them apart: 2·micro-batches·chunks tags,
// whatever the stages.
int Pipeline::message_tag(int microbatch, int boundary, bool backward, int stages, int chunks) {
  return (microbatch * chunks + boundary / stages) * 2 + (backward ? 1 : 0);
}

int Pipeline::tag(int microbatch, int boundary, bool backward) const {
  return message_tag(microbatch, boundary, backward, pp_.size(), chunks_);
}

// One run(): its transfers in flight and its actions, in the schedule's order.
class Pipeline::Step {
 public:
  // n: floats per message ([Nl, C]); full: floats of [N, C].
  Step(Pipeline& pipe, const std::vector<const int32_t*>& tokens, float loss_scale, int64_t n, int64_t full)
      : pipe_(pipe), tokens_(tokens), loss_scale_(loss_scale), n_(n), full_(full), p_(pipe.pp_.size()), s_(pipe.pp_.rank()),
        prev_((s_ + p_ - 1) % p_), next_((s_ + 1) % p_) {}

  // Runs action i.
  void run(size_t i) {
    const Action& a = pipe_.actions_[i];
    switch (a.type) {
      case ActionType::recv_forward:
      case ActionType::recv_backward: receive(i); break;
      case ActionType::forward: forward(i); break;
      case ActionType::send_forward: send_forward(a); break;
      case ActionType::backward: backward(i); break;
      case ActionType::send_backward: send_backward(a); break;
      case ActionType::vocab_embed: vocab_embed(a); break;
      case ActionType::vocab: vocab(a); break;
      case ActionType::vocab_embed_grad: vocab_embed_grad(a); break;
    }
    // Completed backward sends give their buffers back.
    for (size_t k = 0; k < bwd_sends_.size();)
      if (bwd_sends_[k]->req.test())
        spare_.push_back(std::move(bwd_sends_[k])), bwd_sends_.erase(bwd_sends_.begin() + long(k));
      else ++k;
  }

  // Every transfer in flight tested, so that it moves.
  void drive() {
    for (auto& [i, t] : recvs_) t->req.test();
    for (auto& [k, t] : fwd_sends_) t->req.test();
    for (auto& t : bwd_sends_) t->req.test();
  }

  // After the last action: the backward sends still in flight completed.
  void finish() {
    ORIGAMI_ASSERT(recvs_.empty() && fwd_sends_.empty());
    for (auto& t : bwd_sends_) timed_wait(t->req);
  }

  const Losses& losses() const { return out_; }
  int64_t allocated() const { return allocated_; }  // message buffers (transfer())

 private:
  void receive(size_t i) {
    if (!recvs_.count(i)) post_recv(i);
    timed_wait(recvs_[i]->req);
    pending_input_ = i;
  }

  void forward(size_t i) {
    const Action& a = pipe_.actions_[i];
    const int32_t* tok = tokens_[size_t(a.microbatch)];
    post_next_recv(i);
    std::unique_ptr<Transfer> in = take_input();
    if (!in && pipe_.vocab_ && virtual_stage(a) == 0) in = take(embeds_, a.microbatch);  // (vocab_embed)
    const double c0 = now();
    out_ += pipe_.model_.forward(a.microbatch, a.chunk, tok, in ? in->buf.data() : nullptr);
    pipe_.times_.busy += now() - c0;
    if (in) spare_.push_back(std::move(in));
  }

  void send_forward(const Action& a) {
    std::unique_ptr<Transfer> t = std::make_unique<Transfer>();  // sends straight from the model's slot
    t->req = pipe_.pp_.isend(pipe_.model_.output(a.microbatch, a.chunk), n_, DType::f32, next_,
                             pipe_.tag(a.microbatch, virtual_stage(a), false));
    fwd_sends_[{a.microbatch, a.chunk}] = std::move(t);
  }

  void backward(size_t i) {
    const Action& a = pipe_.actions_[i];
    const int32_t* tok = tokens_[size_t(a.microbatch)];
    post_next_recv(i);
    std::unique_ptr<Transfer> d_out = take_input();
    if (!d_out && pipe_.vocab_ && virtual_stage(a) == p_ * pipe_.chunks_ - 1) d_out = take(d_tops_, a.microbatch);
    // The slot's output is freed by backward: its forward send must be complete.
    auto f = fwd_sends_.find({a.microbatch, a.chunk});
    if (f != fwd_sends_.end()) {
      timed_wait(f->second->req);
      fwd_sends_.erase(f);
    }
    for (DataParallel* d : pipe_.dp_) d->begin_backward(pipe_.final_[i], a.chunk);
    if (pipe_.before_backward_) pipe_.before_backward_();
    const double c0 = now();
    out_ += pipe_.model_.backward(a.microbatch, a.chunk, tok, d_out ? d_out->buf.data() : nullptr, loss_scale_);
    pipe_.times_.busy += now() - c0;
    for (DataParallel* d : pipe_.dp_) d->end_backward();
    if (d_out) spare_.push_back(std::move(d_out));
    if (pipe_.vocab_ && virtual_stage(a) == 0) {  // ∂/∂(embedding rows) [N, C], for vocab_embed_grad
      std::vector<float>& g = embed_grads_[a.microbatch];
      g.assign(pipe_.model_.input_grad(), pipe_.model_.input_grad() + full_);
    }
  }

  // The embedding pass of a micro-batch, on every stage; the first keeps its first chunk's input.
  void vocab_embed(const Action& a) {
    const double c0 = now();
    std::unique_ptr<Transfer> x0 = s_ == 0 ? transfer() : nullptr;
    pipe_.model_.vocab_embed(a.microbatch, tokens_[size_t(a.microbatch)], x0 ? x0->buf.data() : nullptr);
    if (x0) embeds_[a.microbatch] = std::move(x0);
    pipe_.times_.vocab += now() - c0;
  }

  // The embedding's backward of a micro-batch, on every stage, from the first stage's gradient.
  void vocab_embed_grad(const Action& a) {
    const double c0 = now();
    auto g = embed_grads_.find(a.microbatch);
    pipe_.model_.vocab_embed_backward(a.microbatch, tokens_[size_t(a.microbatch)],
                                      g == embed_grads_.end() ? nullptr : g->second.data());
    if (g != embed_grads_.end()) embed_grads_.erase(g);
    pipe_.times_.vocab += now() - c0;
  }

  // The output pass of a micro-batch, on every stage; the last keeps ∂/∂(its head chunk's output).
  void vocab(const Action& a) {
    const bool last = s_ == p_ - 1;
    std::unique_ptr<Transfer> d_top = last ? transfer() : nullptr;
    const double c0 = now();
    out_ += pipe_.model_.vocab_head(a.microbatch, tokens_[size_t(a.microbatch)],
                                    last ? pipe_.model_.output(a.microbatch, pipe_.chunks_ - 1) : nullptr,
                                    last ? d_top->buf.data() : nullptr, loss_scale_, true);
    pipe_.times_.vocab += now() - c0;
    if (last) d_tops_[a.microbatch] = std::move(d_top);
  }

  void send_backward(const Action& a) {
    std::unique_ptr<Transfer> t = transfer();
    std::memcpy(t->buf.data(), pipe_.model_.input_grad(), size_t(n_) * sizeof(float));
    t->req = pipe_.pp_.isend(t->buf.data(), n_, DType::f32, prev_, pipe_.tag(a.microbatch, virtual_stage(a) - 1, true));
    bwd_sends_.push_back(std::move(t));
  }

  int virtual_stage(const Action& a) const { return a.chunk * p_ + s_; }

  void timed_wait(Request& r) {
    const double w0 = now();
    r.wait();
    pipe_.times_.wait += now() - w0;
  }

  std::unique_ptr<Transfer> transfer() {
    std::unique_ptr<Transfer> t;
    if (spare_.empty()) t = std::make_unique<Transfer>(), t->buf.resize(size_t(n_)), ++allocated_;
    else t = std::move(spare_.back()), spare_.pop_back();
    return t;
  }

  void post_recv(size_t i) {
    const Action& a = pipe_.actions_[i];
    std::unique_ptr<Transfer> t = transfer();
    const int u = virtual_stage(a);
    Comm& pp = pipe_.pp_;
    if (a.type == ActionType::recv_forward)
      t->req = pp.irecv(t->buf.data(), n_, DType::f32, prev_, pipe_.tag(a.microbatch, u - 1, false));
    else t->req = pp.irecv(t->buf.data(), n_, DType::f32, next_, pipe_.tag(a.microbatch, u, true));
    recvs_[i] = std::move(t);
  }

  // Before compute action i: post the next receive not yet posted, so it arrives during the compute.
  void post_next_recv(size_t i) {
    const std::vector<Action>& actions = pipe_.actions_;
    for (size_t j = i + 1; j < actions.size(); ++j) {
      const ActionType ty = actions[j].type;
      if (ty != ActionType::recv_forward && ty != ActionType::recv_backward) continue;
      if (!recvs_.count(j)) post_recv(j);
      return;
    }
  }

  static std::unique_ptr<Transfer> take(std::map<int, std::unique_ptr<Transfer>>& kept, int microbatch) {
    auto it = kept.find(microbatch);
    ORIGAMI_ASSERT(it != kept.end());
    std::unique_ptr<Transfer> t = std::move(it->second);
    kept.erase(it);
    return t;
  }

  // The completed receive for the input of compute action i (the receive just before it), or null.
  std::unique_ptr<Transfer> take_input() {
    if (pending_input_ == SIZE_MAX) return nullptr;
    std::unique_ptr<Transfer> t = std::move(recvs_.at(pending_input_));
    recvs_.erase(pending_input_);
    pending_input_ = SIZE_MAX;
    return t;
  }

  Pipeline& pipe_;
  const std::vector<const int32_t*>& tokens_;
  const float loss_scale_;
  const int64_t n_, full_;  // floats per message, of [N, C]
  const int p_, s_, prev_, next_;
  std::vector<std::unique_ptr<Transfer>> spare_;  // finished transfers, buffers reused
  std::map<size_t, std::unique_ptr<Transfer>> recvs_;                // by index of the receive action
  std::map<std::pair<int, int>, std::unique_ptr<Transfer>> fwd_sends_;  // by (micro-batch, chunk)
  std::vector<std::unique_ptr<Transfer>> bwd_sends_;
  // Vocabulary parallelism, by micro-batch: the first stage's inputs from vocab_embed and gradients for
  // vocab_embed_grad ([N, C]), the last stage's gradients from vocab.
  std::map<int, std::unique_ptr<Transfer>> embeds_, d_tops_;
  std::map<int, std::vector<float>> embed_grads_;
  size_t pending_input_ = SIZE_MAX;  // the receive take_input() gives next
  int64_t allocated_ = 0;
  Losses out_;
};

Losses Pipeline::run(const std::vector<const int32_t*>& tokens, int64_t B, int64_t T, float loss_scale) {
  set_microbatches(int(tokens.size()));
  model_.set_batch(B, T);
  const ActivationShape shape = model_.activation_shape();
  const int64_t n = shape.local_tokens() * model_.config().hidden;  // floats per message

  times_ = {};
  const double t0 = now();
  Step step(*this, tokens, loss_scale, n, shape.B * shape.T * model_.config().hidden);
  // Between layers, every transfer in flight is driven (tested) so it moves while this stage computes.
  model_.on_progress([&] { step.drive(); });
  for (size_t i = 0; i < actions_.size(); ++i) step.run(i);
  model_.on_progress(nullptr);
  step.finish();
  times_.total = now() - t0;
  times_.message_buffers = step.allocated();
  Losses out = step.losses();
  out.loss = out.lm_loss + out.aux_loss + out.z_loss;
  return out;
}

Losses Pipeline::evaluate(const std::vector<const int32_t*>& tokens, int64_t B, int64_t T) {
  check_tags(pp_.size(), int64_t(tokens.size()), chunks_);
  model_.set_batch(B, T);
  const ActivationShape shape = model_.activation_shape();
  const int64_t n = shape.local_tokens() * model_.config().hidden;  // floats per message
  const int p = pp_.size(), s = pp_.rank(), prev = (s + p - 1) % p, next = (s + 1) % p, last = p * chunks_ - 1;
  // A received input and two sends in flight at most (a buffer is reused once its earlier send is
  // done): no more than a training step's message buffers (buffer_bytes), and none on one stage.
  // Under vocabulary parallelism the last stage's head chunk output goes to `top`, the output pass's input.
  // The first stage's first chunk reads its input from `embed`, vocab_embed's output.
  std::vector<float> input(p > 1 ? static_cast<size_t>(n) : 0), top(vocab_ && s == p - 1 ? size_t(n) : 0),
      embed(vocab_ && s == 0 ? size_t(n) : 0);
  std::vector<Transfer> sends(2);
  for (Transfer& t : sends) t.buf.resize(p > 1 ? size_t(n) : 0);
  size_t turn = 0;
  Losses out;
  // Between layers the sends in flight are tested, so that they move while this stage computes (MPI moves a
  // large message only while both sides call into it), as in a training step.
  model_.on_progress([&] {
    for (Transfer& t : sends) t.req.test();
  });
  for (int m = 0; m < int(tokens.size()); ++m) {
    if (vocab_) model_.vocab_embed(m, tokens[size_t(m)], embed.empty() ? nullptr : embed.data());
    for (int c = 0; c < chunks_; ++c) {
      const int u = c * p + s;  // the virtual stage
      if (u > 0) pp_.irecv(input.data(), n, DType::f32, prev, tag(m, u - 1, false)).wait();
      const float* in = u > 0 ? input.data() : vocab_ ? embed.data() : nullptr;
      Transfer& send = sends[turn];
      if (u < last) send.req.wait();
      out += model_.forward_only(m, c, tokens[size_t(m)], in, u < last ? send.buf.data() : top.data());
      if (u < last) {
        send.req = pp_.isend(send.buf.data(), n, DType::f32, next, tag(m, u, false));
        turn ^= 1;
      }
    }
    if (vocab_) out += model_.vocab_head(m, tokens[size_t(m)], top.empty() ? nullptr : top.data(), nullptr, 1.f, false);
  }
  model_.on_progress(nullptr);
  for (Transfer& t : sends) t.req.wait();
  return out;
}

}  // namespace origami
