#include "parallel/token_dispatcher.h"

#include <algorithm>
#include <cstring>

#include "core/checked.h"
#include "core/error.h"
#include "core/timer.h"

namespace origami {

namespace {

Comm& local_comm() {
  static std::unique_ptr<Comm> c = make_local_comm("local");
  return *c;
}

// Grows a work buffer to n elements (never shrinks it: buffers are sized once for the worst case).
template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
  return v.data();
}

}  // namespace

TokenDispatcher::TokenDispatcher()
    : tokens_(&local_comm()), replicas_(&local_comm()), ep_(&local_comm()), etp_(&local_comm()) {}
TokenDispatcher::TokenDispatcher(Comm& tokens, Comm& replicas, Comm& ep, Comm& etp)
    : tokens_(&tokens), replicas_(&replicas), ep_(&ep), etp_(&etp) {}

int64_t TokenDispatcher::max_rows(int64_t n, int64_t K, int64_t E, int ep, int etp, int64_t cap, bool pad) {
  const Size dropless = Size(std::min(K, E / ep)) * n * ep * etp;  // checked (core/checked.h)
  if (cap == 0) return dropless.get();
  const Size capped = Size(E / ep) * cap * ep * etp;
  return (pad ? capped : std::min(dropless, capped)).get();
}

void TokenDispatcher::global_counts(int64_t* counts, int64_t n) { tokens_->all_reduce(counts, n); }

void TokenDispatcher::replica_counts(int64_t* counts, int64_t n) { replicas_->all_reduce(counts, n); }

void TokenDispatcher::plan(DispatchPlan& p, const int64_t* count_E, int64_t E) {
  const Stopwatch watch(times_.exchange_s);
  const int64_t EP = ep(), ETP = etp(), El = local_experts(E);
  p.send.assign(size_t(EP), 0);
  for (int64_t a = 0; a < EP; ++a)
    for (int64_t j = 0; j < El; ++j) p.send[size_t(a)] += count_E[a * El + j];
  // count_E is already rank-major blocks of El (experts are numbered EP rank by EP rank).
  std::vector<int64_t> received(size_t(EP * El));
  ep_->all_to_all(received.data(), count_E, El, DType::i64);
  p.counts.resize(size_t(ETP * EP * El));
  etp_->all_gather(p.counts.data(), received.data(), EP * El, DType::i64);
  p.expert_rows.assign(size_t(El), 0);
  p.rows = 0;
  for (size_t i = 0; i < p.counts.size(); ++i) p.expert_rows[i % size_t(El)] += p.counts[i], p.rows += p.counts[i];
}

int64_t TokenDispatcher::busiest_rows(std::vector<int64_t> rows) {
  ep_->all_reduce(rows.data(), int64_t(rows.size()), ReduceOp::max);
  int64_t sum = 0;
  for (int64_t r : rows) sum += r;
  return sum;
}

template <typename T>
void TokenDispatcher::regroup(T* out, const T* in, const DispatchPlan& p, int64_t C, bool to_expert_order) const {
  const int64_t EP = ep(), ETP = etp(), El = int64_t(p.expert_rows.size());
  struct Block {
    int64_t grouped, expert_major, rows;  // row offsets in [b][a][j] and [j][b][a] order
  };
  std::vector<Block> blocks(p.counts.size());
  int64_t at = 0;
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i].grouped = at, blocks[i].rows = p.counts[i], at += p.counts[i];
  at = 0;
  for (int64_t j = 0; j < El; ++j)
    for (int64_t b = 0; b < ETP; ++b)
      for (int64_t a = 0; a < EP; ++a) {
        Block& k = blocks[size_t((b * EP + a) * El + j)];
        k.expert_major = at, at += k.rows;
      }
#pragma omp parallel for schedule(dynamic)
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& k = blocks[i];
    const int64_t from = to_expert_order ? k.grouped : k.expert_major, to = to_expert_order ? k.expert_major : k.grouped;
    if (k.rows > 0) std::memcpy(out + to * C, in + from * C, size_t(k.rows * C) * sizeof(T));
  }
}

TokenDispatcher::Counts TokenDispatcher::counts(const DispatchPlan& p, int64_t C) const {
  const int64_t EP = ep(), ETP = etp(), me = etp_rank(), El = int64_t(p.expert_rows.size());
  Counts n{std::vector<int64_t>(size_t(ETP), 0), std::vector<int64_t>(size_t(EP)), std::vector<int64_t>(size_t(EP), 0)};
  for (int64_t i = 0; i < int64_t(p.counts.size()); ++i) n.peer[size_t(i / (EP * El))] += p.counts[size_t(i)] * C;
  for (int64_t s = 0; s < EP; ++s) {
    n.send[size_t(s)] = p.send[size_t(s)] * C;
    for (int64_t j = 0; j < El; ++j) n.recv[size_t(s)] += p.counts[size_t((me * EP + s) * El + j)] * C;
  }
  for (int64_t b = 0; b < me; ++b) n.mine += n.peer[size_t(b)];
  return n;
}

template <typename T>
void TokenDispatcher::to_experts(T* out, const T* in, const DispatchPlan& p, int64_t C, DispatchBuffers<T>& buf) {
  const Counts n = counts(p, C);
  // The all-to-all lands this peer's rows at its place in the gathered buffer; the all-gather fills
  // in the other peers' rows around them (in place).
  T* gathered = at_least(buf.gathered, p.rows * C);
  {
    const Stopwatch watch(times_.exchange_s);
    ep_->all_to_allv(gathered + n.mine, n.recv.data(), in, n.send.data(), dtype_of<T>());
    etp_->all_gather_v(gathered, gathered + n.mine, n.peer.data(), dtype_of<T>());
  }
  const Stopwatch watch(times_.regroup_s);
  regroup(out, gathered, p, C, true);
}

template <typename T>
void TokenDispatcher::from_experts(T* out, const T* in, const DispatchPlan& p, int64_t C, DispatchBuffers<T>& buf) {
  const Counts n = counts(p, C);
  T* gathered = at_least(buf.gathered, p.rows * C);
  {
    const Stopwatch watch(times_.regroup_s);
    regroup(gathered, in, p, C, false);
  }
  const Stopwatch watch(times_.exchange_s);
  const T* mine = gathered;  // one ETP rank: its rows are the whole buffer, already complete
  if (etp() > 1) {
    T* sum = at_least(buf.mine, n.peer[size_t(etp_rank())]);
    etp_->reduce_scatter_v(sum, gathered, n.peer.data(), dtype_of<T>(), ReduceOp::sum);
    mine = sum;
  }
  ep_->all_to_allv(out, n.send.data(), mine, n.recv.data(), dtype_of<T>());
}

#define INSTANTIATE(T)                                                                                              \
  template void TokenDispatcher::to_experts<T>(T*, const T*, const DispatchPlan&, int64_t, DispatchBuffers<T>&); \
  template void TokenDispatcher::from_experts<T>(T*, const T*, const DispatchPlan&, int64_t, DispatchBuffers<T>&);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
