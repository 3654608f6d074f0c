#include "core/stop_signals.h"

#include <omp.h>
#include <pthread.h>

#include <atomic>
#include <ctime>

namespace origami {

namespace {

std::atomic<int> g_signal{0};

void record(int sig) {
  int none = 0;
  g_signal.compare_exchange_strong(none, sig);  // keep the first
}

sigset_t stop_set() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGINT);
  sigaddset(&s, SIGTERM);
  return s;
}

// Applies `how` to SIGINT/SIGTERM in this thread and in every thread of the OpenMP pool (the
// pool's threads persist between parallel regions; threads it adds later are created by this
// thread and inherit its mask).
void mask_everywhere(int how) {
  const sigset_t s = stop_set();
  pthread_sigmask(how, &s, nullptr);
#pragma omp parallel
  pthread_sigmask(how, &s, nullptr);
}

}  // namespace

StopSignals::StopSignals() {
  g_signal = 0;
  struct sigaction sa{};
  sa.sa_handler = record;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
  mask_everywhere(SIG_BLOCK);
}

StopSignals::~StopSignals() {
  mask_everywhere(SIG_UNBLOCK);  // a pending signal is delivered now, to `record`
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

int StopSignals::poll() {
  const sigset_t s = stop_set();
  const timespec now{0, 0};
  siginfo_t info;
  const int sig = sigtimedwait(&s, &info, &now);  // a pending SIGINT/SIGTERM, without waiting
  if (sig > 0) record(sig);
  return g_signal;
}

}  // namespace origami
