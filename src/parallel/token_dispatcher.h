// Token dispatcher for routed experts (Megatron-Core's all-to-all dispatcher, written here): moves
// the rows a rank routed to the ranks that hold their experts, and the experts' outputs back. It is
// the one place that knows how experts are laid out; the MoE layer's math is the same on any layout.
//
// MoE mesh (MoE parallel folding, see mesh.h): the E experts are split over EP ranks, El = E/EP
// whole experts each ("local experts", global indices [ep_rank·El, (ep_rank+1)·El)), and each
// expert's FFN is split over ETP ranks (column-parallel w1|w3, row-parallel w2). A rank's routed
// rows come from its own share of the tokens, sorted by expert (so by destination EP rank).
//
//   to_experts    all-to-all-v over EP (the rows for expert e go to EP rank e / El)
//                 → all-gather-v over ETP (every ETP peer runs its FFN slice on every row any peer received)
//                 → regroup [ETP peer b][EP source a][local expert j] → [j][b][a]: one block per expert
//   from_experts  the reverse: ungroup → reduce-scatter-v over ETP (sums the slices' partial outputs,
//                 each peer keeps the rows it received) → all-to-all-v back over EP
//
// from_experts is the adjoint of to_experts, so backward runs the same two calls, on gradients, in
// the other order. Message sizes are known only at run time: plan() exchanges the per-expert row
// counts first (all-to-all over EP, all-gather over ETP); nothing assumes balance. Without expert
// parallelism the communicators have one rank and the exchanges are copies.
//
// `tokens` is the group of ranks that share one micro-batch's tokens (TP×CP): the router's
// load-balancing statistics f_e are counted over all of them (global_counts). `replicas` is the
// attention mesh's data-parallel group: with `tokens` it spans the pipeline stage, over which the
// global-batch balance counts (replica_counts).
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm.h"

namespace origami {

// The exchange of one MoE call, made by plan() from this rank's routed counts; kept for backward.
struct DispatchPlan {
  std::vector<int64_t> send;         // [EP] rows this rank sends to each EP rank
  std::vector<int64_t> counts;       // [ETP][EP][El] rows ETP peer b received from EP rank a for local expert j
  std::vector<int64_t> expert_rows;  // [El] expert-side rows of each local expert (Σ over b, a)
  int64_t rows = 0;                  // expert-side rows in all (Σ counts)
};

// Where an MoE layer's time goes, summed over calls until reset (the dispatcher-overhead figure of the
// metrics): the exchanges themselves (counts, all-to-all-v, ETP gather / reduce-scatter), the
// dispatcher's regrouping of rows between source and expert order, and the layer's permute and
// weighted combine (with their backward), which moe.cpp adds.
struct DispatchTimes {
  double exchange_s = 0, regroup_s = 0, permute_s = 0;
};

// Work buffers of the exchanges (kept by the caller across calls, sized for the worst case up front).
template <typename T>
struct DispatchBuffers {
  std::vector<T> gathered;  // [rows, C] in [b][a][j] order
  std::vector<T> mine;      // ETP > 1: this peer's reduce-scattered rows
};

class TokenDispatcher {
 public:
  TokenDispatcher();  // one rank: every expert local, every exchange a copy
  TokenDispatcher(Comm& tokens, Comm& replicas, Comm& ep, Comm& etp);

  int ep() const { return ep_->size(); }
  int etp() const { return etp_->size(); }
  // EP = ETP = 1: this rank holds every expert, and its permuted rows are already the expert-side
  // rows in their order (both calls below would only copy them): the layer skips the calls.
  bool holds_every_expert() const { return ep() == 1 && etp() == 1; }
  int etp_rank() const { return etp_->rank(); }
  int64_t local_experts(int64_t E) const { return E / ep_->size(); }
  int64_t first_expert(int64_t E) const { return ep_->rank() * local_experts(E); }
  int64_t token_ranks() const { return tokens_->size(); }
  Comm& token_group() const { return *tokens_; }
  int64_t replicas() const { return replicas_->size(); }
  DispatchTimes& times() { return times_; }
  // Most expert-side rows one call can bring to a rank (any imbalance), when every rank routes n
  // tokens to K experts each: dropless, a token sends at most min(K, El) rows to one EP rank, and
  // the rank serves the tokens of EP sources times ETP peers; with a capacity `cap` (0: none) each
  // source sends at most cap rows per expert (exactly cap when padded).
  static int64_t max_rows(int64_t n, int64_t K, int64_t E, int ep, int etp, int64_t cap = 0, bool pad = false);

  // counts [n]: this rank's counts → their sum over the token group (in place).
  void global_counts(int64_t* counts, int64_t n);
  // counts [n]: the token group's counts → their sum over the data-parallel replicas (in place).
  void replica_counts(int64_t* counts, int64_t n);
  // count_E [E]: this rank's rows per expert (its rows are sorted by expert) → the exchange.
  void plan(DispatchPlan& p, const int64_t* count_E, int64_t E);
  // rows [calls]: this rank's expert-side rows at each of its calls, in the order every EP peer made
  // them → Σ over the calls of the EP group's most rows (each call's exchanges wait for its busiest
  // rank). One all-reduce (max) over EP.
  int64_t busiest_rows(std::vector<int64_t> rows);
  // in [Σ send, C]: this rank's rows sorted by expert → out [rows, C] grouped by local expert.
  template <typename T>
  void to_experts(T* out, const T* in, const DispatchPlan& p, int64_t C, DispatchBuffers<T>& buf);
  // in [rows, C] grouped by local expert (partial sums over ETP) → out [Σ send, C]: this rank's rows,
  // sorted by expert, each the sum of its ETP slices.
  template <typename T>
  void from_experts(T* out, const T* in, const DispatchPlan& p, int64_t C, DispatchBuffers<T>& buf);

 private:
  // Element counts of the exchanges: per ETP peer (its rows of the gathered buffer), per EP rank
  // sent and received by this rank, and where this peer's rows start in the gathered buffer.
  struct Counts {
    std::vector<int64_t> peer, send, recv;
    int64_t mine = 0;
  };
  Counts counts(const DispatchPlan& p, int64_t C) const;
  // Rows of [b][a][j] order → [j][b][a] (forward) or back.
  template <typename T>
  void regroup(T* out, const T* in, const DispatchPlan& p, int64_t C, bool to_expert_order) const;
  Comm *tokens_, *replicas_, *ep_, *etp_;
  DispatchTimes times_;
};

}  // namespace origami
