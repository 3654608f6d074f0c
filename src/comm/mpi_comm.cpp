// MPI implementation of Comm. Non-blocking collectives are MPI-3 (MPI_Iallreduce,
// MPI_Ireduce_scatter_block, MPI_Iallgather); MPI errors are returned, not fatal, and become
// origami::Error naming the call, the communicator and file:line.
#include "comm/mpi_comm.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
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
  for (int at = 0; at < *len; at += kChunk) {
    const int n = std::min(kChunk, *len - at);
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

class MpiRequest final : public Request::Impl {
 public:
  MPI_Request req = MPI_REQUEST_NULL;
  bool test() override {
    int done = 0;
    CHECK_MPI(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    return done != 0;
  }
  void wait() override { CHECK_MPI(MPI_Wait(&req, MPI_STATUS_IGNORE)); }
};

template <typename Start>
Request start(Start&& s) {
  auto r = std::make_unique<MpiRequest>();
  s(&r->req);
  return Request(std::move(r));
}

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
    return start([&](MPI_Request* r) {
      CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, mpi_count(count), mpi_type(t), mpi_op(op, t), comm_, r));
    });
  }
  Request ireduce_scatter(void* out, const void* in, int64_t count, DType t, ReduceOp op) override {
    progress_entered("reduce_scatter", name());
    count_scatter_gather(count, t);
    return start([&](MPI_Request* r) {
      CHECK_MPI(MPI_Ireduce_scatter_block(in == out ? MPI_IN_PLACE : in, out, mpi_count(count), mpi_type(t),
                                          mpi_op(op, t), comm_, r));
    });
  }
  Request iall_gather(void* out, const void* in, int64_t count, DType t) override {
    progress_entered("all_gather", name());
    count_scatter_gather(count, t);
    // In place when this rank's block already sits at its position in `out`.
    const bool in_place = in == static_cast<const char*>(out) + int64_t(rank()) * count * dtype_bytes(t);
    return start([&](MPI_Request* r) {
      CHECK_MPI(MPI_Iallgather(in_place ? MPI_IN_PLACE : in, mpi_count(count), mpi_type(t), out, mpi_count(count),
                               mpi_type(t), comm_, r));
    });
  }
  Request isend(const void* buf, int64_t count, DType t, int dest, int tag) override {
    progress_entered("send", name());
    count_bytes(double(count * dtype_bytes(t)));
    return start([&](MPI_Request* r) { CHECK_MPI(MPI_Isend(buf, mpi_count(count), mpi_type(t), dest, tag, comm_, r)); });
  }
  Request irecv(void* buf, int64_t count, DType t, int src, int tag) override {
    progress_entered("recv", name());
    return start([&](MPI_Request* r) { CHECK_MPI(MPI_Irecv(buf, mpi_count(count), mpi_type(t), src, tag, comm_, r)); });
  }
  void all_to_allv(void* out, const int64_t* recv_counts, const void* in, const int64_t* send_counts, DType t) override {
    progress_entered("all_to_all", name());
    const size_t n = size_t(size());
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    int64_t so = 0, ro = 0, others = 0;
    for (size_t r = 0; r < n; ++r) {
      sc[r] = mpi_count(send_counts[r]), sd[r] = mpi_count(so), so += send_counts[r];
      rc[r] = mpi_count(recv_counts[r]), rd[r] = mpi_count(ro), ro += recv_counts[r];
      if (int(r) != rank()) others += send_counts[r];
    }
    count_bytes(double(others * dtype_bytes(t)));
    CHECK_MPI(MPI_Alltoallv(in, sc.data(), sd.data(), mpi_type(t), out, rc.data(), rd.data(), mpi_type(t), comm_));
  }
  void all_gather_v(void* out, const void* in, const int64_t* counts, DType t) override {
    progress_entered("all_gather_v", name());
    count_gather_v(counts, t);
    std::vector<int> c(static_cast<size_t>(size())), d(static_cast<size_t>(size()));
    int64_t at = 0;
    for (size_t r = 0; r < c.size(); ++r) c[r] = mpi_count(counts[r]), d[r] = mpi_count(at), at += counts[r];
    const bool in_place = in == static_cast<const char*>(out) + d[size_t(rank())] * dtype_bytes(t);
    CHECK_MPI(MPI_Allgatherv(in_place ? MPI_IN_PLACE : in, c[size_t(rank())], mpi_type(t), out, c.data(), d.data(),
                             mpi_type(t), comm_));
  }
  void reduce_scatter_v(void* out, const void* in, const int64_t* counts, DType t, ReduceOp op) override {
    progress_entered("reduce_scatter_v", name());
    count_scatter_v(counts, t);
    std::vector<int> c(static_cast<size_t>(size()));
    int64_t total = 0;
    for (size_t r = 0; r < c.size(); ++r) c[r] = mpi_count(counts[r]), total += counts[r];
    mpi_count(total);  // displacements are ints too
    CHECK_MPI(MPI_Reduce_scatter(in, out, c.data(), mpi_type(t), mpi_op(op, t), comm_));
  }
  void broadcast(void* buf, int64_t count, DType t, int root) override {
    progress_entered("broadcast", name());
    if (rank() == root) count_bytes(double(count * dtype_bytes(t)));
    CHECK_MPI(MPI_Bcast(buf, mpi_count(count), mpi_type(t), root, comm_));
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
  MPI_Finalize();
}

void CommRuntime::abort(int code) {
  if (mpi_) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace origami
