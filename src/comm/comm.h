// The communicator interface: the collectives and point-to-point transfers every parallel
// feature uses, over one group of ranks. Implementations: MPI (comm/mpi_comm.cpp, CPU clusters)
// and a one-rank local communicator (no MPI needed); an NCCL one can be added behind the same
// interface without touching callers.
//
// Buffers are typed by DType; counts are elements. Every call adds to bytes_sent() the bytes this
// rank sends under the bandwidth-optimal (ring / pairwise) algorithm, so reported traffic can be
// checked exactly against analytic formulas whatever the MPI library does internally:
//   all_reduce           2·(n−1)/n · S      (S = bytes of the buffer)
//   reduce_scatter       (n−1)/n · S        (S = bytes of the full input, n·count)
//   all_gather           (n−1)/n · S        (S = bytes of the full output, n·count)
//   all_to_all(v)        bytes addressed to the other ranks
//   all_gather_v         (n−1) · own block      (pairwise: each rank sends its block to every other)
//   reduce_scatter_v     S − own block          (pairwise: each rank sends every other rank its block)
//   broadcast            S at the root, 0 elsewhere
//   send                 S
#pragma once
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace origami {

// bf16: 16-bit values (kernels/cpu/bf16.h), sums only: each partial sum is widened, added in fp32 and
// rounded back to bf16 (as NCCL sums bf16), so an n-rank sum rounds up to n−1 times.
enum class DType { f32, f64, i32, i64, bf16 };
enum class ReduceOp { sum, max };
int64_t dtype_bytes(DType t);

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }

// A pending non-blocking operation. wait() blocks until done; test() makes progress and says
// whether it is done. Destroying an unfinished request waits for it (buffers must outlive it), except
// when an exception thrown since it was made unwinds its scope: then it is abandoned (the error ends
// the job: comm.cpp, run_training).
class Request {
 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual bool test() = 0;
    virtual void wait() = 0;
  };
  Request() = default;
  explicit Request(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Request(Request&&) = default;
  Request& operator=(Request&& o) noexcept;
  ~Request();
  bool test();
  void wait();
  bool pending() const { return impl_ != nullptr; }

 private:
  std::unique_ptr<Impl> impl_;
  int unwinding_ = std::uncaught_exceptions();  // exceptions already in flight where it was made
};

// The accounting of the table above as functions of the sizes (Comm counts with them, and the planner
// predicts with them, train/comm_volume.h): the bytes one of n ranks sends in an all-reduce of a buffer
// of `bytes`, and in an all-gather or reduce-scatter whose per-rank block is `block_bytes`.
inline double all_reduce_bytes(int n, double bytes) { return 2.0 * (n - 1) / n * bytes; }
inline double scatter_gather_bytes(int n, double block_bytes) { return double(n - 1) * block_bytes; }

class Comm {
 public:
  virtual ~Comm() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The mesh axis (or axis group) this communicator spans, e.g. "tp", "dp", "world".
  const std::string& name() const { return name_; }
  double bytes_sent() const { return bytes_sent_; }
  void reset_bytes() { bytes_sent_ = 0; }

  // In place: buf[count] becomes the reduction over all ranks.
  virtual Request iall_reduce(void* buf, int64_t count, DType t, ReduceOp op) = 0;
  // in[n·count] (rank-major blocks) → out[count] = reduction of every rank's block `rank()`; in place
  // when out == in: the result lands in the buffer's first `count` elements (MPI_IN_PLACE's rule).
  virtual Request ireduce_scatter(void* out, const void* in, int64_t count, DType t, ReduceOp op) = 0;
  // in[count] → out[n·count], rank r's block at r·count (in place when in == out + rank()·count).
  virtual Request iall_gather(void* out, const void* in, int64_t count, DType t) = 0;
  virtual Request isend(const void* buf, int64_t count, DType t, int dest, int tag) = 0;
  virtual Request irecv(void* buf, int64_t count, DType t, int src, int tag) = 0;
  // in: blocks for rank 0, 1, ... of send_counts[r] elements; out: blocks from each rank of recv_counts[r].
  virtual void all_to_allv(void* out, const int64_t* recv_counts, const void* in, const int64_t* send_counts,
                           DType t) = 0;
  // Variable-size blocks (message sizes known only at run time, e.g. the MoE token dispatcher):
  // counts[r] elements from rank r. out receives every rank's block in rank order; in is this
  // rank's block (in place when in == out + its block's offset).
  virtual void all_gather_v(void* out, const void* in, const int64_t* counts, DType t) = 0;
  // in: one block per rank, counts[r] elements, rank-major; out[counts[rank()]] = reduction of
  // every rank's block rank().
  virtual void reduce_scatter_v(void* out, const void* in, const int64_t* counts, DType t, ReduceOp op) = 0;
  virtual void broadcast(void* buf, int64_t count, DType t, int root) = 0;
  virtual void barrier() = 0;
  // Collective over this communicator: ranks with the same color form a new communicator, ordered by key.
  virtual std::unique_ptr<Comm> split(int color, int key, const std::string& name) = 0;

  // Blocking forms.
  void all_reduce(void* buf, int64_t count, DType t, ReduceOp op = ReduceOp::sum) { iall_reduce(buf, count, t, op).wait(); }
  void reduce_scatter(void* out, const void* in, int64_t count, DType t, ReduceOp op = ReduceOp::sum) {
    ireduce_scatter(out, in, count, t, op).wait();
  }
  void all_gather(void* out, const void* in, int64_t count, DType t) { iall_gather(out, in, count, t).wait(); }
  void all_to_all(void* out, const void* in, int64_t count, DType t);
  void send(const void* buf, int64_t count, DType t, int dest, int tag) { isend(buf, count, t, dest, tag).wait(); }
  void recv(void* buf, int64_t count, DType t, int src, int tag) { irecv(buf, count, t, src, tag).wait(); }

  // Typed conveniences.
  template <typename T> void all_reduce(T* buf, int64_t count, ReduceOp op = ReduceOp::sum) {
    all_reduce(static_cast<void*>(buf), count, dtype_of<T>(), op);
  }
  template <typename T> T all_reduce_value(T v, ReduceOp op = ReduceOp::sum) {
    all_reduce(&v, 1, op);
    return v;
  }

 protected:
  Comm(int rank, int size, std::string name) : rank_(rank), size_(size), name_(std::move(name)) {}
  // Byte accounting shared by all implementations (see the table at the top of this file).
  void count_all_reduce(int64_t count, DType t) { bytes_sent_ += all_reduce_bytes(size_, double(count * dtype_bytes(t))); }
  void count_scatter_gather(int64_t count, DType t) {
    bytes_sent_ += scatter_gather_bytes(size_, double(count * dtype_bytes(t)));
  }
  void count_bytes(double b) { bytes_sent_ += b; }
  void count_gather_v(const int64_t* counts, DType t) {
    bytes_sent_ += double(size_ - 1) * double(counts[rank_] * dtype_bytes(t));
  }
  void count_scatter_v(const int64_t* counts, DType t) {
    int64_t others = 0;
    for (int r = 0; r < size_; ++r) others += r == rank_ ? 0 : counts[r];
    bytes_sent_ += double(others * dtype_bytes(t));
  }

 private:
  int rank_, size_;
  std::string name_;
  double bytes_sent_ = 0;
};

// Runs fn on every rank of `world` (fn must not communicate). If it throws Error on any rank, the
// lowest such rank prints "origami <command>: error: <message>" — one message for the whole job —
// and every rank throws ErrorReported, so all exit non-zero together instead of some hanging.
void check_on_every_rank(Comm& world, const std::string& command, const std::function<void()>& fn);

// The one-rank communicator: every collective is a copy or nothing. Used when origami runs without mpirun.
std::unique_ptr<Comm> make_local_comm(const std::string& name = "world");

}  // namespace origami
