// What a training run reports of each step: the figures every rank contributes (StepFigures, one
// all-reduce), the console line, the JSON metrics row (one object per step in --metrics; its fields
// are listed in the README), and the run-safety pieces that read them — the loss-spike warning and
// the words for a non-finite step.
#pragma once
#include <cstdint>
#include <deque>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "parallel/context_parallel.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "parallel/token_dispatcher.h"
#include "train/memory_check.h"

namespace origami {

// One step's figures over the job. Every rank fills in its own share and `all_reduce` sums them over
// the world in one collective: the fields are packed, in the order for_each_field lists them, into
// one vector of doubles (integers are exact in a double below 2^53) and unpacked after it.
struct StepFigures {
  // The loss parts: the LM loss from one rank per TP group (its peers hold the same value) divided
  // by the step's micro-batches; the router losses from every rank (each TP rank routes its own share
  // of the tokens).
  double lm_loss = 0, aux_loss = 0, z_loss = 0;
  double cpu_s = 0;   // CPU seconds of every rank
  bool stop = false;  // some rank took SIGINT or SIGTERM
  // MoE: routed assignments per layer and expert, and those the capacity dropped per layer (every
  // rank's own); the rows each rank's experts computed (each rank fills in its own entry).
  std::vector<std::vector<int64_t>> expert_tokens;  // [layer][expert]
  std::vector<int64_t> expert_dropped;              // [layer]
  std::vector<int64_t> expert_near_ties;            // [layer] (layers/moe.h, kNearTie)
  std::vector<int64_t> expert_rows;                 // [rank], MoE only
  std::vector<int64_t> expert_busiest;              // [rank], MoE only: Model::expert_busiest_rows
  std::vector<int64_t> cp_pairs;                    // [rank], CP only: the causal pairs each rank's attention computed
  // ZeRO-3 or FSSDP, [rank]: the bytes each rank sent gathering parameters and reducing gradients
  // (both parameter sets: DataParallel::traffic); FSSDP, [rank]: the experts each rank gathered (one
  // per layer, pass and expert its rows reached, forward and backward).
  std::vector<double> gathered_bytes, reduced_bytes;
  std::vector<int64_t> expert_gathers;
  // Per pipeline stage, from its first rank of TP x DP x CP: the measured and the computed activation
  // peak (bytes), the time it was busy and the schedule's time (s), the bytes it sent over pp, the
  // process's peak resident memory so far (bytes), the message buffers its step allocated.
  std::vector<double> act_peak, act_computed, busy_s, total_s, pp_bytes, rss_peak, pp_buffers;  // [stage]
  std::vector<double> rank_busy_s;  // [rank], document batching: the time each rank's pipeline was busy
  std::vector<double> vocab_s;      // [stage], vocabulary parallelism: the time in its passes (PipelineTimes::vocab)

  double loss() const { return lm_loss + aux_loss + z_loss; }
  // Collective over `world`: every rank's figures summed, on every rank.
  void all_reduce(Comm& world);

 private:
  template <class F>
  void for_each_field(F&& f) {
    f(lm_loss), f(aux_loss), f(z_loss), f(cpu_s), f(stop);
    f(expert_tokens), f(expert_dropped), f(expert_near_ties), f(expert_rows), f(expert_busiest), f(cp_pairs);
    f(gathered_bytes), f(reduced_bytes), f(expert_gathers);
    f(act_peak), f(act_computed), f(busy_s), f(total_s), f(pp_bytes), f(rss_peak), f(pp_buffers), f(rank_busy_s),
        f(vocab_s);
  }
};

// A loss spike: above --loss-spike-factor times the median of the last finite losses (rank 0).
class LossSpikes {
 public:
  explicit LossSpikes(double factor) : factor_(factor) {}
  // Records a finite loss; true (and a warning on stderr) when it is a spike (never with a factor of
  // 0: the losses are still recorded, for a resume that turns the check on).
  bool check(int64_t step, double loss);
  // The losses the median is taken over, oldest first: kept in a checkpoint, so that a resumed run
  // checks its first steps as the uninterrupted run would.
  std::vector<double> history() const { return {recent_.begin(), recent_.end()}; }
  void restore(const std::vector<double>& losses);

 private:
  static constexpr size_t kWindow = 100, kMinSteps = 10;  // the median is over the last kWindow, from kMinSteps on
  double factor_;
  std::deque<double> recent_;
};

// What was not finite in a step whose update was skipped, in words.
std::string non_finite_words(const Gradients& grads, double loss);

// The run's constants that every row and console line repeats.
struct RunInfo {
  std::string layout;       // the layout in words
  int64_t steps = 0;        // --steps
  int64_t tokens = 0;       // per step: G x T (document batching: at most --tokens-per-step)
  bool moe = false;
  bool quiet = false;       // --quiet: a console line every 50 steps, at the last and on a skipped step
  const MeshShape* mesh = nullptr;
};

// One step as rank 0 reports it: the reduced figures and rank 0's own measurements.
// Document batching: what a step held and how evenly the balancer spread it (train/balance.h).
struct DocumentStep {
  int64_t sequences = 0, tokens = 0, predicted = 0;  // the step's sequences, tokens and tokens with a target
  double flops = 0;                      // the step's training FLOPs, each sequence at its own length
  int64_t micro_batches = 0;             // per DP rank
  int64_t over_group = 0;                // the sequences run over a CP group (all of them without a CP degree per
                                         // sequence; with one, those at a degree above 1)
  // With a CP degree per sequence, for each degree of cp_degrees(C): (degree, the step's sequences at
  // it) and (degree, rank 0's micro-batches at it).
  std::vector<std::pair<int, int64_t>> cp_degrees, degree_micro;
  double estimated_imbalance = 1;        // max / mean of the balancer's cost per DP rank
  double estimated_bound = 1;            // a lower bound of estimated_imbalance for any placement in as many
                                         // micro-batches (train/balance.h imbalance_bound)
  std::vector<double> estimated_s;       // costs in seconds (--balance-costs measure or FILE): the balancer's
                                         // estimate per worker (DP rank, or DP×CP rank with a CP degree per
                                         // sequence) over the ranks that split its work (TP, PP, static CP)
  std::vector<int64_t> dataset_tokens;   // a blend: the step's tokens from each dataset (else empty)
};

struct StepReport {
  int64_t step = 0;  // steps done
  int64_t tokens = 0;  // the step's tokens
  double lr = 0, grad_norm = 0, ms = 0, eta_s = 0;
  double gflops = 0;
  const StepFigures* fig = nullptr;
  std::map<std::string, double> comm_bytes;  // per communicator (the mesh axes, cp, the tied embedding's group)
  const CpCounters* cp = nullptr;            // under CP: rank 0's counters (tiles are reported in any case)
  int64_t attention_tiles = 0;               // rank 0's forward score tiles (fewer under document masking)
  int64_t transfers_in_pieces = 0;           // rank 0's MPI transfers in pieces since start (mpi_comm.h)
  std::vector<int64_t> data_samples;         // the step's rows from each dataset (a blend)
  std::vector<int64_t> data_tokens;          // ... under document batching, the step's tokens from each
  std::optional<double> val_loss;  // a step that evaluated (NaN where the validation loss was not finite)
  std::string skipped;  // why the update was skipped: what was not finite, or no token to predict
  bool loss_spike = false;
  double save_blocked_s = 0;
  int64_t rss_peak_bytes = 0;
  // MoE (rank 0's): the routers' biases, the MoE layers' time and the dispatcher's parts of it.
  const std::vector<std::vector<float>>* router_bias = nullptr;
  double moe_layer_s = 0;
  DispatchTimes dispatch;
  // The first row of a run: the memory check's figures and the planner's prediction of comm_bytes.
  const MemoryCheck* memory = nullptr;
  std::map<std::string, double> comm_predicted;

  const DocumentStep* documents = nullptr;  // document batching only
  double tokens_per_s() const { return double(tokens) / (ms / 1000.0); }
};

// The console lines of a step and of an evaluation (rank 0).
void print_step_line(const RunInfo& run, const StepReport& r, bool skip);
void print_eval_line(const RunInfo& run, int64_t step, double val_loss, double ms);

// The metrics row of a step, one function per optional group.
nlohmann::json metrics_row(const RunInfo& run, const StepReport& r);
void add_cp_group(nlohmann::json& row, const StepReport& r);
void add_documents_group(nlohmann::json& row, const StepReport& r);
void add_memory_group(nlohmann::json& row, const StepReport& r);
void add_moe_group(nlohmann::json& row, const RunInfo& run, const StepReport& r);

// The --metrics file (rank 0; appended to when a run resumes): one JSON object per line, flushed.
// (Also origami launch's --events file; `what` names the file in the error.)
class MetricsFile {
 public:
  MetricsFile() = default;
  // Error when it cannot be written. Appending, the file is cut (in place) before its first row of a
  // step past `last_step` (when ≥ 0): a resumed run's file keeps only the steps its checkpoint
  // reached, not those an attempt that died, or a run resumed from an earlier step, wrote there.
  MetricsFile(const std::string& path, bool append, const char* what = "metrics file", int64_t last_step = -1);
  explicit operator bool() const { return bool(out_); }
  bool write(const nlohmann::json& row);  // false when the write failed (a full disk)

 private:
  std::unique_ptr<std::ofstream> out_;
};

}  // namespace origami
