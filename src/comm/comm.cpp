#include "comm/comm.h"

#include <filesystem>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/files.h"

namespace origami {

int64_t dtype_bytes(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::bf16: return 2;
  }
  return 0;
}

namespace {
// A wait where nothing may throw (a destructor, a move): an MPI error there ends this rank with the
// message and exit 2, as an error during training does (cmd_train aborts the job with 2, which
// `origami launch` restarts), not with std::terminate's abort.
void wait_or_exit(Request::Impl& impl) noexcept {
  try {
    impl.wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "origami: error: %s\n", e.what());
    std::fflush(stderr);
    std::_Exit(2);
  }
}
}  // namespace

Request& Request::operator=(Request&& o) noexcept {
  if (this != &o) {
    if (impl_) wait_or_exit(*impl_);
    impl_ = std::move(o.impl_);
  }
  return *this;
}

Request::~Request() {
  if (!impl_) return;
  // Destroyed as an error leaves this rank's scope (this rank's alone: its command reports it and aborts
  // the job), a request is abandoned, not waited for: its peer may itself wait for this rank (a pipeline
  // stage's receive posted ahead, whose sender waits for the input this rank failed to compute). Kept
  // where it stays reachable, as MPI may still use its handles until the abort.
  if (std::uncaught_exceptions() > unwinding_) {
    static auto* abandoned = new std::vector<std::unique_ptr<Impl>>();
    abandoned->push_back(std::move(impl_));
    return;
  }
  wait_or_exit(*impl_);
}

bool Request::test() {
  if (!impl_) return true;
  if (!impl_->test()) return false;
  impl_.reset();
  return true;
}

void Request::wait() {
  if (!impl_) return;
  impl_->wait();
  impl_.reset();
}

void Comm::all_to_all(void* out, const void* in, int64_t count, DType t) {
  std::vector<int64_t> counts(size_t(size()), count);
  all_to_allv(out, counts.data(), in, counts.data(), t);
}

void check_on_every_rank(Comm& world, const std::string& command, const std::function<void()>& fn) {
  std::string message;
  bool failed = false;
  try {
    fn();
  } catch (const Error& e) {
    failed = true;
    message = e.what();
  } catch (const std::filesystem::filesystem_error& e) {  // a path a user gave
    failed = true;
    message = filesystem_words(e);
  }
  // first failing rank = size − max(size − rank over failing ranks)
  const int32_t first = world.size() - world.all_reduce_value(int32_t(failed ? world.size() - world.rank() : 0), ReduceOp::max);
  if (first == world.size()) return;
  if (first == world.rank()) std::fprintf(stderr, "origami %s: error: %s\n", command.c_str(), message.c_str());
  throw ErrorReported(failed ? message : "reported by rank " + std::to_string(first));
}

namespace {

// One rank: reductions are identities, gathers and scatters are copies, nothing is sent.
class LocalComm final : public Comm {
 public:
  explicit LocalComm(const std::string& name) : Comm(0, 1, name) {}
  Request iall_reduce(void*, int64_t, DType, ReduceOp) override { return {}; }
  Request ireduce_scatter(void* out, const void* in, int64_t count, DType t, ReduceOp) override {
    copy(out, in, count, t);
    return {};
  }
  Request iall_gather(void* out, const void* in, int64_t count, DType t) override {
    copy(out, in, count, t);
    return {};
  }
  Request isend(const void*, int64_t, DType, int dest, int) override { fail("internal error: send to rank ", dest, " on a one-rank communicator"); }
  Request irecv(void*, int64_t, DType, int src, int) override { fail("internal error: receive from rank ", src, " on a one-rank communicator"); }
  void all_to_allv(void* out, const int64_t* recv_counts, const void* in, const int64_t* send_counts, DType t) override {
    ORIGAMI_ASSERT(recv_counts[0] == send_counts[0]);
    copy(out, in, send_counts[0], t);
  }
  void all_gather_v(void* out, const void* in, const int64_t* counts, DType t) override { copy(out, in, counts[0], t); }
  void reduce_scatter_v(void* out, const void* in, const int64_t* counts, DType t, ReduceOp) override {
    copy(out, in, counts[0], t);
  }
  void broadcast(void*, int64_t, DType, int) override {}
  void barrier() override {}
  std::unique_ptr<Comm> split(int, int, const std::string& name) override { return std::make_unique<LocalComm>(name); }

 private:
  static void copy(void* out, const void* in, int64_t count, DType t) {
    if (out != in) std::memmove(out, in, size_t(count * dtype_bytes(t)));
  }
};

}  // namespace

std::unique_ptr<Comm> make_local_comm(const std::string& name) { return std::make_unique<LocalComm>(name); }

}  // namespace origami
