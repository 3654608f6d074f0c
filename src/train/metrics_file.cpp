#include "train/metrics_file.h"

#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/files.h"

namespace origami {

std::vector<MetricsRow> read_metrics_rows(const std::string& path) {
  std::istringstream in(read_file_bytes(path));
  std::vector<std::pair<size_t, std::string>> lines;  // (line number, text) of the lines that are not blank
  size_t number = 0;
  for (std::string line; std::getline(in, line);)
    if (++number, line.find_first_not_of(" \t\r") != std::string::npos) lines.emplace_back(number, line);
  std::vector<MetricsRow> rows;
  for (size_t i = 0; i < lines.size(); ++i) {
    MetricsRow r{cat(path, ":", lines[i].first), nlohmann::json::parse(lines[i].second, nullptr, false)};
    if (r.row.is_discarded() && i + 1 == lines.size()) break;  // a killed run's last line, cut short
    ORIGAMI_CHECK(r.row.is_object(), r.where, " is not a JSON object: not a metrics file of origami train");
    rows.push_back(std::move(r));
  }
  return rows;
}

double metrics_number(const MetricsRow& r, const char* key) {
  ORIGAMI_CHECK(r.row.contains(key), r.where, " has no \"", key, "\": not a metrics row of origami train");
  const nlohmann::json& v = r.row[key];
  if (v.is_null()) return std::numeric_limits<double>::quiet_NaN();
  ORIGAMI_CHECK(v.is_number(), r.where, ": \"", key, "\" is not a number");
  return v.get<double>();
}

}  // namespace origami
