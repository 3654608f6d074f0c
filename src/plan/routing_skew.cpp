#include "plan/routing_skew.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "core/error.h"
#include "core/json_fields.h"
#include "train/metrics_file.h"

namespace origami {

double RoutingSkew::at(int64_t ep) const {
  if (ep <= 1) return 1.0;
  if (source.empty()) {
    const double most = experts > 0 ? double(ep) * double(std::min(top_k, experts / ep)) / double(top_k) : double(ep);
    return std::min(stated, most);
  }
  const auto it = by_ep.find(ep);
  ORIGAMI_CHECK(it != by_ep.end(), "--imbalance ", source, ": no figure for EP", ep, ", which does not divide the experts");
  return it->second;
}

std::string RoutingSkew::describe() const {
  char buf[32];
  if (source.empty()) {
    if (stated == 1) return "1 (even routing; --imbalance X or FILE prices a skew)";
    std::snprintf(buf, sizeof buf, "%.3g", stated);
    // Some EP degree d may price less: at most d·min(k, E/d)/k, all of a layer's rows its experts can get.
    return cat(buf, stated > 2 ? " (stated; EPd at most d·min(k, E/d)/k: every row its experts can get)" : " (stated)");
  }
  std::string s;
  for (const auto& [ep, x] : by_ep) {
    std::snprintf(buf, sizeof buf, "%.3f", x);
    s += cat(s.empty() ? "" : ", ", "EP", ep, " ", buf);
  }
  return cat(s, " (from ", source, ", median of ", steps, " step", steps == 1 ? "" : "s", ")");
}

double grouped_imbalance(const std::vector<std::vector<int64_t>>& tokens, int64_t ep) {
  double busiest = 0, mean = 0;
  for (const std::vector<int64_t>& layer : tokens) {
    const int64_t E = int64_t(layer.size()), local = E / ep;
    ORIGAMI_ASSERT(ep >= 1 && local * ep == E);
    double total = 0, most = 0;
    for (int64_t r = 0; r < ep; ++r) {
      double rows = 0;
      for (int64_t e = r * local; e < (r + 1) * local; ++e) rows += double(layer[size_t(e)]);
      total += rows, most = std::max(most, rows);
    }
    busiest += most, mean += total / double(ep);
  }
  ORIGAMI_ASSERT(mean > 0);
  return busiest / mean;
}

namespace {

// One row's expert_tokens, checked: [layers][experts] counts, some routed.
std::vector<std::vector<int64_t>> step_tokens(const MetricsRow& r, int64_t layers, int64_t experts) {
  const JsonField field = JsonField(r.row, r.where)["expert_tokens"];
  const size_t rows = field.array();
  ORIGAMI_CHECK(int64_t(rows) == layers, field.where(), ": ", rows, rows == 1 ? " layer" : " layers",
                ", where the model has ", layers, ": the metrics of a run of another model");
  std::vector<std::vector<int64_t>> tokens;
  int64_t routed = 0;
  field.for_each_element([&](const JsonField& layer) {
    tokens.push_back(layer.integers(0, std::numeric_limits<int32_t>::max()));
    ORIGAMI_CHECK(int64_t(tokens.back().size()) == experts, layer.where(), ": ", tokens.back().size(),
                  " experts, where the model has ", experts, ": the metrics of a run of another model");
    for (int64_t n : tokens.back()) routed += n;
  });
  ORIGAMI_CHECK(routed > 0, field.where(), ": no token routed to any expert");
  return tokens;
}

}  // namespace

RoutingSkew routing_skew_from_metrics(const std::string& path, int64_t layers, int64_t experts) {
  std::vector<std::vector<std::vector<int64_t>>> steps;
  for (const MetricsRow& r : read_metrics_rows(path))
    if (r.row.contains("expert_tokens")) steps.push_back(step_tokens(r, layers, experts));
  ORIGAMI_CHECK(!steps.empty(), "--imbalance ", path, ": no step has \"expert_tokens\" (the metrics file of an "
                "MoE run of 'origami train --metrics' has it on every step)");
  RoutingSkew skew;
  skew.source = path, skew.steps = int64_t(steps.size());
  for (int64_t ep = 2; ep <= experts; ++ep) {
    if (experts % ep != 0) continue;
    std::vector<double> x;
    for (const auto& tokens : steps) x.push_back(grouped_imbalance(tokens, ep));
    std::sort(x.begin(), x.end());
    const size_t n = x.size();
    skew.by_ep[ep] = n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
  }
  return skew;
}

}  // namespace origami
