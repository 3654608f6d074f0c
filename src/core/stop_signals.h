// A clean stop on SIGINT / SIGTERM for a training loop, without letting either signal interrupt
// the compute threads.
//
// Why the signals are blocked rather than simply handled: oneDNN 2.x's JIT f32 GEMM kernels (the
// ones src/kernels/cpu/gemm.cpp calls) point the stack pointer into a heap buffer while they run,
// so a signal delivered to a thread inside one pushes its frame onto the heap and corrupts it
// (uxlfoundation/oneDNN#4845, fixed upstream in 3.x; observed here as "corrupted size vs.
// prev_size" aborts after a SIGTERM). So while a StopSignals lives, SIGINT and SIGTERM are blocked
// in the constructing thread and in every thread of the OpenMP pool (which also runs oneDNN and
// OpenBLAS), and are taken synchronously by poll() at a step boundary. A thread that does not block
// them (MPI's progress threads) may still receive one: the handler installed here only records it.
#pragma once
#include <csignal>

namespace origami {

class StopSignals {
 public:
  StopSignals();   // install the recording handler, block SIGINT/SIGTERM here and in the OpenMP pool
  ~StopSignals();  // unblock (a signal still pending is recorded), restore the previous handlers
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first SIGINT/SIGTERM received since construction (0 if none); takes a pending one.
  int poll();

 private:
  struct sigaction old_int_{}, old_term_{};
};

}  // namespace origami
