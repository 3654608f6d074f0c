// The process's communication runtime: MPI when the process was started by an MPI launcher
// (mpirun / mpiexec / srun set their rank variables), otherwise one local rank without MPI.
#pragma once
#include <memory>

#include "comm/comm.h"

namespace origami {

class CommRuntime {
 public:
  // Starts MPI (MPI_THREAD_FUNNELED: only the main thread communicates; OpenMP threads compute).
  CommRuntime(int* argc, char*** argv);
  ~CommRuntime();  // MPI_Finalize
  CommRuntime(const CommRuntime&) = delete;
  CommRuntime& operator=(const CommRuntime&) = delete;

  Comm& world() { return *world_; }
  bool distributed() const { return mpi_; }

 private:
  bool mpi_ = false;
  std::unique_ptr<Comm> world_;
};

// Ends every rank of the job with `code` (MPI_Abort where MPI runs; else this process's exit); used when
// one rank fails on its own.
[[noreturn]] void abort_job(int code);

// True when an MPI launcher started this process.
bool launched_by_mpi();

// Since start: this process's transfers past MPI's int count limit (max_count(): INT_MAX, or
// ORIGAMI_TEST_MPI_MAX_COUNT) that went in pieces or in units of their counts' gcd.
int64_t mpi_transfers_in_pieces();

}  // namespace origami
