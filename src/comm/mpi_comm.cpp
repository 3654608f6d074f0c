// MPI implementation of Comm. Non-blocking collectives are MPI-3 (MPI_Iallreduce,
// MPI_Ireduce_scatter_block, MPI_Iallgather); MPI errors are returned, not fatal, and become
// origami::Error naming the call, the communicator and file:line.
#include "comm/mpi_comm.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/progress.h"
#include "kernels/cpu/bf16.h"

#define CHECK_MPI(call)                                                                           \
  do {                                                                                            \
    int rc_ = (call);                                                                             \
    if (rc_ != MPI_SUCCESS) ::origami::fail("MPI error in ", #call, ": ", mpi_error_string(rc_), \
                                            " at ", __FILE__, ":", __LINE__);                     \
  } while (0)

namespace origami {

namespace {

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  return std::string(buf, size_t(len));
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::bf16: return MPI_UINT16_T;  // the bits; reductions use bf16_sum
  }
  return MPI_DATATYPE_NULL;
}

// MPI has no bf16 type: its sum is a user operation, inout[i] = bf16(float(in[i]) + float(inout[i]))
// (commutative, so MPI may reorder the ranks), created after MPI_Init and freed before MPI_Finalize.
MPI_Op bf16_sum = MPI_OP_NULL;

void bf16_sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  constexpr int kChunk = 512;
  float a[kChunk], b[kChunk];
  const bf16* x = static_cast<const bf16*>(in);
  bf16* y = static_cast<bf16*>(inout);
  for (int at = 0, n; at < *len; at += n) {  // (steps of n: `at` never passes *len, which may be INT_MAX)
    n = std::min(kChunk, *len - at);
    to_float(a, x + at, n);
    to_float(b, y + at, n);
    for (int i = 0; i < n; ++i) a[i] += b[i];
    to_bf16(y + at, a, n);
  }
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  if (t != DType::bf16) return op == ReduceOp::sum ? MPI_SUM : MPI_MAX;
  ORIGAMI_ASSERT(op == ReduceOp::sum && bf16_sum != MPI_OP_NULL);
  return bf16_sum;
}

int mpi_count(int64_t count) {
  ORIGAMI_CHECK(count >= 0 && count <= INT_MAX, "a single MPI transfer of ", count,
                " elements exceeds MPI's int count limit (", INT_MAX, ")");
  return int(count);
}

// MPI's counts and displacements are ints (Open MPI 4 has no MPI-4 large-count calls), so a transfer
// of more elements goes in pieces of at most max_count(): INT_MAX, or what ORIGAMI_TEST_MPI_MAX_COUNT
// says (tests run whole layouts through the pieces with a small one; every rank must see the same
// value — mpirun passes it to local ranks, remote ones need -x — or their calls would differ).
int64_t max_count() {
  static const int64_t most = [] {
    const char* v = std::getenv("ORIGAMI_TEST_MPI_MAX_COUNT");
    return v != nullptr ? std::clamp<int64_t>(std::atoll(v), 1, INT_MAX) : int64_t(INT_MAX);
  }();
  return most;
}

// The transfers that went in pieces or in units (mpi_transfers_in_pieces).
std::atomic<int64_t> transfers_in_pieces{0};

// f(at, n) over the pieces of [0, count): at least one call (a collective of 0 elements is still one).
template <typename F>
void in_pieces(int64_t count, F&& f) {
  const int64_t most = max_count();
  if (count > most) ++transfers_in_pieces;
  for (int64_t at = 0; at == 0 || at < count; at += most) f(at, int(std::min(most, count - at)));
}

char* at_element(void* p, int64_t i, DType t) { return static_cast<char*>(p) + i * dtype_bytes(t); }
const char* at_element(const void* p, int64_t i, DType t) { return static_cast<const char*>(p) + i * dtype_bytes(t); }

// A non-blocking call's MPI requests (one per piece), and what runs once they are all done.
class MpiRequests final : public Request::Impl {
 public:
  std::vector<MPI_Request> reqs;
  std::function<void()> then;
  bool test() override {
    int done = 0;
    check(MPI_Testall(int(reqs.size()), reqs.data(), &done, statuses()), "MPI_Testall");
    if (done != 0) finish();
    return done != 0;
  }
  void wait() override {
    check(MPI_Waitall(int(reqs.size()), reqs.data(), statuses()), "MPI_Waitall");
    finish();
  }

 private:
  std::vector<MPI_Status> statuses_;
  MPI_Status* statuses() {
    statuses_.resize(reqs.size());
    return statuses_.data();
  }
  // MPI_ERR_IN_STATUS says only that some piece failed: the failed piece's status holds its error.
  void check(int rc, const char* call) {
    if (rc == MPI_SUCCESS) return;
    if (rc == MPI_ERR_IN_STATUS)
      for (const MPI_Status& st : statuses_)
        if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING) rc = st.MPI_ERROR;
    fail("MPI error in ", call, " of a non-blocking transfer: ", mpi_error_string(rc));
  }
  void finish() {
    if (then) std::exchange(then, nullptr)();
  }
};

// post(requests) starts the call's pieces, each adding its MPI_Request.
template <typename Post>
Request start(Post&& post, std::function<void()> then = nullptr) {
  auto r = std::make_unique<MpiRequests>();
  post(r->reqs);
  r->then = std::move(then);
  return Request(std::move(r));
}
template <typename Post>
Request start_one(Post&& post) {
  return start([&](std::vector<MPI_Request>& reqs) { post(&reqs.emplace_back(MPI_REQUEST_NULL)); });
}
// One call over [0, count) in pieces: post(at, n, request) starts the piece of n elements at `at`.
template <typename Post>
Request start_pieces(int64_t count, Post&& post) {
  return start([&](std::vector<MPI_Request>& reqs) {
    in_pieces(count, [&](int64_t at, int n) { post(at, n, &reqs.emplace_back(MPI_REQUEST_NULL)); });
  });
}

// Counts and displacements of a v-collective in units of their greatest common divisor g when they
// exceed max_count(): the token dispatcher's are rows of C values, so they fit ints up to 2^31 rows.
// The unit type is freed when this goes.
struct Units {
  MPI_Datatype type;
  int64_t g = 1;
  bool owned = false;
  Units(DType t, std::initializer_list<const std::vector<int64_t>*> lists) : type(mpi_type(t)) {
    int64_t common = 0, most = 0;  // the gcd of every count; the largest list's total (its last displacement's end)
    for (const std::vector<int64_t>* l : lists) {
      int64_t total = 0;
      for (int64_t c : *l) common = std::gcd(common, c), total += c;
      most = std::max(most, total);
    }
    if (most <= max_count() || common <= 1) return;  // in elements
    ++transfers_in_pieces;
    g = common;
    // (a unit that fits an int: the gcd divided by its least divisor that brings it there)
    for (int64_t k = (g + INT_MAX - 1) / INT_MAX; g > INT_MAX && k <= (int64_t(1) << 20); ++k)
      if (common % k == 0) g = common / k;
    CHECK_MPI(MPI_Type_contiguous(mpi_count(g), mpi_type(t), &type));
    CHECK_MPI(MPI_Type_commit(&type));
    owned = true;
  }
  ~Units() {
    if (owned) MPI_Type_free(&type);
  }
  // counts (elements) → counts and displacements in units
  void convert(const std::vector<int64_t>& counts, std::vector<int>& c, std::vector<int>& d) const {
    c.resize(counts.size()), d.resize(counts.size());
    int64_t at = 0;
    for (size_t r = 0; r < counts.size(); ++r)
      c[r] = mpi_count(counts[r] / g), d[r] = mpi_count(at / g), at += counts[r];
  }
};

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm c, const std::string& name, bool owned) : Comm(rank_of(c), size_of(c), name), comm_(c), owned_(owned) {
    CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  }
  ~MpiComm() override {
    if (owned_) MPI_Comm_free(&comm_);
  }

  Request iall_reduce(void* buf, int64_t count, DType t, ReduceOp op) override {
    progress_entered("all_reduce", name());
    count_all_reduce(count, t);
    if (size() == 1) return {};
    return start_pieces(count, [&](int64_t at, int n, MPI_Request* r) {
      CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, at_element(buf, at, t), n, mpi_type(t), mpi_op(op, t), comm_, r));
    });
  }
  Request ireduce_scatter(void* out, const void* in, int64_t count, DType t, ReduceOp op) override {
    progress_entered("reduce_scatter", name());
    count_scatter_gather(count, t);
    // (the library works on the whole buffer, size() blocks, in int arithmetic: the total decides)
    if (int64_t(size()) * count <= max_count())
      return start_one([&](MPI_Request* r) {
        CHECK_MPI(MPI_Ireduce_scatter_block(in == out ? MPI_IN_PLACE : in, out, mpi_count(count), mpi_type(t),
                                            mpi_op(op, t), comm_, r));
      });
    // Larger blocks: each rank's block reduced onto it in pieces. In place (in == out), a rank's sum
    // lands in its own block and moves to the buffer's start once every piece is done.
    ++transfers_in_pieces;
    const bool in_place = in == out;
    return start(
        [&](std::vector<MPI_Request>& reqs) {
          for (int r = 0; r < size(); ++r)
            in_pieces(count, [&](int64_t at, int n) {
              const char* src = at_element(in, int64_t(r) * count + at, t);
              const bool mine = r == rank();
              void* dst = mine ? (in_place ? const_cast<char*>(src) : at_element(out, at, t)) : nullptr;
              CHECK_MPI(MPI_Ireduce(mine && in_place ? MPI_IN_PLACE : src, dst, n, mpi_type(t), mpi_op(op, t), r, comm_,
                                    &reqs.emplace_back(MPI_REQUEST_NULL)));
            });
        },
        in_place && rank() > 0 ? std::function<void()>([=, this] {
          std::memmove(out, at_element(out, int64_t(rank()) * count, t), size_t(count * dtype_bytes(t)));
        })
                               : nullptr);
  }
  Request iall_gather(void* out, const void* in, int64_t count, DType t) override {
    progress_entered("all_gather", name());
    count_scatter_gather(count, t);
    // In place when this rank's block already sits at its position in `out`.
    char* mine = at_element(out, int64_t(rank()) * count, t);
    const bool in_place = in == mine;
    if (int64_t(size()) * count <= max_count())  // (the whole buffer's offsets are ints too)
      return start_one([&](MPI_Request* r) {
        CHECK_MPI(MPI_Iallgather(in_place ? MPI_IN_PLACE : in, mpi_count(count), mpi_type(t), out, mpi_count(count),
                                 mpi_type(t), comm_, r));
      });
    // Larger blocks: each rank broadcasts its own, in pieces.
    ++transfers_in_pieces;
    if (!in_place) std::memcpy(mine, in, size_t(count * dtype_bytes(t)));
    return start([&](std::vector<MPI_Request>& reqs) {
      for (int r = 0; r < size(); ++r)
        in_pieces(count, [&](int64_t at, int n) {
          CHECK_MPI(MPI_Ibcast(at_element(out, int64_t(r) * count + at, t), n, mpi_type(t), r, comm_,
                               &reqs.emplace_back(MPI_REQUEST_NULL)));
        });
    });
  }
  // Point to point in pieces of one tag: MPI keeps their order between two ranks (the receiver posts
  // the sender's count).
  Request isend(const void* buf, int64_t count, DType t, int dest, int tag) override {
    progress_entered("send", name());
    count_bytes(double(count * dtype_bytes(t)));
    return start_pieces(count, [&](int64_t at, int n, MPI_Request* r) {
      CHECK_MPI(MPI_Isend(at_element(buf, at, t), n, mpi_type(t), dest, tag, comm_, r));
    });
  }
  Request irecv(void* buf, int64_t count, DType t, int src, int tag) override {
    progress_entered("recv", name());
    return start_pieces(count, [&](int64_t at, int n, MPI_Request* r) {
      CHECK_MPI(MPI_Irecv(at_element(buf, at, t), n, mpi_type(t), src, tag, comm_, r));
    });
  }
  void all_to_allv(void* out, const int64_t* recv_counts, const void* in, const int64_t* send_counts, DType t) override {
    progress_entered("all_to_all", name());
    const std::vector<int64_t> sent(send_counts, send_counts + size()), received(recv_counts, recv_counts + size());
    int64_t others = 0;
    for (int r = 0; r < size(); ++r) others += r != rank() ? sent[size_t(r)] : 0;
    count_bytes(double(others * dtype_bytes(t)));
    const Units u(t, {&sent, &received});
    std::vector<int> sc, sd, rc, rd;
    u.convert(sent, sc, sd), u.convert(received, rc, rd);
    CHECK_MPI(MPI_Alltoallv(in, sc.data(), sd.data(), u.type, out, rc.data(), rd.data(), u.type, comm_));
  }
  void all_gather_v(void* out, const void* in, const int64_t* counts, DType t) override {
    progress_entered("all_gather_v", name());
    count_gather_v(counts, t);
    const std::vector<int64_t> each(counts, counts + size());
    const Units u(t, {&each});
    std::vector<int> c, d;
    u.convert(each, c, d);
    const bool in_place = in == at_element(out, int64_t(d[size_t(rank())]) * u.g, t);
    CHECK_MPI(MPI_Allgatherv(in_place ? MPI_IN_PLACE : in, c[size_t(rank())], u.type, out, c.data(), d.data(), u.type,
                             comm_));
  }
  void reduce_scatter_v(void* out, const void* in, const int64_t* counts, DType t, ReduceOp op) override {
    progress_entered("reduce_scatter_v", name());
    count_scatter_v(counts, t);
    std::vector<int64_t> at(size_t(size()) + 1, 0);  // each rank's block's start in `in`
    for (int r = 0; r < size(); ++r) at[size_t(r) + 1] = at[size_t(r)] + counts[r];
    if (at.back() <= max_count()) {
      std::vector<int> c(static_cast<size_t>(size()));
      for (size_t r = 0; r < c.size(); ++r) c[r] = mpi_count(counts[r]);
      CHECK_MPI(MPI_Reduce_scatter(in, out, c.data(), mpi_type(t), mpi_op(op, t), comm_));
      return;
    }
    // Larger: each rank's block reduced onto it, in pieces (a reduction needs the base type, not a unit).
    ++transfers_in_pieces;
    for (int r = 0; r < size(); ++r)
      in_pieces(counts[r], [&](int64_t off, int n) {
        CHECK_MPI(MPI_Reduce(at_element(in, at[size_t(r)] + off, t), r == rank() ? at_element(out, off, t) : nullptr, n,
                             mpi_type(t), mpi_op(op, t), r, comm_));
      });
  }
  void broadcast(void* buf, int64_t count, DType t, int root) override {
    progress_entered("broadcast", name());
    if (rank() == root) count_bytes(double(count * dtype_bytes(t)));
    in_pieces(count, [&](int64_t at, int n) {
      CHECK_MPI(MPI_Bcast(at_element(buf, at, t), n, mpi_type(t), root, comm_));
    });
  }
  void barrier() override {
    progress_entered("barrier", name());
    CHECK_MPI(MPI_Barrier(comm_));
  }
  std::unique_ptr<Comm> split(int color, int key, const std::string& name) override {
    MPI_Comm c;
    CHECK_MPI(MPI_Comm_split(comm_, color, key, &c));
    return std::make_unique<MpiComm>(c, name, true);
  }

 private:
  static int rank_of(MPI_Comm c) {
    int r = 0;
    CHECK_MPI(MPI_Comm_rank(c, &r));
    return r;
  }
  static int size_of(MPI_Comm c) {
    int s = 0;
    CHECK_MPI(MPI_Comm_size(c, &s));
    return s;
  }
  MPI_Comm comm_;
  bool owned_;
};

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

CommRuntime::CommRuntime(int* argc, char*** argv) {
  if (!launched_by_mpi()) {
    world_ = make_local_comm("world");
    return;
  }
  int provided = 0;
  CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
  ORIGAMI_CHECK(provided >= MPI_THREAD_FUNNELED, "the MPI library does not support MPI_THREAD_FUNNELED");
  mpi_ = true;
  CHECK_MPI(MPI_Op_create(&bf16_sum_fn, 1, &bf16_sum));
  world_ = std::make_unique<MpiComm>(MPI_COMM_WORLD, "world", false);
}

CommRuntime::~CommRuntime() {
  world_.reset();
  if (!mpi_) return;
  MPI_Op_free(&bf16_sum);
  progress_entered("MPI_Finalize", "world");  // (what a watchdog's message names if it stalls)
  MPI_Finalize();
}

void abort_job(int code) {
  progress_entered("MPI_Abort", "world");
  int started = 0, finished = 0;
  MPI_Initialized(&started);
  MPI_Finalized(&finished);
  if (started && !finished) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

int64_t mpi_transfers_in_pieces() { return transfers_in_pieces.load(); }

}  // namespace origami
