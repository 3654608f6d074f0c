// The training loop: micro-batches with gradient accumulation, clipping, AdamW, learning-rate
// schedule, one human line and one JSON metrics object per step, periodic and final checkpoints,
// and a clean stop (checkpoint saved) on SIGINT/SIGTERM — on one process or on every rank of an
// MPI job laid out as TP × DP × PP (with sequence parallelism, ZeRO, pipeline schedules and
// activation recomputation) — and, for MoE models, the experts on their own mesh ETP × EP × EDP × PP
// over the same ranks (MoE parallel folding).
//
// Layout invariance: initialisation depends only on (seed, parameter name, global element index);
// the rows of step s are windows s·G .. s·G+G−1 whatever the layout, DP rank d taking rows
// [d·G/dp, (d+1)·G/dp) in micro-batches of B; every micro-batch's loss enters with weight
// 1/(G/B), so the step's loss and gradients are those of the one-rank run. Every pipeline stage
// reads the same rows; each (micro-batch, chunk) runs in the order of its stage's schedule. Under
// document batching step s is a list of whole sequences (data/documents.h) that every rank packs
// into rows alike (train/balance.h); the step's loss is the mean over its predicted tokens.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "data/tokenizer.h"
#include "model/config.h"
#include "model/model.h"
#include "model/params.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"
#include "train/optimizer.h"

namespace origami {

// Upper bounds of the options that size a run (TrainOptions::validate; origami plan takes the same):
// far beyond any real run, and small enough that what is derived from them — tokens per step, a
// row's index over the run, bucket sizes — stays inside 64-bit arithmetic.
constexpr int64_t kMaxSteps = int64_t(1) << 32;        // --steps, --eval-every, --save-every
constexpr int64_t kMaxBatch = int64_t(1) << 30;        // --micro-batch, --global-batch, --eval-iters x global batch
constexpr int kMaxDegree = 1 << 20;                    // every parallel degree
constexpr int kMaxThreads = 4096;                      // --threads of every command (OpenMP starts them all)
// --threads of every command: 0 (all cores) to kMaxThreads, else an Error naming the value and the rule.
void check_thread_count(int64_t threads);
// Sets the threads of our loops and the GEMM libraries to `threads` (0: leaves them at all cores); a
// count the OpenMP runtime caps is a warning of `command` when `say` (one rank of a job).
void use_threads(int64_t threads, const char* command, bool say = true);
constexpr double kMaxBucketMb = double(1 << 20);       // --bucket-mb
constexpr double kMaxMemoryGb = double(1 << 30);       // --memory-limit-gb

struct TrainOptions {
  std::string data;            // dataset prefix (PREFIX.bin / PREFIX.idx), or a blend "W1 PREFIX1 W2 PREFIX2 ..."
  std::string eval_data;       // validation data (a prefix or a blend), optional
  int64_t eval_every = 0;      // evaluate every N steps (and after the last); 0: after the last only
  int64_t eval_iters = 10;     // global batches of validation windows per evaluation
  std::string attention_mask = "causal";  // causal | document (attention within documents, positions restart)
  std::string batching = "windows";  // windows | documents (whole documents as sequences, data/documents.h)
  int64_t tokens_per_step = 0;       // documents: N, the most tokens a step takes (0: B x DP x T)
  std::string balance = "lpt";       // documents: none | lpt, how sequences are placed on DP ranks (train/balance.h)
  bool static_cp = false;            // documents with --cp: every sequence over the CP group (no degree per sequence)
  std::string balance_costs = "flops";  // documents: the balancer's costs: flops, measure (timed at start) or a
                                     // cluster.json whose rates give seconds
  // Document batching: one step's micro-batches and, with a CP degree per sequence, how many of rank 0's
  // run at each degree (degree, micro-batches), to predict that step's traffic (0 and empty: the bound,
  // all of them over the group).
  int64_t step_micro_batches = 0;
  std::vector<std::pair<int, int64_t>> step_degree_micro_batches;
  std::string init_from;       // weights only: any checkpoint, Hugging Face directory or .safetensors file
  std::string resume;          // a checkpoint to continue: weights, optimizer state, step (any layout wrote it)
  int64_t steps = 100;         // total optimizer steps
  int64_t micro_batch = 4;     // B: rows per forward/backward
  int64_t global_batch = 0;    // G: rows per optimizer step (G / (B·DP) micro-batches); 0: B·DP
  int64_t seq_len = 128;       // T
  LrConfig lr;
  AdamWConfig adam;
  double grad_clip = 1.0;      // 0 disables clipping
  uint64_t seed = 1234;
  std::string data_order = "sequential";
  std::string metrics;         // JSONL path, optional
  std::string tensorboard;     // TensorBoard event file directory, optional
  std::string save;            // checkpoint directory (DIR/step-N, DIR/latest), optional
  int64_t save_every = 0;      // 0: only at the end
  bool save_every_auto = false;  // --save-every auto: Young's interval from the first save (mtbf_hours)
  double mtbf_hours = 24;      // the mean time between failures --save-every auto assumes
  int keep_last = 0;           // committed checkpoints kept in --save (0: all)
  bool async_save = false;     // write checkpoints from a background thread while training goes on
  bool overwrite_save = false;  // a run that does not resume may replace the steps --save holds
  int threads = 0;             // 0: all cores
  bool quiet = false;          // no per-step lines (progress only)
  bool verbose = false;        // also print the memory breakdown per rank at startup
  std::string precision = "fp32";  // fp32 | bf16: the layer GEMMs' precision (master weights stay fp32)
  std::string grad_reduce_dtype = "fp32";  // fp32 | bf16: the element type of the DP/EDP gradient reductions
  // Run safety.
  int64_t max_skipped_steps = 0;  // steps with a non-finite loss or gradient norm skipped before the run stops
  double loss_spike_factor = 0;   // warn when a step's loss exceeds this times the running median; 0: off
  double memory_limit_gb = 0;     // per-rank memory limit (GiB) for the check before allocation; 0: the machine's
  // Layout.
  int tp = 1, cp = 1, pp = 1;
  int dp = 0;                  // 0: world size / (tp·cp·pp)
  std::string cp_comm = "p2p"; // context-parallel attention: p2p | a2a | a2a+p2p
  int cp_a2a_size = 0;         // a2a+p2p: ranks per all-to-all group (0: not given)
  int ep = 1, etp = 1;         // MoE mesh: expert parallel, expert tensor parallel (EDP = ranks per stage / (ETP·EP))
  std::string expert_sharding = "ep";  // ep | fssdp (the experts fully sharded over EDP, gathered sparsely)
  bool fssdp_keep = false;     // FSSDP: keep gathered experts until the step's update (gathered once a step)
  int vpp = 1;                 // model chunks per pipeline stage (the interleaved schedule's v)
  std::string pp_schedule;     // gpipe | 1f1b | interleaved; "": 1f1b, interleaved when vpp > 1
  std::vector<int> pp_layers;  // layers of each virtual stage; empty: an even split
  bool vocab_parallel = false;  // the vocabulary split over every pipeline stage (needs pp > 1)
  std::string recompute = "none";  // none | selective | full
  bool sequence_parallel = false;
  int zero = 0;                // ZeRO stage 0, 1, 2, 3
  double bucket_mb = 16;       // data-parallel gradient bucket size (MiB of fp32 gradients)
  std::string mesh_order = "tp-cp-ep-dp-pp";
  // MoE routing (model/layers/moe.h).
  std::string moe_aux_loss;              // none | micro | seq | global; empty: aux_loss()'s default
  double moe_aux_loss_coef = -1;         // < 0: the config's router_aux_loss_coef
  double moe_capacity_factor = 0;        // 0: dropless
  std::string moe_drop_policy = "probs"; // probs | position
  bool moe_pad_to_capacity = false;
  std::string moe_router_score = "softmax";  // softmax | sigmoid
  double moe_router_bias_update_rate = 0;    // aux-loss-free balancing; 0: off
  // A job restarted with the same --resume and --save directory starts at step 0 the first time,
  // while that directory holds no checkpoint yet.
  bool fresh_start() const;
  // Error unless --save can hold this run's steps: not a checkpoint itself, and, for a run that does
  // not resume from it (the directory or one of its steps), not holding another run's steps (its saves
  // would replace them) unless overwrite_save.
  void check_save_dir() const;
  nlohmann::json as_json() const;
  // Error naming the value and the rule, for the routing options alone (also used by 'origami dump').
  void validate_routing(const ModelConfig& cfg) const;
  // The model config with the routing options applied.
  ModelConfig with_routing(const ModelConfig& cfg) const;
  // Error naming the value and the rule (options, and the layout against the model and world size).
  void validate(const ModelConfig& cfg, int world_size) const;
  void check_limits() const;  // the kMax* bounds above (validate() calls it)
  void validate_experts(const ModelConfig& cfg, int world_size) const;  // the MoE mesh and expert sharding
  void validate_optimizer() const;  // the learning-rate schedule, AdamW and clipping
  MeshDims layout_dims(int world_size) const;  // dp (and edp) derived from the world size
  int cp_a2a() const;  // the all-to-all group size A: 1 for p2p, cp for a2a
  DType grad_reduce_wire() const;  // --grad-reduce-dtype as the reductions' element type
  // A copy with the derived values filled in: global_batch = micro_batch × DP when 0 (and the layout
  // degrees valid; validate() names them otherwise).
  TrainOptions resolved(int world_size) const;
  // A buffer layout (TP shard — ETP for the experts' buffer —, DP bucket padding — EDP —, bucket
  // size), and this layout's activation shape (tp: the attention mesh's TP degree).
  // `experts`: the experts' buffer (under FSSDP laid out as under ZeRO-3). ZeRO ≥ 1 under bf16 lays
  // the GEMM weights out in buckets of their own (copy_buckets; not FSSDP's, which rounds as it sends).
  ParamLayout param_layout(int tp, int tp_rank, int dp, bool experts = false) const;
  bool fssdp() const;             // --expert-sharding fssdp
  int zero_of(bool experts) const { return experts && fssdp() ? 3 : zero; }  // the ZeRO stage of a parameter set
  ActivationShape activation_shape(int tp) const;
  ScheduleKind schedule_kind() const;
  // Per step and DP rank: G / (B·dp); under document batching the most a step may need (bounds from
  // how the packers of train/balance.h fill rows), a multiple of --pp under the interleaved schedule;
  // step_micro_batches when set.
  int64_t micro_batches(int world_size) const;
  bool documents() const;  // --batching documents (an Error naming any other value than windows)
  std::string aux_loss() const;  // --moe-aux-loss, by default micro (seq under --batching documents)
  bool cp_per_sequence() const { return documents() && cp > 1 && !static_cp; }  // a CP degree per sequence
  void validate_documents(const ModelConfig& cfg) const;  // validate() calls it
};

// The end-of-document id of --attention-mask document: the data's tokenizer's (null when the data has
// none), else the model config's eos_token_id (the first of a list); neither is an Error naming
// `data`'s tokenizer file.
int32_t document_eod(const ModelConfig& cfg, const Tokenizer* tokenizer, const std::string& data);

// Exit codes of a run that ends without an error: stopped by SIGINT/SIGTERM after saving, and stopped
// because more steps had a non-finite loss or gradient norm than --max-skipped-steps allows (nothing is
// saved after the last finite update). Errors exit 1.
constexpr int kExitSignal = 130;
constexpr int kExitNonFinite = 3;
// The exit code of an error on some ranks alone (which `origami launch` restarts; 1, an error on every
// rank before training, it does not).
constexpr int kExitRankFailed = 2;

// Prints a rank's own error during a command's work: "origami COMMAND: error (rank R of N): what".
void report_rank_error(const char* command, const Comm& world, const std::exception& e);
// Reports it and ends the job with kExitRankFailed (MPI_Abort), no rank left waiting in a collective.
[[noreturn]] void abort_for_rank_error(const char* command, const Comm& world, const std::exception& e);

// Returns the process exit code (0, kExitSignal, kExitNonFinite, or kExitRankFailed where the end of the
// run, after its last step, failed on some rank: that rank reports it). Collective over `world`: every
// rank calls it with the same arguments. The run is built from make_plan(cfg, opts, world size)
// (train/plan.h), in the order trainer.cpp lists above run_training.
int run_training(const ModelConfig& cfg, const TrainOptions& opts, Comm& world);

// A resume keeps the trained run's step size unless one is given: its --global-batch (windows) or
// --tokens-per-step (documents), which default to figures of the layout (micro-batch x DP, x seq-len)
// and would change the steps under another layout (the data position is the checkpoint's either way:
// StepSizes). o with
// the checkpoint's size filled in (when o resumes a committed checkpoint of the same batching and gives
// none); `note`, when not null, gets the line that says so (empty otherwise).
TrainOptions with_checkpoint_step_size(const TrainOptions& o, std::string* note = nullptr);

}  // namespace origami
