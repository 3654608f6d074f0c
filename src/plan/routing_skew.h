// The routing imbalance the planner prices an EP layout at (CostModel): the busiest EP rank's routed
// rows over the EP group's mean, call by call, which is what a run's `expert_sync_imbalance` measures.
// It is either stated (`plan --imbalance X`, every EP degree alike) or derived from a run's routing
// (`plan --imbalance FILE`: the experts' token counts of a metrics file, grouped as each EP degree
// places them).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace origami {

struct RoutingSkew {
  double stated = 1;                // --imbalance X
  std::map<int64_t, double> by_ep;  // --imbalance FILE: each EP degree above 1 that divides the experts
  std::string source;               // that file (empty: stated)
  int64_t steps = 0;                // the file's steps the figures are the median of
  int64_t experts = 0, top_k = 1;   // the model's E and k (0: not known; a stated figure is then capped at ep)

  // 1 at EP1 (one rank holds every expert: no rank waits for another's rows); a stated figure at most
  // ep·min(k, E/ep)/k: a rank's E/ep experts get at most min(k, E/ep) of a token's k assignments.
  double at(int64_t ep) const;
  std::string describe() const;  // "1.25 (stated)", "1 (even routing)" or "EP2 1.31, EP4 1.94 (from FILE, ...)"
};

// One step's figure at EP degree ep. tokens[l][e]: the assignments routed to expert e in MoE layer l
// (a run's `expert_tokens`); EP rank r holds experts [r·E/ep, (r+1)·E/ep) (TokenDispatcher::first_expert).
// Each layer's exchange waits for its busiest rank: Σ_l max_r rows(l, r) / Σ_l mean_r rows(l, r).
// ep must divide every layer's expert count, and some layer must have routed tokens.
double grouped_imbalance(const std::vector<std::vector<int64_t>>& tokens, int64_t ep);

// From a metrics file of an MoE run (any layout: `expert_tokens` counts the whole step): for each EP
// degree above 1 that divides `experts`, the median over the file's steps of grouped_imbalance. With
// several micro-batches a step, call by call the figure is higher than from the step's totals by the
// calls' own spread. Error naming the file (or its line) when no step has `expert_tokens`, when a step
// routed no tokens, or when a step's layer or expert count is not `layers` and `experts` (a run of
// another model).
RoutingSkew routing_skew_from_metrics(const std::string& path, int64_t layers, int64_t experts);

}  // namespace origami
