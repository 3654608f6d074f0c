// StopSignals (src/core/stop_signals.h): SIGTERM/SIGINT are recorded, not fatal, and never
// interrupt a GEMM — a storm of SIGTERMs aimed at every compute thread while oneDNN GEMMs run leaves
// the heap and the results intact (without the guard, oneDNN 2.x's JIT kernels let the signal frame
// land on the heap and glibc aborts with "corrupted size vs. prev_size").
#include <gtest/gtest.h>
#include <omp.h>
#include <pthread.h>

#include <atomic>
#include <csignal>
#include <thread>
#include <vector>

#include "core/stop_signals.h"
#include "kernels/cpu/gemm.h"

using namespace origami;

namespace {

void (*current_handler(int sig))(int) {
  struct sigaction sa{};
  sigaction(sig, nullptr, &sa);
  return sa.sa_handler;
}

}  // namespace

TEST(StopSignals, RecordsTheFirstSignalAndRestoresTheHandlers) {
  const auto before_term = current_handler(SIGTERM), before_int = current_handler(SIGINT);
  {
    StopSignals stop;
    EXPECT_EQ(stop.poll(), 0);
    raise(SIGTERM);  // blocked: stays pending until poll() takes it
    EXPECT_EQ(stop.poll(), SIGTERM);
    raise(SIGINT);
    EXPECT_EQ(stop.poll(), SIGTERM) << "the first signal is the one reported";
  }
  EXPECT_EQ(current_handler(SIGTERM), before_term);
  EXPECT_EQ(current_handler(SIGINT), before_int);
  StopSignals again;
  EXPECT_EQ(again.poll(), 0) << "a new guard starts clean";
}

TEST(StopSignals, ASignalStormDuringGemmsCorruptsNothing) {
  set_num_threads(2);
  StopSignals stop;
  std::vector<pthread_t> compute(2);  // the OpenMP pool's threads: the ones running the GEMMs
#pragma omp parallel num_threads(2)
  compute[size_t(omp_get_thread_num())] = pthread_self();
  std::atomic<bool> done{false};
  long sent = 0;
  std::thread storm([&] {  // created by a blocking thread: blocks them too, so it never takes one
    while (!done)
      for (pthread_t t : compute) pthread_kill(t, SIGTERM), ++sent;
  });
  const int64_t n = 384;  // shapes on oneDNN's JIT kernels
  std::vector<float> A(size_t(n * n), 0.5f), B(size_t(n * n), 0.25f), C(size_t(n * n));
  std::vector<std::vector<float>> heap;  // allocations kept between the GEMMs: heap the kernels could hit
  for (int rep = 0; rep < 300; ++rep) {
    heap.emplace_back(size_t(1000 + rep), 1.f);
    gemm<float>(false, rep % 2 == 1, n, n, n, 1.f, A.data(), n, B.data(), n, 0.f, C.data(), n);
    ASSERT_EQ(C[size_t(rep % (n * n))], float(n) * 0.125f) << "rep " << rep;
  }
  done = true;
  storm.join();
  EXPECT_GT(sent, 100);
  EXPECT_EQ(stop.poll(), SIGTERM);
}
