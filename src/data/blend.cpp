#include "data/blend.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "core/json_fields.h"

namespace origami {

std::vector<BlendPart> parse_blend(std::string_view spec, std::string_view option) {
  std::vector<std::string> fields;
  std::istringstream in{std::string(spec)};
  for (std::string f; in >> f;) fields.push_back(f);
  ORIGAMI_CHECK(!fields.empty(), option, " is empty: give PREFIX or \"W1 PREFIX1 W2 PREFIX2 ...\"");
  if (fields.size() == 1) return {{1.0, fields[0]}};
  if (std::filesystem::exists(std::string(spec) + ".idx")) return {{1.0, std::string(spec)}};
  ORIGAMI_CHECK(fields.size() % 2 == 0, option, " \"", spec, "\" has ", fields.size(),
                " fields: a blend is weights and prefixes in turn (\"W1 PREFIX1 W2 PREFIX2 ...\")");
  std::vector<BlendPart> parts;
  std::map<std::string, std::string> seen;  // the .bin's path, resolved (links too) -> the prefix as given
  double total = 0, most = 0;
  for (size_t k = 0; k < fields.size(); k += 2) {
    double w = 0;
    size_t used = 0;
    try {
      w = std::stod(fields[k], &used);
    } catch (const std::exception&) {
      used = 0;
    }
    ORIGAMI_CHECK(used == fields[k].size() && std::isfinite(w) && w > 0, option, ": weight '", fields[k],
                  "' (before '", fields[k + 1], "') must be a positive number; a blend is \"W1 PREFIX1 W2 PREFIX2 ...\"");
    std::error_code ec;
    const std::string file = std::filesystem::weakly_canonical(std::filesystem::absolute(fields[k + 1] + ".bin"), ec).string();
    const auto [at, fresh] = seen.emplace(ec ? fields[k + 1] : file, fields[k + 1]);
    ORIGAMI_CHECK(fresh, option, ": dataset '", fields[k + 1], "' is given twice",
                  at->second == fields[k + 1] ? "" : cat(" (also as '", at->second, "')"),
                  "; give it once with the sum of its weights");
    parts.push_back({w, fields[k + 1]});
    total += w, most = std::max(most, w);
  }
  // Weights near the largest double ("1e308 A 1e308 B") sum to infinity: then scaled by the largest first.
  const double scale = std::isfinite(total) ? 1.0 : most;
  if (scale != 1.0) {
    total = 0;
    for (const BlendPart& p : parts) total += p.weight / scale;
  }
  for (BlendPart& p : parts) p.weight = p.weight / scale / total;
  return parts;
}

BlendRule::BlendRule(std::vector<double> weights) : weights_(std::move(weights)), given_(weights_.size(), 0) {
  double total = 0;
  for (double w : weights_) total += w;
  for (double& w : weights_) w /= total;
}

int BlendRule::choose() const {
  const double due = double(taken_ + 1);
  int best = 0;
  double best_error = weights_[0] * due - double(given_[0]);
  for (size_t d = 1; d < weights_.size(); ++d) {
    const double error = weights_[d] * due - double(given_[d]);
    if (error > best_error) best = int(d), best_error = error;  // strict: the first on ties
  }
  return best;
}

BlendChoice BlendRule::next() {
  const int d = choose();
  const BlendChoice c{d, given_[size_t(d)]};
  take(d, 1);
  return c;
}

namespace {
std::vector<double> weights_of(const std::vector<BlendPart>& parts) {
  std::vector<double> w;
  for (const BlendPart& p : parts) w.push_back(p.weight);
  return w;
}
}  // namespace

DataBlend::DataBlend(const std::vector<BlendPart>& parts, int64_t seq_len, SampleOrder order, uint64_t seed,
                     std::string_view option)
    : parts_(parts), seq_len_(seq_len), rule_(weights_of(parts)) {
  ORIGAMI_ASSERT(!parts.empty());
  for (size_t d = 0; d < parts.size(); ++d) {
    const std::string& prefix = parts[d].prefix;
    datasets_.push_back(std::make_unique<IndexedDataset>(IndexedDataset::open(prefix)));
    if (seq_len > 0) samplers_.push_back(std::make_unique<WindowSampler>(*datasets_.back(), seq_len, order, seed));
    const std::string tok = prefix + ".tokenizer.json";
    const bool has = std::filesystem::exists(tok);
    std::string bytes = has ? read_file_bytes(tok) : std::string();
    nlohmann::json j = has ? parse_json(bytes, tok) : nlohmann::json();
    if (d == 0) {
      tokenizer_path_ = has ? tok : "", tokenizer_ = std::move(j), tokenizer_bytes_ = std::move(bytes);
      continue;
    }
    ORIGAMI_CHECK(j == tokenizer_, option, ": datasets '", parts[0].prefix, "' and '", prefix,
                  "' were made with different tokenizers (", tokenizer_path_.empty() ? "none" : tokenizer_path_, " vs ",
                  has ? tok : "none", "); all datasets of a blend must share one");
  }
}

uint64_t DataBlend::num_tokens() const {
  uint64_t n = 0;
  for (const auto& d : datasets_) n += d->num_tokens();
  return n;
}

int64_t DataBlend::num_windows() const {
  int64_t n = 0;
  for (const auto& s : samplers_) n += s->num_windows();
  return n;
}

std::string DataBlend::describe() const {
  ORIGAMI_ASSERT(samplers_.size() == parts_.size());  // (windows)
  std::string out;
  for (size_t d = 0; d < parts_.size(); ++d) {
    if (d > 0) out += " + ";
    if (parts_.size() > 1) out += cat(parts_[d].weight, " ");
    out += cat(parts_[d].prefix, ": ", datasets_[d]->num_tokens(), " tokens, ", samplers_[d]->num_windows(),
               " windows of ", seq_len_);
  }
  return out;
}

std::vector<std::string> DataBlend::shared_datasets(const DataBlend& other) const {
  std::vector<std::string> out;
  for (const BlendPart& o : other.parts())
    for (const BlendPart& p : parts_) {
      std::error_code ec;  // (both opened: an error here would be a file gone since)
      if (std::filesystem::equivalent(o.prefix + ".bin", p.prefix + ".bin", ec)) {
        out.push_back(o.prefix);
        break;
      }
    }
  return out;
}

void DataBlend::require_same_tokenizer(const DataBlend& other, const std::string& what) const {
  ORIGAMI_CHECK(tokenizer_ == other.tokenizer_, what, " were made with different tokenizers (",
                tokenizer_path_.empty() ? "none" : tokenizer_path_, " vs ",
                other.tokenizer_path_.empty() ? "none" : other.tokenizer_path_, ")");
}

int64_t DataBlend::bytes(int64_t span) const {
  int64_t n = parts_.size() > 1 ? span * int64_t(sizeof(BlendChoice)) : 0;
  for (const auto& s : samplers_) n += s->bytes();
  return n;
}

void DataBlend::require_no_repeat(int64_t n, const std::string& what) const {
  ORIGAMI_CHECK(n <= num_windows(), what, " reads ", n, " windows of length ", seq_len_, " but the data has ",
                num_windows(), "; ", describe());
  BlendRule rule(weights_of(parts_));
  while (rule.samples() < n) rule.next();
  for (size_t d = 0; d < parts_.size(); ++d)
    ORIGAMI_CHECK(rule.given()[d] <= windows(d), what, " reads ", n, " windows, ", rule.given()[d], " of them from '",
                  parts_[d].prefix, "', which has only ", windows(d), " of length ", seq_len_);
}

void DataBlend::cover(int64_t first, int64_t n) {
  if (first < first_) {  // back before the kept choices: replay the rule from the start
    rule_.restart();
    first_ = 0;
    choices_.clear();
  }
  const int64_t drop = std::min<int64_t>(first - first_, int64_t(choices_.size()));
  choices_.erase(choices_.begin(), choices_.begin() + drop);
  first_ += drop;
  for (; rule_.samples() < first; ++first_) rule_.next();  // samples no one reads here (other DP ranks')
  while (first_ + int64_t(choices_.size()) < first + n) choices_.push_back(rule_.next());
}

void DataBlend::window(int64_t i, int32_t* out) {
  ORIGAMI_ASSERT(samplers_.size() == parts_.size());  // (windows)
  ORIGAMI_CHECK(i >= 0, "sample index must be >= 0, got ", i);
  if (parts_.size() == 1) return samplers_[0]->window(i, out);
  cover(i, 1);
  const BlendChoice c = choices_.front();
  samplers_[size_t(c.dataset)]->window(c.index, out);
}

std::vector<int64_t> DataBlend::samples_per_dataset(int64_t first, int64_t n) {
  if (parts_.size() == 1) return {n};
  cover(first, n);
  std::vector<int64_t> count(parts_.size(), 0);
  for (int64_t k = 0; k < n; ++k) ++count[size_t(choices_[size_t(k)].dataset)];
  return count;
}

}  // namespace origami
