// origami train: train a model from a Hugging Face config.json on a prepared dataset.
#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_writer.h"
#include <cstdio>
#include <new>
#include <optional>

#include "comm/mpi_comm.h"
#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/files.h"
#include "core/io.h"
#include "core/json_fields.h"
#include "kernels/cpu/gemm.h"
#include "train/trainer.h"

namespace origami {

void add_precision_option(Args& a) {
  a.option("precision", "fp32|bf16",
           "the layer GEMMs' precision: bf16 multiplies bf16 copies of the weights and activations with fp32 "
           "accumulation (master weights, gradients and optimizer state stay fp32)", "fp32");
}

int threads_option(const Args& a) {
  const int64_t threads = a.integer("threads");
  check_thread_count(threads);
  return int(threads);
}

void add_routing_options(Args& a, bool train) {
  a.option("moe-aux-loss", "none|micro|seq|global",
           std::string("MoE load-balancing loss: f_e over each micro-batch, per sequence, or over the global batch so "
                       "far (default: micro") + (train ? "; seq under --batching documents)" : ")"))
      .option("moe-aux-loss-coef", "X", "its coefficient (default: the config's router_aux_loss_coef)")
      .option("moe-capacity-factor", "F", "drop assignments beyond ceil(F x tokens x top-k / experts) per expert "
                                          "(counted over the tokens a rank routes); 0: dropless", "0")
      .option("moe-drop-policy", "probs|position", "with a capacity: keep the highest-probability or the earliest "
                                                  "assignments", "probs")
      .flag("moe-pad-to-capacity", "with a capacity: pad every expert to it (fixed shapes through the dispatcher)")
      .option("moe-router-score", "softmax|sigmoid", "router scores (sigmoid: top-k weights renormalised)", "softmax");
  if (train)
    a.option("moe-router-bias-update-rate", "R", "aux-loss-free balancing: a per-expert selection bias moved by "
                                                 "R x sign(mean load - load) after each step; 0: off", "0");
}

void read_routing_options(const Args& a, TrainOptions& o, bool train) {
  o.moe_aux_loss = a.given("moe-aux-loss") ? a.str("moe-aux-loss") : "";
  if (a.has("moe-aux-loss-coef")) {
    o.moe_aux_loss_coef = a.number("moe-aux-loss-coef");
    ORIGAMI_CHECK(o.moe_aux_loss_coef >= 0, "--moe-aux-loss-coef must not be negative, got ", o.moe_aux_loss_coef);
  }
  o.moe_capacity_factor = a.number("moe-capacity-factor");
  o.moe_drop_policy = a.str("moe-drop-policy");
  parse_drop_policy(o.moe_drop_policy);  // (a value that is none first, then whether it applies)
  ORIGAMI_CHECK(!a.given("moe-drop-policy") || o.moe_capacity_factor > 0, a.source("moe-drop-policy"),
                " chooses what a capacity drops, and without --moe-capacity-factor F routing is dropless (drops nothing)");
  o.moe_pad_to_capacity = a.on("moe-pad-to-capacity");
  o.moe_router_score = a.str("moe-router-score");
  if (train) o.moe_router_bias_update_rate = a.number("moe-router-bias-update-rate");
}

void require_experts_for_given(const Args& a, const ModelConfig& cfg, bool train) {
  if (cfg.is_moe()) return;
  std::vector<std::string> given = {"moe-aux-loss", "moe-aux-loss-coef", "moe-capacity-factor", "moe-drop-policy",
                                    "moe-router-score"};
  if (train) given.insert(given.end(), {"moe-router-bias-update-rate", "expert-sharding"});
  for (const std::string& name : given)
    ORIGAMI_CHECK(!a.given(name), a.source(name), " is for a mixture-of-experts model, and this ", cfg.model_type(),
                  " model has no experts");
  for (const std::string& flag : train ? std::vector<std::string>{"moe-pad-to-capacity", "fssdp-keep"}
                                       : std::vector<std::string>{"moe-pad-to-capacity"})
    ORIGAMI_CHECK(!a.on(flag), a.source(flag), " is for a mixture-of-experts model, and this ", cfg.model_type(),
                  " model has no experts");
}

namespace {

// What the run reads: the model, the data, the checkpoint it starts from.
void add_input_options(Args& a) {
  a.option("config", "FILE", "model config.json (default: config.json of the --resume or --init-from checkpoint)")
      .option("run-config", "FILE", "JSON file with any of these options")
      .option("plan", "FILE", "a layout written by 'origami plan --out': its parallel axes, precision, micro-batch, "
                              "global batch and sequence length (flags win; a --run-config key giving one of them "
                              "another value is an error)")
      .option("data", "PREFIX", "dataset prefix (PREFIX.bin, PREFIX.idx), or a weighted blend in one argument: "
                                "\"W1 PREFIX1 W2 PREFIX2 ...\" (weights normalised; sample i from the dataset furthest "
                                "below its share)")
      .option("eval-data", "PREFIX", "validation data (a prefix or a blend): its first --eval-iters x global-batch "
                                     "windows, in order (documents: its first --eval-iters steps of documents), give "
                                     "the validation loss")
      .option("eval-every", "N", "evaluate every N steps, and after the last (0: after the last step only)", "0")
      .option("eval-iters", "K", "global batches of validation windows (documents: steps) per evaluation (default 10)")
      .option("attention-mask", "causal|document",
              "document: a token attends only to earlier tokens of its own document (the token after each "
              "end-of-document token starts one) and positions restart at 0 per document", "causal")
      .option("batching", "windows|documents",
              "windows: --global-batch rows of --seq-len tokens cut from the token stream; documents: every "
              "document (cut into pieces of at most --seq-len) is a sequence of its own, each step the next ones "
              "up to --tokens-per-step tokens, packed into rows and placed on the DP ranks by --balance", "windows")
      .option("tokens-per-step", "N", "documents: the most tokens a step takes (default: micro-batch x DP x seq-len)")
      .option("micro-batch-tokens", "M", "tokens per micro-batch, a multiple of --seq-len: sets --micro-batch to "
                                         "M / seq-len (either batching; the unit document batching thinks in)")
      .option("balance", "none|lpt|flex", "documents: sequences dealt round-robin to the DP ranks (none), or longest "
                                          "first to the rank with the least estimated work (lpt); with a CP degree "
                                          "per sequence, flex also raises a sequence's degree where that balances "
                                          "the ranks", "lpt")
      .option("balance-costs", "flops|measure|FILE", "documents: how the balancer's estimate of each rank's busy time "
                                                     "(the metrics' busy_estimated_ms and estimated imbalance) prices "
                                                     "a sequence: its FLOPs, seconds timed at start on this machine "
                                                     "(measure), or seconds at a cluster.json's GEMM and attention "
                                                     "rates ('origami profile'); the placement itself weighs sequences "
                                                     "by their FLOPs whatever this says, so every rank reaches it alike",
              "flops")
      .flag("static-cp", "documents with --cp C: every sequence over the CP group (default: each at the least degree "
                         "whose rows of degree x seq-len / C tokens hold it, among 1, the powers of two that divide "
                         "C, and C, or in a gap of a higher degree's rows)")
      .option("resume", "PATH", "continue a checkpoint saved under any layout: weights, optimizer state, step and data "
                                "position (PATH: a --save directory, its newest committed step, or one step-N in it; "
                                "the same directory as --save before it holds a checkpoint: start at step 0)")
      .option("init-from", "PATH", "weights only: a checkpoint, a Hugging Face model directory or a .safetensors file");
}

// The data and checkpoint options (--config, --run-config and --plan are read by parse_train_options).
void read_input_options(const Args& a, TrainOptions& o) {
  o.data = a.str("data");
  o.eval_data = a.str("eval-data");
  o.eval_every = a.integer("eval-every");
  if (a.has("eval-iters")) o.eval_iters = a.integer("eval-iters");
  ORIGAMI_CHECK(!a.has("eval-iters") || a.has("eval-data"), "--eval-iters needs --eval-data PREFIX");
  o.attention_mask = a.str("attention-mask");
  o.batching = a.str("batching");
  o.balance = a.str("balance");
  ORIGAMI_CHECK(!a.given("balance") || o.batching == "documents", "--balance places the sequences of --batching "
                "documents (got --batching ", o.batching, ")");
  o.static_cp = a.on("static-cp");
  o.balance_costs = a.str("balance-costs");
  ORIGAMI_CHECK(!a.given("balance-costs") || o.batching == "documents", "--balance-costs sizes the balancer's "
                "costs under --batching documents (got --batching ", o.batching, ")");
  if (a.has("tokens-per-step")) {
    o.tokens_per_step = a.integer("tokens-per-step");
    ORIGAMI_CHECK(o.tokens_per_step >= 1, "--tokens-per-step must be positive, got ", o.tokens_per_step);
  }
  o.init_from = a.str("init-from");
  o.resume = a.str("resume");
}

// Steps, batch and AdamW.
void add_optimizer_options(Args& a) {
  a.option("steps", "N", "total optimizer steps", "100")
      .option("micro-batch", "B", "rows per forward/backward pass", "4")
      .option("global-batch", "G", "rows per optimizer step, a multiple of B x DP (default: B x DP)", "")
      .option("seq-len", "T", "tokens per row", "128")
      .option("lr", "X", "peak learning rate", "3e-4")
      .option("min-lr", "X", "the cosine schedule's floor: step s of S after W warmup steps runs at "
              "min + (lr - min)(1 + cos(pi (s - W) / (S - W)))/2, counting s from 0 (the last step stays above it)", "0")
      .option("warmup", "N", "linear warmup steps: step s (from 0) runs at lr (s + 1) / N", "0")
      .option("lr-schedule", "constant|cosine", "learning-rate schedule after warmup", "cosine")
      .option("weight-decay", "X", "AdamW weight decay (matrices only)", "0.1")
      .option("beta1", "X", "AdamW beta1", "0.9")
      .option("beta2", "X", "AdamW beta2", "0.95")
      .option("eps", "X", "AdamW epsilon", "1e-8")
      .option("grad-clip", "X", "clip the global gradient norm to X (0: off)", "1.0")
      .option("seed", "S", "seed for initialisation and data order", "1234")
      .option("data-order", "sequential|shuffled", "order of training windows (documents: of documents)", "sequential");
}

void read_optimizer_options(const Args& a, TrainOptions& o) {
  o.steps = a.integer("steps");
  o.micro_batch = a.integer("micro-batch");
  o.global_batch = a.has("global-batch") ? a.integer("global-batch") : 0;  // 0: micro-batch x DP
  ORIGAMI_CHECK(!a.has("global-batch") || o.global_batch >= 1, "--global-batch must be positive, got ", o.global_batch);
  o.seq_len = a.integer("seq-len");
  if (a.has("micro-batch-tokens")) {
    const int64_t m = a.integer("micro-batch-tokens");
    ORIGAMI_CHECK(!a.given("micro-batch"), "give --micro-batch-tokens or --micro-batch, not both (",
                  a.source("micro-batch"), ")");
    ORIGAMI_CHECK(o.seq_len >= 1 && m >= o.seq_len && m % o.seq_len == 0, "--micro-batch-tokens (", m,
                  ") must be a positive multiple of --seq-len (", o.seq_len, "): a micro-batch is rows of --seq-len");
    o.micro_batch = m / o.seq_len;
  }
  ORIGAMI_CHECK(!a.has("global-batch") || a.str("batching") != "documents", a.source("global-batch"),
                " counts windows; under --batching documents a step is --tokens-per-step tokens");
  o.lr.lr = a.number("lr");
  o.lr.min_lr = a.number("min-lr");
  o.lr.warmup = a.integer("warmup");
  o.lr.total_steps = o.steps;
  o.lr.schedule = parse_lr_schedule(a.str("lr-schedule"));
  o.adam.weight_decay = a.number("weight-decay");
  o.adam.beta1 = a.number("beta1");
  o.adam.beta2 = a.number("beta2");
  o.adam.eps = a.number("eps");
  o.grad_clip = a.number("grad-clip");
  o.seed = a.unsigned_integer("seed");
  o.data_order = a.str("data-order");
}

// What the run writes, how it reports, and its limits.
void add_run_options(Args& a) {
  a.option("metrics", "FILE", "write one JSON object per step to FILE (JSONL): a run from step 0 starts it over, a "
                             "resumed run appends after its checkpoint's step (dropping rows of later steps)")
      .option("tensorboard", "DIR", "write each step's scalars (loss, lr, grad norm, speed, memory) as TensorBoard "
                                    "events to DIR (a resumed run appends to its newest event file)")
      .option("save", "DIR", "write checkpoints to DIR/step-N (every rank its own shards; DIR/latest names the newest); "
                             "DIR is a run's directory, never a file or a checkpoint, and a run that does not --resume "
                             "DIR (or one of its steps) refuses one holding another run's steps unless --overwrite-save")
      .option("save-every", "N|auto", "also save every N steps; auto: save after 10 steps, then every "
                                      "sqrt(2 x save time x MTBF) / step time steps (Young's interval)", "0")
      .option("mtbf-hours", "H", "the mean time between failures --save-every auto plans for", "24")
      .option("keep-last", "K", "keep the K newest checkpoints in DIR, older ones removed after a newer one commits (0: all)",
              "0")
      .flag("async-save", "write checkpoints from a background thread while training goes on")
      .flag("overwrite-save", "let a run that does not --resume DIR save into a --save DIR holding another "
                              "run's checkpoints (each step it saves replaces that run's; without it: an error)")
      .option("threads", "N", "threads per rank for BLAS and kernels (0: all cores)", "0")
      .flag("quiet", "print every 50th step only")
      .flag("verbose", "print every rank's memory breakdown at startup")
      .option("max-skipped-steps", "N",
              "steps whose loss or gradient norm is not finite are skipped (no update); the run stops, without "
              "saving, at the (N+1)-th such step of the run, counted across resumes (exit code 3)", "0")
      .option("loss-spike-factor", "K",
              "warn when a step's loss is above K times the median of the last 100 steps (from the tenth; a "
              "checkpoint keeps them, so a resume goes on checking; 0: off)", "0")
      .option("memory-limit-gb", "X",
              "memory each rank may use (GiB): a run that needs more is refused at startup; 0: what each node has "
              "available, shared by its ranks", "0");
  add_precision_option(a);
}

void read_run_options(const Args& a, TrainOptions& o) {
  o.metrics = a.str("metrics");
  o.tensorboard = a.str("tensorboard");
  o.save = a.str("save");
  const std::string save_every = a.str("save-every");
  o.save_every_auto = save_every == "auto";
  ORIGAMI_CHECK(o.save_every_auto || save_every.find_first_not_of("0123456789") == std::string::npos,
                a.source("save-every"), " must be a step count N or auto, got '", save_every, "'");
  o.save_every = o.save_every_auto ? 0 : a.integer("save-every");
  o.mtbf_hours = a.number("mtbf-hours");
  ORIGAMI_CHECK(!a.given("mtbf-hours") || o.save_every_auto, a.source("mtbf-hours"), " sizes --save-every auto's "
                "interval, and --save-every is ", a.has("save-every") ? a.str("save-every") : "not given");
  o.keep_last = a.small_integer("keep-last");
  o.async_save = a.on("async-save");
  o.overwrite_save = a.on("overwrite-save");
  o.threads = a.small_integer("threads");
  o.precision = a.str("precision");
  o.quiet = a.on("quiet");
  o.verbose = a.on("verbose");
  o.max_skipped_steps = a.integer("max-skipped-steps");
  o.loss_spike_factor = a.number("loss-spike-factor");
  o.memory_limit_gb = a.number("memory-limit-gb");
}

// The parallel layout: TP, DP, EP, ETP, PP (schedule, split), recomputation, CP, SP, ZeRO, the mesh.
void add_parallel_options(Args& a) {
  a.option("tp", "T", "tensor-parallel degree (Megatron column/row-parallel layers, vocab-parallel head)", "1")
      .option("dp", "D", "data-parallel degree (default: ranks / (TP x CP x PP))", "")
      .option("ep", "E", "expert-parallel degree (MoE): each rank group of E holds E-th of the experts; EP x ETP "
                         "may span what attention uses for TP, CP and DP (MoE parallel folding)", "1")
      .option("etp", "T", "expert tensor-parallel degree (MoE): each expert's FFN split over T ranks", "1")
      .option("expert-sharding", "ep|fssdp",
              "MoE experts: ep holds whole experts per EP rank and moves tokens to them; fssdp (Hecate's fully "
              "sharded sparse data parallelism) shards every expert over the stage's ranks and gathers, per layer, "
              "only the experts this rank's tokens reach (needs --ep 1)", "ep")
      .flag("fssdp-keep", "with --expert-sharding fssdp: keep the experts gathered in a step until its update, so "
                          "each is gathered once a step, not in every forward and backward (memory: a replica of "
                          "the stage's experts)")
      .option("pp", "P", "pipeline-parallel degree (stages)", "1")
      .option("vpp", "V", "model chunks per pipeline stage (interleaved schedule)", "1")
      .option("pp-schedule", "gpipe|1f1b|interleaved", "pipeline schedule (default: 1f1b; interleaved when --vpp > 1)")
      .flag("vocab-parallel", "split the embedding and the LM head's vocabulary over every pipeline stage (and TP), "
                              "with the output layer's passes placed into the schedule (Yeung et al. 2024)")
      .option("pp-layers", "N,N,...", "layers of each virtual stage, in order (default: an even split)")
      .option("recompute", "none|selective|full",
              "activation recomputation: selective recomputes the attention core, full keeps only each layer's input",
              "none")
      .option("cp", "C", "context-parallel degree: each sequence split over C ranks (2C load-balanced chunks)", "1")
      .option("cp-comm", "p2p|a2a|a2a+p2p", "context-parallel attention: p2p ring of k|v, a2a all-to-all to heads "
                                          "(Ulysses), a2a+p2p all-to-all in groups of --cp-a2a-size and ring across",
              "p2p")
      .option("cp-a2a-size", "A", "with --cp-comm a2a+p2p: ranks per all-to-all group (divides --cp)")
      .flag("sequence-parallel", "split norms and residuals along the sequence over TP (all-reduce becomes "
                                 "reduce-scatter + all-gather)")
      .option("zero", "0|1|2|3", "ZeRO stage: 0 all-reduce, 1 sharded optimizer state, 2 also sharded gradients, 3 also sharded parameters (each layer gathered when used)", "0")
      .option("bucket-mb", "X", "data-parallel gradient bucket size in MiB", "16")
      .option("grad-reduce-dtype", "fp32|bf16",
              "element type of the DP and EDP gradient reductions: bf16 sends half the bytes and sums in bf16 "
              "(gradients are still accumulated over micro-batches in fp32)", "fp32")
      .option("mesh-order", "ORDER", "rank order of the mesh axes, first varies fastest", "tp-cp-ep-dp-pp");
}

void read_parallel_options(const Args& a, TrainOptions& o) {
  o.tp = a.small_integer("tp");
  o.dp = a.has("dp") ? a.small_integer("dp") : 0;
  ORIGAMI_CHECK(!a.has("dp") || o.dp >= 1, "--dp must be at least 1, got ", o.dp);
  o.ep = a.small_integer("ep");
  o.etp = a.small_integer("etp");
  o.expert_sharding = a.str("expert-sharding");
  o.fssdp_keep = a.on("fssdp-keep");
  o.pp = a.small_integer("pp");
  o.vpp = a.small_integer("vpp");
  o.pp_schedule = a.str("pp-schedule");
  o.vocab_parallel = a.on("vocab-parallel");
  if (a.has("pp-layers"))
    for (int64_t n : a.integers("pp-layers")) {
      ORIGAMI_CHECK(n >= 1 && n <= ModelLimits::layers, "--pp-layers: every stage needs 1 to ",
                    ModelLimits::layers, " layers (the most a model has), got ", n);
      o.pp_layers.push_back(int(n));
    }
  o.recompute = a.str("recompute");
  o.cp = a.small_integer("cp");
  o.cp_comm = a.str("cp-comm");
  o.cp_a2a_size = a.has("cp-a2a-size") ? a.small_integer("cp-a2a-size") : 0;
  ORIGAMI_CHECK(!a.has("cp-a2a-size") || o.cp_a2a_size >= 1, a.source("cp-a2a-size"),
                " must be at least 1 (ranks per all-to-all group), got ", o.cp_a2a_size);
  o.sequence_parallel = a.on("sequence-parallel");
  o.zero = a.small_integer("zero");
  o.grad_reduce_dtype = a.str("grad-reduce-dtype");
  o.bucket_mb = a.number("bucket-mb");
  o.mesh_order = a.str("mesh-order");
}

// Options not given on the command line from --plan (a layout for a job of `ranks`), then from
// --run-config (a key the plan gave another value is an error: Args::fill_from_json).
void fill_from_files(Args& a, int ranks) {
  const nlohmann::json run_config = a.has("run-config") ? read_json_file(a.str("run-config"), "run config")
                                                        : nlohmann::json::object();
  const JsonField rc(run_config, a.has("run-config") ? a.str("run-config") : "");
  if (a.has("plan")) {
    const nlohmann::json plan = read_json_file(a.str("plan"), "plan");
    const JsonField fields(plan, a.str("plan"));  // a plan file of 'origami plan --out'
    const int64_t devices = fields["devices"].integer(1, JsonField::kNoLimit);
    ORIGAMI_CHECK(devices == ranks, "--plan ", a.str("plan"), " lays out ", devices, " devices, and this job has ",
                  ranks, " rank", ranks == 1 ? "" : "s");
    // The plan's batch in windows gives way to options (on the command line or in the run config) that
    // size steps otherwise: rows by --micro-batch-tokens, or whole documents (--batching documents,
    // where --global-batch is refused).
    const std::string batching = a.given("batching") ? a.str("batching") : rc["batching"].string_or(a.str("batching"));
    nlohmann::json kept = plan;
    if (kept.contains("layout") && kept["layout"].is_object()) {
      if (a.given("micro-batch-tokens") || rc["micro-batch-tokens"].present()) kept["layout"].erase("micro-batch");
      if (batching == "documents") kept["layout"].erase("global-batch");
    }
    const JsonField layout = JsonField(kept, a.str("plan"))["layout"];
    for (const char* key : {"run-config", "plan"})  // (read before the plan: it would do nothing)
      ORIGAMI_CHECK(!layout.present() || !layout[key].present(), layout[key].where(), ": names a file of options, "
                    "which a plan's layout cannot (it is read first): give --", key, " on the command line");
    a.fill_from_json(layout);
  }
  if (a.has("run-config")) {
    // Read before this file, they cannot come from it: an error, not a key that does nothing.
    for (const char* key : {"run-config", "plan"})
      ORIGAMI_CHECK(!rc[key].present(), rc[key].where(), ": names a file of options, which a run config cannot "
                    "(it is read first): give --", key, " on the command line");
    a.fill_from_json(rc);
  }
}

// Every rank starts from the same step: rank 0 resolves a --save directory (a run still saving into
// it may commit a newer step while the ranks start) to the step it holds, and the others take it.
void pin_checkpoint_step(TrainOptions& o, Comm& world) {
  // First a step that a crash left out of sight in --save (ckpt/checkpoint_writer.h) is put back.
  check_on_every_rank(world, "train", [&] {
    if (world.rank() == 0 && !o.save.empty() && std::filesystem::is_directory(o.save)) restore_replaced_steps(o.save);
  });
  for (std::string* from : {&o.resume, &o.init_from}) {
    std::vector<char> step(4096, 0);  // (a path; PATH_MAX)
    check_on_every_rank(world, "train", [&] {
      if (world.rank() != 0 || from->empty() || !Checkpoint::committed_in(*from)) return;
      const std::string s = Checkpoint::resolved(*from);
      ORIGAMI_CHECK(s.size() < step.size(), "checkpoint path '", s, "' is longer than ", step.size() - 1, " bytes");
      std::copy(s.begin(), s.end(), step.begin());
    });
    world.broadcast(step.data(), int64_t(step.size() / 4), DType::i32, 0);  // (the bytes, as 1024 int32s)
    if (step[0] != 0) *from = step.data();
  }
}

// A plan lays out one model: the config `origami plan --out` recorded (its fields that change the math)
// must be the run's; a plan file without it (written before plans named their model) passes. A run
// with other threads a rank than the plan priced is told its figures differ.
void check_plan_model(const std::string& path, const ModelConfig& cfg, int threads, bool speak) {
  const nlohmann::json plan = read_json_file(path, "plan");
  const JsonField fields(plan, path);
  if (fields["model"].present()) {
    const nlohmann::json planned = fields["model"].object().json(), mine = cfg.math_fields();
    const std::string type = planned.value("model_type", std::string("?"));
    ORIGAMI_CHECK(type == cfg.model_type(), "--plan ", path, " was made for a ", type, " model, and this run's is a ",
                  cfg.model_type(), ": plan it with this run's --config");
    nlohmann::json keys = planned;
    keys.update(mine);
    for (const auto& [key, unused] : keys.items()) {
      if (plan_neutral_field(key)) continue;
      const auto a = planned.find(key), b = mine.find(key);
      const bool absent_a = a == planned.end() || a->is_null(), absent_b = b == mine.end();  // (null: absent)
      const bool same = absent_a ? absent_b : !absent_b && *a == *b;
      ORIGAMI_CHECK(same, "--plan ", path, " was made for another model: its config's '", key, "' is ",
                    absent_a ? std::string("not given") : a->dump(), ", and this run's (",
                    cfg.model_type(), ") is ", absent_b ? std::string("not given") : b->dump(),
                    ": plan it with this run's --config");
    }
  }
  const int64_t priced = fields["threads_per_rank"].integer_or(threads, 1, JsonField::kNoLimit);
  if (speak && priced != threads)
    std::fprintf(stderr, "origami train: warning: --plan %s priced %lld thread%s a rank (its cluster file's), and this "
                 "run has %d: its memory and step time differ from the plan's\n", path.c_str(), (long long)priced,
                 priced == 1 ? "" : "s", threads);
}

// --config, else the config.json of the checkpoint the run resumes or starts from.
std::string model_config_path(const Args& a, const TrainOptions& o) {
  std::string config = a.str("config");
  if (config.empty() && !(o.resume.empty() && o.init_from.empty()) && !o.fresh_start())
    config = Checkpoint::config_of(o.resume.empty() ? o.init_from : o.resume);
  ORIGAMI_CHECK(!config.empty(), "no model config: give --config config.json (see --help)");
  return config;
}

}  // namespace

std::optional<TrainCommand> parse_train_options(int argc, char** argv, Comm& world, int ranks) {
  Args a("train",
         "Train a gpt2, llama, mixtral or qwen2_moe model (Hugging Face config.json) on a dataset made by\n"
         "'origami data prepare'. Keys of a --run-config JSON file are these options without '--';\n"
         "options given on the command line win.");
  add_input_options(a);
  add_optimizer_options(a);
  add_run_options(a);
  add_parallel_options(a);
  add_routing_options(a, true);
  bool parsed = false;
  TrainCommand cmd;
  check_on_every_rank(world, "train", [&] {
    if (!(parsed = a.parse(argc, argv))) return;
    fill_from_files(a, ranks > 0 ? ranks : world.size());
    TrainOptions& o = cmd.options;
    read_input_options(a, o);
    read_optimizer_options(a, o);
    read_run_options(a, o);
    read_parallel_options(a, o);
    read_routing_options(a, o, true);
    // Rank 0 writes these: checked there before anything starts (a mistake found once the model is
    // built would be one rank's failure, which origami launch would retry).
    if (world.rank() == 0 && !o.metrics.empty()) require_writable_file(o.metrics, a.source("metrics"));
    if (world.rank() == 0 && !o.tensorboard.empty()) require_writable_dir(o.tensorboard, a.source("tensorboard"));
  });
  if (!parsed) return std::nullopt;
  pin_checkpoint_step(cmd.options, world);
  check_on_every_rank(world, "train", [&] {
    cmd.cfg = load_model_config(model_config_path(a, cmd.options));
    if (a.has("plan"))  // (first: the cause of what follows)
      check_plan_model(a.str("plan"), cmd.cfg, cmd.options.threads > 0 ? cmd.options.threads : num_threads(),
                       world.rank() == 0);
    require_experts_for_given(a, cmd.cfg, true);
  });
  return cmd;
}

namespace {

int train(int argc, char** argv, Comm& world) {
  const std::optional<TrainCommand> cmd = parse_train_options(argc, argv, world);
  return cmd ? run_training(cmd->cfg, cmd->options, world) : 0;
}

}  // namespace

// Under mpirun every rank runs this. Mistakes found before training starts are reported once, by
// check_on_every_rank, and every rank exits 1; an error on one rank during training prints that rank's
// message and aborts the whole job (MPI_Abort) with exit code 2, so no rank is left waiting in a
// collective and `origami launch` restarts it (an error on every rank, 1, it does not).
int cmd_train(int argc, char** argv) {
  CommRuntime runtime(&argc, &argv);
  Comm& world = runtime.world();
  if (world.rank() != 0 && !std::freopen("/dev/null", "w", stdout))  // one rank speaks
    std::fprintf(stderr, "rank %d: cannot silence stdout\n", world.rank());
  try {
    return train(argc, argv, world);
  } catch (const ErrorReported&) {
    throw;
  } catch (const std::exception& e) {
    if (!runtime.distributed()) throw;
    abort_for_rank_error("train", world, e);  // (2: 1 means every rank reported a user error)
  }
}

}  // namespace origami
