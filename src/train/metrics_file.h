// Reading back the metrics file `origami train --metrics` writes (one JSON object per line), for the
// commands that read runs: `origami plot` (train/run_plot.h) and `origami plan --imbalance FILE`
// (plan/routing_skew.h).
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace origami {

struct MetricsRow {
  std::string where;  // "FILE:LINE" (the file's own line number), for messages
  nlohmann::json row;
};

// The file's rows, in order. Blank lines are skipped and a last line cut short (a killed run) is left
// out; Error naming the file when it is missing or unreadable, and naming the line when one is not a
// JSON object. (A file of no rows is returned empty: each reader says what it needed.)
std::vector<MetricsRow> read_metrics_rows(const std::string& path);

// A number of the row, NaN where it is null (a non-finite value, written as null); Error naming the
// line when the row lacks it or it is not a number.
double metrics_number(const MetricsRow& r, const char* key);

}  // namespace origami
