#include "train/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace origami {

namespace {

std::string format_duration(double seconds) {
  const int64_t s = int64_t(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(s / 3600), long(s / 60 % 60));
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", long(s / 60), long(s % 60));
  else std::snprintf(buf, sizeof buf, "%lds", long(s));
  return buf;
}

// StepFigures' packing: each field appended to (or read back from) one vector of doubles.
struct Pack {
  std::vector<double>& v;
  void operator()(double x) { v.push_back(x); }
  void operator()(bool x) { v.push_back(x ? 1.0 : 0.0); }
  void operator()(const std::vector<double>& x) { v.insert(v.end(), x.begin(), x.end()); }
  void operator()(const std::vector<int64_t>& x) {
    for (int64_t i : x) v.push_back(double(i));
  }
  void operator()(const std::vector<std::vector<int64_t>>& x) {
    for (const auto& row : x) (*this)(row);
  }
};

struct Unpack {
  const std::vector<double>& v;
  size_t at = 0;
  void operator()(double& x) { x = v[at++]; }
  void operator()(bool& x) { x = v[at++] > 0; }
  void operator()(std::vector<double>& x) {
    for (double& d : x) d = v[at++];
  }
  void operator()(std::vector<int64_t>& x) {
    for (int64_t& i : x) i = std::llround(v[at++]);
  }
  void operator()(std::vector<std::vector<int64_t>>& x) {
    for (auto& row : x) (*this)(row);
  }
};

std::vector<int64_t> as_int(const std::vector<double>& v) {
  std::vector<int64_t> r;
  for (double x : v) r.push_back(std::llround(x));
  return r;
}

std::vector<double> as_ms(std::vector<double> v) {
  for (double& x : v) x *= 1000.0;
  return v;
}

// The rows each rank's experts computed, per stage the most over the mean (the imbalance the
// dispatcher saw); the largest over stages.
double expert_imbalance(const std::vector<int64_t>& rows, const MeshShape& mesh) {
  double imbalance = 1;
  for (int s = 0; s < mesh.dims().pp; ++s) {
    double most = 0, total = 0, n = 0;
    for (int r = 0; r < int(rows.size()); ++r)
      if (mesh.coord(r, "pp") == s) most = std::max(most, double(rows[size_t(r)])), total += double(rows[size_t(r)]), ++n;
    if (total > 0) imbalance = std::max(imbalance, most / (total / n));
  }
  return imbalance;
}

// Call by call: Σ over a step's MoE calls of the EP group's most rows over Σ of its mean (the group's
// rows over its size), the most over the EP groups. Each call's exchanges wait for its busiest rank,
// so this, at least the step totals' figure, is what stretches a step.
double expert_sync_imbalance(const std::vector<int64_t>& rows, const std::vector<int64_t>& busiest, const MeshShape& mesh) {
  double imbalance = 1;
  for (int r = 0; r < int(rows.size()); ++r) {
    const std::vector<int> group = mesh.group(r, "ep");
    double total = 0;
    for (int g : group) total += double(rows[size_t(g)]);
    if (total > 0) imbalance = std::max(imbalance, double(busiest[size_t(r)]) / (total / double(group.size())));
  }
  return imbalance;
}

}  // namespace

void StepFigures::all_reduce(Comm& world) {
  std::vector<double> packed;
  for_each_field(Pack{packed});
  world.all_reduce(packed.data(), int64_t(packed.size()));
  for_each_field(Unpack{packed});
}

void LossSpikes::restore(const std::vector<double>& losses) {
  const size_t keep = std::min(losses.size(), kWindow);
  recent_.assign(losses.end() - long(keep), losses.end());
}

bool LossSpikes::check(int64_t step, double loss) {
  bool spike = false;
  if (factor_ > 0 && recent_.size() >= kMinSteps) {
    std::vector<double> sorted(recent_.begin(), recent_.end());
    std::nth_element(sorted.begin(), sorted.begin() + long(sorted.size() / 2), sorted.end());
    const double median = sorted[sorted.size() / 2];
    if ((spike = loss > factor_ * median))
      std::fprintf(stderr, "origami train: warning: step %lld: loss spike: %.4f is %.2fx the median %.4f of the last %zu "
                   "steps (--loss-spike-factor %g)\n", (long long)step, loss, loss / median, median, recent_.size(),
                   factor_);
  }
  recent_.push_back(loss);
  if (recent_.size() > kWindow) recent_.pop_front();
  return spike;
}

std::string non_finite_words(const Gradients& grads, double loss) {
  const double gnorm = grads.norm;
  if (!grads.loss_finite && !std::isfinite(gnorm))
    return cat("the loss (", loss, ") and the gradient norm (", gnorm, ") are not finite");
  if (!grads.loss_finite) return cat("the loss is not finite (", loss, ")");
  return cat("the gradient norm is not finite (", gnorm, ")");
}

void print_step_line(const RunInfo& run, const StepReport& r, bool skip) {
  if (run.quiet && r.step != run.steps && r.step % 50 != 0 && !skip) return;
  const StepFigures& f = *r.fig;
  std::printf("step %lld/%lld | loss %.4f", (long long)r.step, (long long)run.steps, f.loss());
  if (run.moe) std::printf(" (lm %.4f aux %.4f z %.5f)", f.lm_loss, f.aux_loss, f.z_loss);
  std::printf(" | lr %.3e | grad norm %.3f | %.0f tok/s | %.1f ms | %.1f GFLOP/s | eta %s%s\n", r.lr, r.grad_norm,
              r.tokens_per_s(), r.ms, r.gflops, format_duration(r.eta_s).c_str(), skip ? " | update skipped" : "");
  std::fflush(stdout);
}

void print_eval_line(const RunInfo& run, int64_t step, double val_loss, double ms) {
  std::printf("step %lld/%lld | val loss %.4f | val ppl %.3f | %.1f ms\n", (long long)step, (long long)run.steps,
              val_loss, std::exp(val_loss), ms);
  std::fflush(stdout);
}

nlohmann::json metrics_row(const RunInfo& run, const StepReport& r) {
  const StepFigures& f = *r.fig;
  nlohmann::json bytes = nlohmann::json::object();
  for (const auto& [group, b] : r.comm_bytes) bytes[group] = std::llround(b);
  nlohmann::json j = {{"step", r.step}, {"loss", f.loss()}, {"lm_loss", f.lm_loss}, {"aux_loss", f.aux_loss},
                      {"z_loss", f.z_loss}, {"grad_norm", r.grad_norm}, {"lr", r.lr}, {"tokens", r.tokens},
                      {"ms", r.ms}, {"tokens_per_s", r.tokens_per_s()}, {"gflops", r.gflops}, {"cpu_s", f.cpu_s},
                      {"layout", run.layout}, {"comm_bytes", bytes},
                      {"act_bytes_peak", as_int(f.act_peak)}, {"act_bytes_computed", as_int(f.act_computed)},
                      {"pp_busy_ms", as_ms(f.busy_s)}, {"pp_ms", as_ms(f.total_s)}, {"pp_bytes", as_int(f.pp_bytes)},
                      {"pp_rss_peak_bytes", as_int(f.rss_peak)}, {"pp_message_buffers", as_int(f.pp_buffers)}};
  add_cp_group(j, r);
  if (!f.vocab_s.empty()) j["pp_vocab_ms"] = as_ms(f.vocab_s);
  if (!f.gathered_bytes.empty()) j["gathered_bytes"] = as_int(f.gathered_bytes), j["reduced_bytes"] = as_int(f.reduced_bytes);
  if (!r.data_samples.empty()) j["data_samples"] = r.data_samples;
  if (!r.data_tokens.empty()) j["data_tokens"] = r.data_tokens;
  if (r.documents) add_documents_group(j, r);
  if (r.val_loss) j["val_loss"] = *r.val_loss;  // the validation group: a step that evaluated (NaN: null)
  if (!r.skipped.empty()) j["skipped"] = r.skipped;
  if (r.loss_spike) j["loss_spike"] = true;
  if (r.save_blocked_s > 0) j["save_blocked_s"] = r.save_blocked_s;
  j["rss_peak_bytes"] = r.rss_peak_bytes;  // rank 0's, so far
  add_memory_group(j, r);
  if (run.moe) add_moe_group(j, run, r);
  return j;
}

// Document batching: the step's sequences and the balance of the work over the ranks, estimated by the
// balancer (over DP ranks) and measured (each rank's pipeline busy time, max / mean over every rank).
void add_documents_group(nlohmann::json& row, const StepReport& r) {
  const std::vector<double>& busy = r.fig->rank_busy_s;
  double sum = 0, most = 0;
  for (const double b : busy) sum += b, most = std::max(most, b);
  row["documents"] = {{"sequences", r.documents->sequences}, {"predicted_tokens", r.documents->predicted},
                      {"micro_batches", r.documents->micro_batches}, {"sequences_over_cp", r.documents->over_group},
                      {"busy_estimated_max_over_mean", r.documents->estimated_imbalance},
                      {"busy_estimated_bound", r.documents->estimated_bound},
                      {"busy_max_over_mean", sum > 0 ? most * double(busy.size()) / sum : 1.0},
                      {"busy_ms", as_ms(busy)}};
  if (!r.documents->estimated_s.empty()) row["documents"]["busy_estimated_ms"] = as_ms(r.documents->estimated_s);
  if (!r.documents->cp_degrees.empty()) {  // the sequences at each CP degree, e.g. {"1": 40, "2": 9, "4": 3}
    nlohmann::json& at = row["documents"]["sequences_per_cp_degree"] = nlohmann::json::object();
    for (const auto& [degree, sequences] : r.documents->cp_degrees) at[std::to_string(degree)] = sequences;
  }
}

// Under CP: rank 0's ring (transfer time and the part waited for) and every rank's causal pairs.
void add_cp_group(nlohmann::json& row, const StepReport& r) {
  if (r.cp)
    row["cp"] = {{"ring_s", r.cp->transfer_s}, {"ring_wait_s", r.cp->wait_s}, {"pairs", r.fig->cp_pairs}};
  row["attention_tiles"] = r.attention_tiles;
  if (r.transfers_in_pieces > 0) row["mpi_transfers_in_pieces"] = r.transfers_in_pieces;  // (past MPI's int counts)
}

// The first row of a run: the memory check's figures (the neediest rank's parts, every rank's total)
// and the planner's prediction of this row's comm_bytes (train/comm_volume.h; the dispatcher's
// payloads for evenly spread tokens).
void add_memory_group(nlohmann::json& row, const StepReport& r) {
  if (!r.memory) return;
  const MemoryCheck& m = *r.memory;
  std::vector<int64_t> totals;
  for (const MemoryParts& p : m.parts) totals.push_back(p.total());
  row["memory_bytes"] = m.parts[m.neediest].as_json();
  row["memory_bytes"]["rank"] = m.neediest;
  row["memory_bytes_per_rank"] = totals;
  nlohmann::json predicted = nlohmann::json::object();
  for (const auto& [group, b] : r.comm_predicted) predicted[group] = std::llround(b);
  row["comm_bytes_predicted"] = predicted;
}

// MoE: the load per expert and the drops over every rank, the rows each rank's experts computed and
// their imbalance, and rank 0's MoE layers: their time, the exchanges', and the dispatcher's own work
// (regrouping, permute and combine), the overhead the exchanges do not explain.
void add_moe_group(nlohmann::json& row, const RunInfo& run, const StepReport& r) {
  const StepFigures& f = *r.fig;
  row["expert_tokens"] = f.expert_tokens;
  row["expert_dropped"] = f.expert_dropped;
  row["expert_near_ties"] = f.expert_near_ties;
  if (r.router_bias && !r.router_bias->empty()) row["router_bias"] = *r.router_bias;
  row["expert_rows"] = f.expert_rows;
  row["expert_imbalance"] = expert_imbalance(f.expert_rows, *run.mesh);
  row["expert_sync_imbalance"] = expert_sync_imbalance(f.expert_rows, f.expert_busiest, *run.mesh);
  if (!f.expert_gathers.empty()) row["expert_gathers"] = f.expert_gathers;  // FSSDP
  const DispatchTimes& dt = r.dispatch;
  row["moe_times"] = {{"layer_s", r.moe_layer_s}, {"exchange_s", dt.exchange_s}, {"regroup_s", dt.regroup_s},
                      {"permute_s", dt.permute_s}};
}

namespace {

// The step of one of origami's rows ({"...","step":N,...}, keys written sorted), or -1.
int64_t row_step(const std::string& line) {
  const size_t at = line.find("\"step\":");
  if (at == std::string::npos) return -1;
  char* end = nullptr;
  const long long step = std::strtoll(line.c_str() + at + 7, &end, 10);
  return end == line.c_str() + at + 7 ? -1 : int64_t(step);
}

// Cuts the file before its first row of a step past last_step: rows are written in step order, so
// what follows is the dead attempt's (or the later run's) too. In place: a link stays a link.
void cut_rows_after(const std::string& path, int64_t last_step) {
  std::ifstream in(path, std::ios::binary);
  int64_t offset = 0;
  for (std::string line; std::getline(in, line); offset += int64_t(line.size()) + 1)
    if (row_step(line) > last_step) {
      in.close();
      std::filesystem::resize_file(path, uintmax_t(offset));
      return;
    }
}

}  // namespace

MetricsFile::MetricsFile(const std::string& path, bool append, const char* what, int64_t last_step) {
  // A resume appends: a row a killed run left without its newline is cut first, so the next row
  // starts a line of its own.
  std::error_code ec;
  if (append && std::filesystem::is_regular_file(path, ec)) {
    std::ifstream in(path, std::ios::binary);
    int64_t end = int64_t(std::filesystem::file_size(path, ec)), keep = 0;  // keep: the bytes up to the last newline
    for (int64_t at = end; at > 0 && keep == 0;) {  // backwards, a block at a time
      const int64_t from = std::max<int64_t>(0, at - 65536);
      std::string block(size_t(at - from), '\0');
      in.seekg(from).read(block.data(), std::streamsize(block.size()));
      const size_t nl = block.find_last_of('\n');
      if (nl != std::string::npos) keep = from + int64_t(nl) + 1;
      at = from;
    }
    if (keep < end) std::filesystem::resize_file(path, uintmax_t(keep), ec);
    if (last_step >= 0) cut_rows_after(path, last_step);
  }
  out_ = std::make_unique<std::ofstream>(path, append ? std::ios::app : std::ios::trunc);
  ORIGAMI_CHECK(*out_, "cannot write ", what, " '", path, "'");
}

bool MetricsFile::write(const nlohmann::json& row) {
  const std::string line = row.dump() + "\n";  // one write: a kill leaves a whole row or a cut one
  out_->write(line.data(), std::streamsize(line.size()));
  out_->flush();
  return bool(*out_);
}

}  // namespace origami
