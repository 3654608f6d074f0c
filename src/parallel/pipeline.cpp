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
    : model_(model), pp_(pp), dp_(std::move(dp)), chunks_(chunks), microbatches_(microbatches) {
  ORIGAMI_ASSERT(int(model.part().chunks.size()) == chunks);
  actions_ = make_schedule(kind, pp.size(), pp.rank(), microbatches, chunks);
  // A backward is final when no later backward of the same chunk follows; finals in decreasing chunk order.
  final_.assign(actions_.size(), 0);
  std::set<int> seen;
  int last_final_chunk = chunks;
  for (size_t i = actions_.size(); i-- > 0;)
    if (actions_[i].type == ActionType::backward && seen.insert(actions_[i].chunk).second) final_[i] = 1;
  for (size_t i = 0; i < actions_.size(); ++i)
    if (final_[i]) {
      ORIGAMI_ASSERT(actions_[i].chunk < last_final_chunk);
      last_final_chunk = actions_[i].chunk;
    }
  check_tags(pp.size(), microbatches, chunks);
}

void Pipeline::check_tags(int stages, int microbatches, int chunks) {
  const int64_t boundaries = int64_t(stages) * chunks - 1;
  ORIGAMI_CHECK(2 * int64_t(microbatches) * std::max<int64_t>(boundaries, 1) <= 32767, "a pipeline with ",
                microbatches, " micro-batches per step and ", boundaries, " stage boundaries needs more MPI tags "
                "than the 32767 every MPI library provides; use fewer micro-batches");
}

// Message tags: one per (micro-batch, boundary between virtual stages b and b+1, direction).
int Pipeline::tag(int microbatch, int boundary, bool backward) const {
  const int boundaries = pp_.size() * chunks_ - 1;
  return (microbatch * boundaries + boundary) * 2 + (backward ? 1 : 0);
}

Losses Pipeline::run(const std::vector<const int32_t*>& tokens, int64_t B, int64_t T, float loss_scale) {
  ORIGAMI_ASSERT(int(tokens.size()) == microbatches_);
  model_.set_batch(B, T);
  const ActivationShape shape = model_.activation_shape();
  const int64_t n = shape.local_tokens() * model_.config().hidden;  // floats per message
  const int p = pp_.size(), s = pp_.rank(), prev = (s + p - 1) % p, next = (s + 1) % p;
  auto virtual_stage = [&](const Action& a) { return a.chunk * p + s; };

  times_ = {};
  const double t0 = now();
  auto timed_wait = [&](Request& r) {
    const double w0 = now();
    r.wait();
    times_.wait += now() - w0;
  };
  std::vector<std::unique_ptr<Transfer>> spare;  // finished transfers, buffers reused
  auto transfer = [&]() {
    std::unique_ptr<Transfer> t;
    if (spare.empty()) t = std::make_unique<Transfer>(), t->buf.resize(size_t(n));
    else t = std::move(spare.back()), spare.pop_back();
    return t;
  };
  std::map<size_t, std::unique_ptr<Transfer>> recvs;                // by index of the receive action
  std::map<std::pair<int, int>, std::unique_ptr<Transfer>> fwd_sends;  // by (micro-batch, chunk)
  std::vector<std::unique_ptr<Transfer>> bwd_sends;
  auto post_recv = [&](size_t i) {
    const Action& a = actions_[i];
    std::unique_ptr<Transfer> t = transfer();
    const int u = virtual_stage(a);
    if (a.type == ActionType::recv_forward) t->req = pp_.irecv(t->buf.data(), n, DType::f32, prev, tag(a.microbatch, u - 1, false));
    else t->req = pp_.irecv(t->buf.data(), n, DType::f32, next, tag(a.microbatch, u, true));
    recvs[i] = std::move(t);
  };
  // Before compute action i: post the next receive not yet posted, so it arrives during the compute.
  auto post_next_recv = [&](size_t i) {
    for (size_t j = i + 1; j < actions_.size(); ++j) {
      const ActionType ty = actions_[j].type;
      if (ty != ActionType::recv_forward && ty != ActionType::recv_backward) continue;
      if (!recvs.count(j)) post_recv(j);
      return;
    }
  };
  // The completed receive for the input of compute action i (the receive just before it), or null.
  size_t pending_input = SIZE_MAX;
  auto take_input = [&]() -> std::unique_ptr<Transfer> {
    if (pending_input == SIZE_MAX) return nullptr;
    std::unique_ptr<Transfer> t = std::move(recvs.at(pending_input));
    recvs.erase(pending_input);
    pending_input = SIZE_MAX;
    return t;
  };

  // Between layers, every transfer in flight is driven (tested) so it moves while this stage computes.
  model_.on_progress([&] {
    for (auto& [i, t] : recvs) t->req.test();
    for (auto& [k, t] : fwd_sends) t->req.test();
    for (auto& t : bwd_sends) t->req.test();
  });
  Losses out;
  for (size_t i = 0; i < actions_.size(); ++i) {
    const Action& a = actions_[i];
    const int32_t* tok = tokens[size_t(a.microbatch)];
    switch (a.type) {
      case ActionType::recv_forward:
      case ActionType::recv_backward:
        if (!recvs.count(i)) post_recv(i);
        timed_wait(recvs[i]->req);
        pending_input = i;
        break;
      case ActionType::forward: {
        post_next_recv(i);
        std::unique_ptr<Transfer> in = take_input();
        const double c0 = now();
        out += model_.forward(a.microbatch, a.chunk, tok, in ? in->buf.data() : nullptr);
        times_.busy += now() - c0;
        if (in) spare.push_back(std::move(in));
        break;
      }
      case ActionType::send_forward: {
        std::unique_ptr<Transfer> t = std::make_unique<Transfer>();  // sends straight from the model's slot
        t->req = pp_.isend(model_.output(a.microbatch, a.chunk), n, DType::f32, next,
                           tag(a.microbatch, virtual_stage(a), false));
        fwd_sends[{a.microbatch, a.chunk}] = std::move(t);
        break;
      }
      case ActionType::backward: {
        post_next_recv(i);
        std::unique_ptr<Transfer> d_out = take_input();
        // The slot's output is freed by backward: its forward send must be complete.
        auto f = fwd_sends.find({a.microbatch, a.chunk});
        if (f != fwd_sends.end()) {
          timed_wait(f->second->req);
          fwd_sends.erase(f);
        }
        for (DataParallel* d : dp_) d->begin_backward(final_[i]);
        const double c0 = now();
        out += model_.backward(a.microbatch, a.chunk, tok, d_out ? d_out->buf.data() : nullptr, loss_scale);
        times_.busy += now() - c0;
        for (DataParallel* d : dp_) d->end_backward();
        if (d_out) spare.push_back(std::move(d_out));
        break;
      }
      case ActionType::send_backward: {
        std::unique_ptr<Transfer> t = transfer();
        std::memcpy(t->buf.data(), model_.input_grad(), size_t(n) * sizeof(float));
        t->req = pp_.isend(t->buf.data(), n, DType::f32, prev, tag(a.microbatch, virtual_stage(a) - 1, true));
        bwd_sends.push_back(std::move(t));
        break;
      }
    }
    // Completed backward sends give their buffers back.
    for (size_t k = 0; k < bwd_sends.size();)
      if (bwd_sends[k]->req.test()) spare.push_back(std::move(bwd_sends[k])), bwd_sends.erase(bwd_sends.begin() + long(k));
      else ++k;
  }
  model_.on_progress(nullptr);
  ORIGAMI_ASSERT(recvs.empty() && fwd_sends.empty());
  for (auto& t : bwd_sends) timed_wait(t->req);
  times_.total = now() - t0;
  out.loss = out.lm_loss + out.aux_loss + out.z_loss;
  return out;
}

Losses Pipeline::evaluate(const std::vector<const int32_t*>& tokens, int64_t B, int64_t T) {
  ORIGAMI_ASSERT(int(tokens.size()) == microbatches_);  // the tags check_tags validated
  model_.set_batch(B, T);
  const int64_t n = model_.activation_shape().local_tokens() * model_.config().hidden;  // floats per message
  const int p = pp_.size(), s = pp_.rank(), prev = (s + p - 1) % p, next = (s + 1) % p, last = p * chunks_ - 1;
  // A received input and two sends in flight at most (a buffer is reused once its earlier send is
  // done): no more than a training step's message buffers (buffer_bytes), and none on one stage.
  std::vector<float> input(p > 1 ? static_cast<size_t>(n) : 0);
  std::vector<Transfer> sends(2);
  for (Transfer& t : sends) t.buf.resize(p > 1 ? size_t(n) : 0);
  size_t turn = 0;
  Losses out;
  for (int m = 0; m < int(tokens.size()); ++m)
    for (int c = 0; c < chunks_; ++c) {
      const int u = c * p + s;  // the virtual stage
      if (u > 0) pp_.irecv(input.data(), n, DType::f32, prev, tag(m, u - 1, false)).wait();
      Transfer& send = sends[turn];
      if (u < last) send.req.wait();
      out += model_.forward_only(m, c, tokens[size_t(m)], u > 0 ? input.data() : nullptr, send.buf.data());
      if (u < last) {
        send.req = pp_.isend(send.buf.data(), n, DType::f32, next, tag(m, u, false));
        turn ^= 1;
      }
    }
  for (Transfer& t : sends) t.req.wait();
  return out;
}

}  // namespace origami
