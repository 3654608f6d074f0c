#include "train/trainer.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <filesystem>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <tuple>
#include <sys/resource.h>

#include "ckpt/checkpoint.h"
#include "comm/mpi_comm.h"
#include "ckpt/checkpoint_writer.h"
#include "core/error.h"
#include "core/files.h"
#include "core/json_fields.h"
#include "core/memory.h"
#include "core/progress.h"
#include "core/stop_signals.h"
#include "core/timer.h"
#include "data/blend.h"
#include "data/documents.h"
#include "data/sampler.h"
#include "data/tokenizer.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_bf16.h"
#include "model/model.h"
#include "model/params.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "parallel/pipeline.h"
#include "plan/cluster.h"
#include "train/measure.h"
#include "train/balance.h"
#include "train/comm_volume.h"
#include "train/memory_check.h"
#include "train/memory_plan.h"
#include "train/metrics.h"
#include "train/tensorboard.h"
#include "train/plan.h"
#include "train/test_hooks.h"

namespace origami {

namespace {

// One parameter set of this rank with its gradient reduction and optimizer: the dense tensors on the
// attention mesh (TP shards, reduced over DP) or the routed experts on the MoE mesh (ETP shards of
// this EP rank's experts, reduced over EDP). A dense model's expert set is empty.
struct ParamSet {
  Params params;
  DataParallel dp;
  AdamW opt;
  ParamSet(std::vector<ParamSpec> table, const TrainOptions& o, Comm& dp_group, Comm& tp_group, bool sequence_parallel,
           Comm* embedding, bool experts, const std::vector<LayerRange>& chunks)
      : params(std::move(table), o.param_layout(tp_group.size(), tp_group.rank(), dp_group.size(), experts)),
        dp(params, dp_group, tp_group, o.zero_of(experts), sequence_parallel, embedding, o.grad_reduce_wire(),
           experts && o.fssdp(), o.fssdp_keep, parse_precision(o.precision) == Precision::bf16, chunks),
        opt(params, o.adam, dp.owned(), dp.copy_written_by_update()) {}
};

// This rank's two parameter sets: its pipeline stage's part of the model (its chunks of layers), the
// TP shard and DP buckets of its dense tensors (gradients summed over DP x CP, each CP rank its
// tokens'), and its experts (EP) with their ETP shard and EDP buckets.
struct StageParams {
  ParamSet dense, experts;
  StageParams(const Plan& plan, const ModelPart& part, Mesh& mesh, Comm* embedding)
      : StageParams(split_experts(make_param_table(plan.model, part), plan.model.num_experts, mesh.comm("ep").size(),
                                  mesh.comm("ep").rank()),
                    plan.options, mesh, part.embedding != part.head ? embedding : nullptr, part.chunks) {}
  std::array<ParamSet*, 2> sets() { return {&dense, &experts}; }

 private:
  StageParams(SplitTable tables, const TrainOptions& o, Mesh& mesh, Comm* embedding,
              const std::vector<LayerRange>& chunks)
      : dense(std::move(tables.dense), o, mesh.comm("dp-cp"), mesh.comm("tp"), o.sequence_parallel, embedding, false,
              chunks),
        experts(std::move(tables.experts), o, mesh.comm("edp"), mesh.comm("etp"), false, nullptr, true, chunks) {}
};

// The run's inputs, opened on every rank and checked before any communication: the training data
// (its tokenizer against the model's vocabulary), the validation data and the checkpoint to start
// from (against the model). Completes the plan's model config with the end-of-document id of
// --attention-mask document (the data's tokenizer names it).
struct Inputs {
  std::optional<DataBlend> data, eval_data;  // the training data and the validation data (if any)
  std::optional<DocumentBatcher> docs, eval_docs;  // --batching documents: their sequences, step by step
  std::optional<StepSizes> step_sizes;              // the training data's, stretch by stretch (run_step_sizes)
  std::optional<Checkpoint> checkpoint;      // --resume or --init-from
  bool fresh_start = false;                  // --resume DIR --save DIR before DIR holds a checkpoint
};

// The balancer's FLOP-count estimate: 6 per matmul parameter and token (a), and the attention's
// 6·L·H·D per token pair (b): 12·H·D a pair and layer forward and backward, over the n²/2 pairs a
// causal sequence computes (train_flops_per_token's convention).
SequenceCost flop_cost(const ModelConfig& cfg) {
  const double a = train_flops_per_token(cfg, 0);
  return {a, train_flops_per_token(cfg, 1) - a};
}

// --balance-costs measure: a and b in seconds, timed on every rank at once (as the run will share the
// cores), rank 0's figures on every rank (they size the estimated busy time the metrics report; the
// placement itself depends on the lengths and FLOP weights alone, train/balance.h, so every rank
// computes the same one).
//   a  the FLOPs per token over the rate of the model's layer GEMMs on a micro-batch's local rows (at
//      most 512; no dimension above 4096, so a large vocabulary's LM head is timed on a slice of it)
//      plus the attention core's per-token part α
//   b  the attention core's per-pair part β: from the core on one row of T = min(L, 2048) tokens as
//      one causal sequence, t1 = α·T + β·T², and as documents of n = 64 tokens (one score tile
//      each), t2 = α·T + β·n·T
// (α and β per layer, times the layers; the model's heads, unsplit: TP divides GEMMs and heads alike).
// `flops` is the FLOP-count estimate; b keeps its ratio to a where the window is too short to tell
// β from α (L < 2n) or noise leaves β ≤ 0.
SequenceCost measured_sequence_cost(Comm& world, const ModelConfig& cfg, const TrainOptions& o, SequenceCost flops) {
  const Precision p = parse_precision(o.precision);
  const double seconds = 0.05;  // per measurement: the whole takes a few seconds at most
  const int64_t rows = std::min<int64_t>(o.micro_batch * (o.seq_len / std::max(o.cp, 1)), 512), most = 4096;
  double gemm_flops = 0, gemm_s = 0;
  for (GemmShape s : model_gemm_shapes(cfg, 1, rows)) {
    s.M = std::min(s.M, most), s.N = std::min(s.N, most), s.K = std::min(s.K, most);
    gemm_flops += s.flops(), gemm_s += time_gemm(world, s, p, seconds);
  }
  const int64_t T = std::min<int64_t>(o.seq_len, 2048), n = 64;
  auto attention = [&](int64_t doc_len) {
    return time_attention(world, T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, doc_len, p, seconds);
  };
  double alpha = 0, beta = 0;
  if (T >= 2 * n) {
    const double one = attention(0), docs = attention(n);
    beta = (one - docs) / (double(T) * double(T - n));
    if (beta > 0) alpha = std::max(docs - beta * double(n) * double(T), 0.0) / double(T);
  }
  const double L = double(cfg.num_layers);
  double ab[2] = {flops.a / (gemm_flops / gemm_s) + L * alpha, 0};
  ab[1] = beta > 0 ? L * beta : ab[0] * flops.b / flops.a;
  world.broadcast(ab, 2, DType::f64, 0);
  return {ab[0], ab[1]};
}

// The balancer's estimate c(n) = a·n + b·n² of a sequence of n tokens, by --balance-costs:
//   flops    its FLOPs (flop_cost)
//   measure  seconds timed here at start (measured_sequence_cost)
//   FILE     seconds at a cluster.json's rates in the run's precision: a over its GEMM rate for a
//            micro-batch's local rows by the hidden size, square; b over its attention rate at L (the
//            same convention: a causal window's 6·T²·H·D, `origami profile`).
SequenceCost sequence_cost(Comm& world, const ModelConfig& cfg, const TrainOptions& o) {
  const SequenceCost flops = flop_cost(cfg);
  if (o.balance_costs == "flops") return flops;
  if (o.balance_costs == "measure") return measured_sequence_cost(world, cfg, o, flops);
  const Cluster c = Cluster::load(o.balance_costs).at(o.precision);  // (TrainOptions::validate read it)
  const double rows = double(o.micro_batch * (o.seq_len / std::max(o.cp, 1))), C = double(cfg.hidden);
  return {flops.a / c.gemm_rate(rows, C, C), flops.b / c.attention_rate(double(o.seq_len), double(cfg.head_dim))};
}

// Document batching over the blend's datasets, with its weights (data/documents.h), N of each stretch.
DocumentBatcher document_batcher(const DataBlend& data, const TrainOptions& o, SampleOrder order, StepSizes sizes) {
  std::vector<const IndexedDataset*> datasets;
  std::vector<double> weights;
  for (size_t d = 0; d < data.parts().size(); ++d) datasets.push_back(&data.dataset(d)), weights.push_back(data.parts()[d].weight);
  return DocumentBatcher(datasets, weights, o.seq_len, std::move(sizes), order, o.seed);
}

// The step size of each stretch of the run (data/step_sizes.h): a resume continues the checkpoint's
// stretches (from a checkpoint older than them, the one size its options give) with this run's size
// from its step, so the data position is where the trained run left it. Across batchings, or from
// --init-from, this run's size from step 0: the position is replayed under it.
StepSizes run_step_sizes(const TrainOptions& o, const Checkpoint* ck) {
  const int64_t now = o.documents() ? o.tokens_per_step : o.global_batch;
  if (!ck || o.resume.empty()) return StepSizes(now);
  const int64_t step = ck->state().step;
  const JsonField options = JsonField(ck->trainer_state(), ck->path() + " (trainer state)")["options"];
  if (options["batching"].string_or("windows") != o.batching) return StepSizes(now);
  if (ck->state().step_sizes) return ck->state().step_sizes->resumed(step, now);
  const int64_t was = options[o.documents() ? "tokens_per_step" : "global_batch"].integer_or(0, 0, kMaxBatch);
  return StepSizes(was > 0 ? was : now).resumed(step, now);
}

Inputs open_inputs(Plan& plan) {
  const TrainOptions& o = plan.options;
  ModelConfig& cfg = plan.model;
  Inputs in;
  const std::vector<BlendPart> parts = parse_blend(o.data, "--data");
  const int64_t windows = o.documents() ? 0 : o.seq_len;  // (document batching reads whole documents)
  in.data.emplace(parts, windows, parse_sample_order(o.data_order), o.seed, "--data");
  const std::string& tokenizer_path = in.data->tokenizer_path();
  std::unique_ptr<Tokenizer> tok;
  if (!tokenizer_path.empty()) {
    tok = load_tokenizer_file(tokenizer_path);
    ORIGAMI_CHECK(tok->vocab_size() <= cfg.vocab_size, "the dataset's tokenizer (", tokenizer_path, ") has ",
                  tok->vocab_size(), " tokens but the model's vocab_size is ", cfg.vocab_size);
  }
  if (!o.eval_data.empty()) {
    // The validation windows (sequences), in order: the first eval_iters × G samples (steps), none read twice.
    in.eval_data.emplace(parse_blend(o.eval_data, "--eval-data"), windows, SampleOrder::sequential, o.seed,
                         "--eval-data");
    in.data->require_same_tokenizer(*in.eval_data, cat("--data '", o.data, "' and --eval-data '", o.eval_data, "'"));
    if (!o.documents())
      in.eval_data->require_no_repeat(o.eval_iters * o.global_batch,
                                      cat("--eval-data: an evaluation (--eval-iters x global batch = ", o.eval_iters,
                                          " x ", o.global_batch, "; lower --eval-iters or give more validation data)"));
    else if (in.eval_docs = document_batcher(*in.eval_data, o, SampleOrder::sequential, StepSizes(o.tokens_per_step));
             in.eval_docs->repeats(o.eval_iters))
      fail("--eval-data: an evaluation (--eval-iters x --tokens-per-step = ", o.eval_iters, " x ", o.tokens_per_step,
           " tokens) reads some document twice; lower --eval-iters or give more validation data");
  }
  if (parse_attention_mask(o.attention_mask)) cfg.document_eod = document_eod(cfg, tok.get(), parts[0].prefix);
  cfg.packed_sequences = o.documents();
  o.check_save_dir();
  in.fresh_start = o.fresh_start();
  const std::string& from = o.resume.empty() ? o.init_from : o.resume;
  if (!from.empty() && !in.fresh_start) {  // the checkpoint to start from, checked against the model
    in.checkpoint = Checkpoint::open(from);
    in.checkpoint->bind(cfg);
    ORIGAMI_CHECK(o.resume.empty() || in.checkpoint->has_optimizer(), "--resume '", o.resume, "' (",
                  in.checkpoint->path(), ") holds weights only, no optimizer state or step: start from it with "
                  "--init-from");
    // A resumed run continues on the same token ids (a blend or --eval-data across tokenizers is refused alike).
    const std::string saved = in.checkpoint->path() + "/tokenizer.json";
    ORIGAMI_CHECK(o.resume.empty() || in.data->tokenizer().is_null() || !std::filesystem::exists(saved) ||
                      same_tokenizer_file(parse_json_file(saved), in.data->tokenizer()),
                  "--resume '", o.resume, "' trained on another tokenizer (", saved, ") than --data's (",
                  in.data->tokenizer_path(), "); to train its weights on this data, start from them with --init-from");
  }
  in.step_sizes = run_step_sizes(o, in.checkpoint ? &*in.checkpoint : nullptr);
  if (o.documents()) in.docs = document_batcher(*in.data, o, parse_sample_order(o.data_order), *in.step_sizes);
  return in;
}

// Where the run starts: step 0 with the parameters initialised from the seed, or the checkpoint's
// weights (--init-from) and, with --resume, its AdamW moments, step and router biases.
struct StartState {
  int64_t step = 0;
  int64_t skipped_steps = 0, last_update = 0;   // the resumed run's (Checkpoint::TrainerState)
  std::vector<double> recent_losses;            // the same
  std::vector<std::vector<float>> router_bias;  // the router's selection biases of a resumed checkpoint
  double load_s = 0;                            // reading (and checking) the checkpoint: the slowest rank's
  std::string checkpoint;                       // the checkpoint's path ("" at step 0)
};

// A resume continues the run: options that change what it learns from, or in what order, are worth a
// word when changed (stderr, rank 0). `was`: the checkpoint's options (TrainOptions::as_json, with the
// aux loss coefficient in effect: Run::save); `cfg`: this run's model with its routing options.
void warn_changed_options(const nlohmann::json& was, const TrainOptions& o, const ModelConfig& cfg,
                          const std::string& path) {
  // (key, flag, value now, value of a checkpoint written before the key existed; null: none)
  using Option = std::tuple<const char*, const char*, nlohmann::json, nlohmann::json>;
  std::vector<Option> options = {
      {"attention_mask", "--attention-mask", o.attention_mask, "causal"}, {"data", "--data", o.data, ""},
      {"batching", "--batching", o.batching, "windows"}, {"precision", "--precision", o.precision, "fp32"},
      // the learning rate and the data order: the steps from here are not the uninterrupted run's
      {"lr", "--lr", o.lr.lr, nullptr}, {"min_lr", "--min-lr", o.lr.min_lr, nullptr},
      {"warmup", "--warmup", o.lr.warmup, nullptr},
      {"lr_schedule", "--lr-schedule", o.lr.schedule == LrSchedule::cosine ? "cosine" : "constant", nullptr},
      {"seed", "--seed", o.seed, nullptr}, {"data_order", "--data-order", o.data_order, nullptr},
      // the optimizer, the gradients' reduction and the router: the updates from here are not its
      {"weight_decay", "--weight-decay", o.adam.weight_decay, nullptr}, {"beta1", "--beta1", o.adam.beta1, nullptr},
      {"beta2", "--beta2", o.adam.beta2, nullptr}, {"eps", "--eps", o.adam.eps, nullptr},
      {"grad_clip", "--grad-clip", o.grad_clip, nullptr}, {"grad_reduce_dtype", "--grad-reduce-dtype", o.grad_reduce_dtype, nullptr}};
  // (a checkpoint written before the coefficient in effect was saved holds -1 for the config's: unknown)
  const bool coef_known = was.contains("moe_aux_loss_coef") && was["moe_aux_loss_coef"].is_number() &&
                          was["moe_aux_loss_coef"].get<double>() >= 0;
  if (cfg.is_moe()) {
    options.insert(options.end(),
                   {{"moe_aux_loss", "--moe-aux-loss", o.aux_loss(), nullptr},
                    {"moe_router_score", "--moe-router-score", o.moe_router_score, nullptr},
                    {"moe_router_bias_update_rate", "--moe-router-bias-update-rate", o.moe_router_bias_update_rate, nullptr},
                    {"moe_capacity_factor", "--moe-capacity-factor", o.moe_capacity_factor, nullptr},
                    {"moe_drop_policy", "--moe-drop-policy", o.moe_drop_policy, nullptr}});
    if (coef_known) options.push_back({"moe_aux_loss_coef", "--moe-aux-loss-coef", cfg.routing.aux_coef, nullptr});
  }
  if (o.lr.schedule == LrSchedule::cosine)  // the cosine spans --steps
    options.push_back({"steps", "--steps (the cosine schedule's length)", o.steps, nullptr});
  // The step size, within one batching (across two, the batching's own warning says it all): the data
  // continue where the checkpoint left them (run_step_sizes), but the steps from here are not the
  // uninterrupted run's; L changes what a window or a piece of a document is.
  const bool same_batching = (was.contains("batching") && was["batching"].is_string()
                                  ? was["batching"].get<std::string>() : std::string("windows")) == o.batching;
  if (o.documents() && same_batching)
    options.insert(options.end(), {{"tokens_per_step", "--tokens-per-step", o.tokens_per_step, 0},
                                   {"seq_len", "--seq-len", o.seq_len, o.seq_len}});
  else if (same_batching)  // (given: without it the run keeps the checkpoint's, with_checkpoint_step_size)
    options.insert(options.end(), {{"global_batch", "--global-batch", o.global_batch, o.global_batch},
                                   {"seq_len", "--seq-len", o.seq_len, o.seq_len}});
  auto text = [](const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
  for (const auto& [key, flag, now, old] : options) {
    const nlohmann::json before = was.contains(key) ? was[key] : old;
    if (!before.is_null() && before != now)
      std::fprintf(stderr, "origami train: warning: resuming with %s '%s'; '%s' trained with '%s'\n", flag,
                   text(now).c_str(), path.c_str(), text(before).c_str());
  }
}

// A resume continues the checkpoint's model: a --config of the same shapes (bind refuses others) that
// changes its math (RoPE's base, a norm's epsilon, top-k, ...) is worth a word. Its initialisation
// does not matter any more; the aux loss coefficient in effect is warn_changed_options' to compare.
void warn_changed_model(const std::string& saved_config, const ModelConfig& cfg, const std::string& path) {
  if (saved_config.empty()) return;
  const nlohmann::json was = ModelConfig::model_math_fields(parse_json_file(saved_config)),
                       now = cfg.math_fields();
  nlohmann::json keys = was;
  keys.update(now);
  for (const auto& [key, unused] : keys.items()) {
    if (key == "initializer_range" || key == "router_aux_loss_coef") continue;
    const nlohmann::json before = was.value(key, nlohmann::json()), after = now.value(key, nlohmann::json());
    const auto text = [](const nlohmann::json& v) { return v.is_null() ? std::string("(not given)") : v.dump(); };
    if (before != after)
      std::fprintf(stderr, "origami train: warning: resuming with --config's '%s' = %s; '%s' trained with '%s' = %s\n",
                   key.c_str(), text(after).c_str(), path.c_str(), key.c_str(), text(before).c_str());
  }
}

// Each dataset of a blend with its tokens and documents, kept in trainer_state.json: a resume tells a
// dataset prepared again at the same prefix, on which the data position the checkpoint's steps reach
// reads other data.
nlohmann::json data_sizes(const DataBlend& data) {
  nlohmann::json out = nlohmann::json::array();
  for (size_t d = 0; d < data.parts().size(); ++d)
    out.push_back({{"prefix", data.parts()[d].prefix}, {"tokens", data.dataset(d).num_tokens()},
                   {"documents", data.dataset(d).num_documents()}});
  return out;
}

// Dataset by dataset of the blend (its position, however its prefix is spelled); a blend of another
// size is another --data, which warn_changed_options names.
void warn_changed_data(const std::vector<std::pair<int64_t, int64_t>>& was, const DataBlend& data,
                       const std::string& path) {
  if (was.size() != data.parts().size()) return;
  for (size_t d = 0; d < was.size(); ++d) {
    const auto now = std::pair{int64_t(data.dataset(d).num_tokens()), int64_t(data.dataset(d).num_documents())};
    if (now != was[d])
      std::fprintf(stderr, "origami train: warning: resuming on data '%s' of %lld tokens and %lld documents; '%s' "
                   "trained on %lld tokens and %lld documents there: the data position its steps reach "
                   "reads other data\n", data.parts()[d].prefix.c_str(), (long long)now.first, (long long)now.second,
                   path.c_str(), (long long)was[d].first, (long long)was[d].second);
  }
}

// The checkpoint is unmapped once read: a later --keep-last removal of that step then frees its disk space.
StartState start_state(Inputs& in, const std::array<ParamSet*, 2>& sets, const Plan& plan, Comm& world) {
  const TrainOptions& o = plan.options;
  StartState start;
  Checkpoint* ck = in.checkpoint ? &*in.checkpoint : nullptr;
  if (!ck) {
    for (ParamSet* set : sets) set->params.init(o.seed, plan.model.num_layers, plan.model.init_std);
    return start;
  }
  // Every rank reads only its own shards (any layout wrote them) and checks the checksums of its
  // share of the files; a damaged or missing file is one message and every rank exits 1.
  Timer load_timer;
  if (world.rank() == 0) ck->warn_fallback(o.resume.empty() ? o.init_from : o.resume, "train");
  check_on_every_rank(world, "train", [&] {
    ck->verify_checksums(world.rank(), world.size());
    for (ParamSet* set : sets) ck->read_weights(set->params);
    if (o.resume.empty()) return;
    const nlohmann::json& st = ck->trainer_state();  // its fields checked when the checkpoint was opened
    for (ParamSet* set : sets) {
      const ParamLayout& lay = set->params.layout();
      for (size_t i = 0; i < set->opt.segments().size(); ++i) {
        const Segment& seg = set->opt.segments()[i];
        const int64_t at = set->params.offset(seg.param);
        const ParamSpec& spec = set->params.table()[seg.param];
        ck->read(StateKind::exp_avg, spec, lay.tp, lay.tp_rank, seg.begin - at, seg.end - at, set->opt.exp_avg(i));
        ck->read(StateKind::exp_avg_sq, spec, lay.tp, lay.tp_rank, seg.begin - at, seg.end - at, set->opt.exp_avg_sq(i));
      }
      set->opt.set_steps_taken(ck->state().adam_steps);
    }
    start.step = ck->state().step;
    start.skipped_steps = ck->state().skipped_steps, start.last_update = ck->state().last_update;
    start.recent_losses = ck->state().recent_losses;
    if (world.rank() == 0 && st.contains("options") && st["options"].is_object())
      warn_changed_options(st["options"], o, plan.model, ck->path());
    if (world.rank() == 0) warn_changed_model(ck->config_path(), plan.model, ck->path());
    if (world.rank() == 0 && !o.resume.empty()) warn_changed_data(ck->state().data_sizes, *in.data, ck->path());
    start.router_bias = ck->state().router_bias;
    ORIGAMI_CHECK(start.step < o.steps, "checkpoint '", ck->path(), "' is already at step ", start.step,
                  "; ask for more --steps to continue");
  });
  start.load_s = world.all_reduce_value(load_timer.ms() / 1000.0, ReduceOp::max);
  start.checkpoint = ck->path();
  in.checkpoint.reset();
  return start;
}

int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return int64_t(u.ru_maxrss) * 1024;  // Linux reports KiB
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// What a run opens first, on every rank and before any communication, so that a mistake in any is one
// message: the validated plan, the inputs it reads and the test hooks.
struct Opened {
  Plan plan;
  Inputs in;
  TestHooks hooks;
};

// Every rank opened the datasets on its own (a node-local copy each, perhaps): they must hold the same
// tokens and documents as rank 0's, else the ranks would train on different data or, under document
// batching, pack their steps differently and stop matching each other's collectives; and under
// --attention-mask document end their documents at the same token (each rank's from its own copy's
// tokenizer file, or the config's eos_token_id where a copy has none).
void require_same_data(const Inputs& in, const ModelConfig& model, Comm& world) {
  std::vector<std::pair<const DataBlend*, const char*>> blends = {{&*in.data, "--data"}};
  if (in.eval_data) blends.push_back({&*in.eval_data, "--eval-data"});
  std::vector<int64_t> mine = {model.document_eod};
  for (const auto& [blend, option] : blends)
    for (size_t d = 0; d < blend->parts().size(); ++d)
      mine.insert(mine.end(), {int64_t(blend->dataset(d).num_tokens()), int64_t(blend->dataset(d).num_documents())});
  std::vector<int64_t> first = mine;
  world.broadcast(first.data(), int64_t(first.size()), DType::i64, 0);
  check_on_every_rank(world, "train", [&] {
    ORIGAMI_CHECK(mine[0] == first[0], "--attention-mask document: rank ", world.rank(), " ends documents at token ",
                  mine[0], ", rank 0 at ", first[0], " (each takes it from its copy of '", in.data->parts()[0].prefix,
                  "'s tokenizer file, else the config's eos_token_id): every rank must read the same tokenizer file");
    size_t at = 1;
    for (const auto& [blend, option] : blends)
      for (size_t d = 0; d < blend->parts().size(); ++d, at += 2)
        ORIGAMI_CHECK(mine[at] == first[at] && mine[at + 1] == first[at + 1], option, ": rank ", world.rank(),
                      "'s copy of '", blend->parts()[d].prefix, "' holds ", mine[at], " tokens in ", mine[at + 1],
                      " documents, rank 0's ", first[at], " in ", first[at + 1], ": every rank must read the same data");
  });
}

Opened open_run(const ModelConfig& cfg, const TrainOptions& opts, Comm& world) {
  std::optional<Plan> plan;
  Inputs in;
  TestHooks hooks;
  check_on_every_rank(world, "train", [&] {
    std::string note;
    plan.emplace(make_resumed_plan(cfg, opts, world.size(), &note));
    if (!note.empty() && world.rank() == 0) std::fprintf(stderr, "origami train: %s\n", note.c_str());
    in = open_inputs(*plan);
    hooks = TestHooks::from_env(world.rank(), plan->model.is_moe());
    check_tile_gemm_env();
    check_bf16_gemm_env();
  });
  require_same_data(in, plan->model, world);
  return {std::move(*plan), std::move(in), std::move(hooks)};
}

// The timed kernel choices that fix an order of summation, the same on every rank: attention's tiles'
// library and, in bf16, its tiles' and the small GEMMs' paths. Rank 0's, so that the job's processes
// sum alike; on a resume, each choice the checkpoint kept where the environment forces none, so that
// the run sums as the one that saved it (a timing near its threshold can flip between runs).
void agree_on_kernels(const Plan& plan, const Inputs& in, Comm& world) {
  const bool bf16 = plan.precision == Precision::bf16, auto_bf16 = bf16_gemm_mode() == Bf16GemmMode::automatic;
  const Checkpoint::TrainerState* kept =
      world.rank() == 0 && !plan.options.resume.empty() && in.checkpoint ? &in.checkpoint->state() : nullptr;
  // Pairs of (choice, whether the checkpoint's): the tiles' library, bf16 tiles, bf16 small GEMMs.
  int32_t c[6] = {int32_t(tile_gemm_library()), 0, 0, 0, 0, 0};
  if (kept && kept->attention_tiles && !tile_gemm_forced()) c[0] = *kept->attention_tiles, c[1] = 1;
  if (bf16) {
    c[2] = int32_t(bf16_tiles());
    if (kept && kept->bf16_tiles && auto_bf16) c[2] = *kept->bf16_tiles, c[3] = 1;
    if (kept && kept->bf16_small_gemms && auto_bf16) c[4] = *kept->bf16_small_gemms, c[5] = 1;
    else c[4] = world.rank() == 0 && bf16_small_gemms_onednn();  // timed on rank 0 alone: the others take its answer
  }
  world.broadcast(c, 6, DType::i32, 0);
  const auto from = [](int32_t kept_flag) { return kept_flag ? ChoiceFrom::checkpoint : ChoiceFrom::rank0; };
  set_tile_gemm_library(TileGemm(c[0]), from(c[1]));
  if (!bf16) return;
  set_bf16_tiles(Bf16Tiles(c[2]), from(c[3]));
  set_bf16_small_gemms_onednn(c[4] != 0);
  // The timed shapes' paths: each rank its own under the saving run's world size, else rank 0's.
  const std::vector<std::vector<KeptBf16Gemm>>* gemms =
      auto_bf16 && !plan.options.resume.empty() && in.checkpoint ? &in.checkpoint->state().bf16_gemms : nullptr;
  if (gemms && !gemms->empty())
    keep_bf16_gemms((*gemms)[int(gemms->size()) == world.size() ? size_t(world.rank()) : 0]);
}

// trainer_state.json's "kernels": the choices above as this run made them, for a resume to keep.
nlohmann::json kept_kernels(Precision precision) {
  using State = Checkpoint::TrainerState;  // (the names a resume reads back)
  nlohmann::json k = nlohmann::json::object();
  if (const auto tiles = tile_gemm_to_keep()) k["attention_tiles"] = State::kAttentionTiles[int(*tiles)];
  if (precision != Precision::bf16) return k;
  k["bf16_tiles"] = State::kBf16Tiles[int(bf16_tiles())];
  if (const auto small = bf16_small_gemms_to_keep()) k["bf16_small_gemms"] = State::kBf16SmallGemms[int(*small)];
  return k;
}

// Every rank's timed bf16 GEMM paths (gemm_bf16.h), rank by rank, for trainer_state.json's "kernels"
// (null where no rank has one): an all-gather over the world, at a save.
nlohmann::json gathered_bf16_gemms(Comm& world) {
  constexpr int64_t kFields = 12;  // ta, tb, M, N, K, lda, ldb, ldc, alpha's and beta's bits, path, bias
  std::vector<int64_t> mine, counts(size_t(world.size()));
  auto bits = [](float x) { return int64_t(std::bit_cast<uint32_t>(x)); };
  for (const KeptBf16Gemm& k : bf16_gemms_to_keep())
    mine.insert(mine.end(),
                {k.ta, k.tb, k.M, k.N, k.K, k.lda, k.ldb, k.ldc, bits(k.alpha), bits(k.beta), int64_t(k.path), k.bias});
  const int64_t n = int64_t(mine.size());
  world.all_gather(counts.data(), &n, 1, DType::i64);
  std::vector<int64_t> all(size_t(std::accumulate(counts.begin(), counts.end(), int64_t(0))));
  if (all.empty()) return nullptr;
  world.all_gather_v(all.data(), mine.data(), counts.data(), DType::i64);
  nlohmann::json ranks = nlohmann::json::array();
  const int64_t* g = all.data();
  for (int64_t count : counts) {
    nlohmann::json& list = ranks.emplace_back(nlohmann::json::array());
    for (const int64_t* end = g + count; g < end; g += kFields) {
      nlohmann::json& shape = list.emplace_back(nlohmann::json{
          {"trans", std::string(g[0] ? "t" : "n") + (g[1] ? "t" : "n")}, {"mnk", {g[2], g[3], g[4]}},
          {"ld", {g[5], g[6], g[7]}}, {"alpha", std::bit_cast<float>(uint32_t(g[8]))},
          {"beta", std::bit_cast<float>(uint32_t(g[9]))},
          {"path", Checkpoint::TrainerState::kBf16GemmPaths[size_t(g[10])]}});
      if (g[11]) shape["bias"] = true;  // (absent: none, as checkpoints saved before the bias epilogue)
    }
  }
  return ranks;
}

// The memory check; the libraries' thread pools and buffers are set up first, so that the check
// measures them as the runtime part.
MemoryCheck check_run_memory(const Plan& plan, const Inputs& in, Comm& world) {
  const TrainOptions& o = plan.options;
  use_threads(o.threads, "train", world.rank() == 0);
  warm_up_gemm();
  agree_on_kernels(plan, in, world);
  const int64_t data_bytes =
      in.data->bytes(o.global_batch) + (in.eval_data ? in.eval_data->bytes(o.eval_iters * o.global_batch) : 0) +
      (in.docs ? in.docs->bytes() : 0) + (in.eval_docs ? in.eval_docs->bytes() : 0);
  return check_memory(plan, data_bytes, world);
}

// The tied embedding's gradient is summed over the first and last stage (a group of 2; the middle
// stages form groups of their own, unused).
std::unique_ptr<Comm> embedding_group(Comm& pp) {
  if (pp.size() == 1) return nullptr;
  const int stage = pp.rank();
  return pp.split(stage == 0 || stage == pp.size() - 1 ? 0 : 1, stage, "embedding");
}

// --grad-reduce-dtype bf16 with a gradient reduction to apply it to (a DP x CP or EDP group of several ranks).
// Whether a gradient group has more than one rank: the dense tensors' DP x CP, an MoE model's experts' EDP
// (ZeRO shards over them, --grad-reduce-dtype sets what they send).
bool reduces_gradients(const Plan& plan) {
  const MeshDims& d = plan.mesh.dims();
  return d.dp * d.cp > 1 || (plan.model.is_moe() && d.edp > 1);
}

bool reduces_in_bf16(const Plan& plan) {
  return plan.options.grad_reduce_wire() == DType::bf16 && reduces_gradients(plan);
}

// The layout in words: in the startup line, every metrics row and every checkpoint's metadata.
std::string describe_layout(const Plan& plan, const ContextParallel& cp) {
  const TrainOptions& o = plan.options;
  const MeshDims& dims = plan.mesh.dims();
  std::string name = plan.mesh.describe(plan.model.is_moe()) + (o.sequence_parallel && dims.tp > 1 ? " +SP" : "") +
                     (o.zero > 0 && reduces_gradients(plan) ? " ZeRO-" + std::to_string(o.zero) : "");
  if (o.fssdp()) name += o.fssdp_keep ? " FSSDP keep" : " FSSDP";
  if (dims.cp > 1) name += cat(" cp ", cp.describe(plan.model.num_kv_heads / dims.tp));
  if (dims.pp > 1) name += cat(" ", schedule_kind_name(plan.schedule), o.vpp > 1 ? cat(" v", o.vpp) : "");
  if (dims.pp > 1 && o.vocab_parallel) name += " vocab-parallel";
  if (plan.recompute != Recompute::none) name += cat(" recompute ", recompute_name(plan.recompute));
  if (plan.precision != Precision::fp32) name += cat(" ", precision_name(plan.precision));
  if (reduces_in_bf16(plan)) name += " grad-reduce bf16";
  return name;
}

// A training run, built from its Plan in the order its members are listed (run_training's comment
// gives it in words), with a step, an evaluation and a save as methods.
class Run {
 public:
  Run(Opened opened, Comm& world);
  int64_t start_step() const { return start_.step; }
  // One step (step + 1 steps done after it): 0 to go on, else the run's exit code.
  int step(int64_t step, StopSignals& signals);
  // After the loop: an asynchronous save still being written is committed (collective).
  void finish_saving();
  // Then, after the last collective: the skipped steps' warning (and the test hook of a failure as
  // step --steps + 1).
  void finish(int exit_code);

 private:
  struct Update {  // what the step's forward, backward and optimizer did
    Losses sum;
    Gradients grads;
    double lr;
    std::vector<int64_t> samples;  // the step's rows from each dataset
    int64_t micro = 0;             // micro-batches per DP rank
    bool no_targets = false;       // document batching: every sequence of the step is one token (it predicts none)
    bool skip() const { return !grads.finite(); }
    bool updated() const { return !skip() && !no_targets; }
  };
  void restore_router_bias();
  std::string describe_batch() const;
  std::string describe_costs() const;
  std::vector<double> estimated_seconds(std::vector<double> cost) const;
  void print_startup() const;
  void open_writer();
  ContextParallel& cp() { return model_.context_parallel(); }
  void size_rows(int64_t micro);
  void read_rows(DataBlend& data, int64_t first_row);
  DocumentStep read_sequences(DocumentBatcher& docs, int64_t step);
  std::vector<Model::CpLevel> cp_levels();
  Update train(int64_t step);
  StepFigures figures(int64_t step, const Update& up, double cpu0, bool stop);
  std::string report_skip(const Update& up, double loss, int64_t done) const;
  void take_measurements(StepReport& r);
  void validate(StepReport& r);
  double evaluate();
  double save(int64_t steps_done);
  bool save_due(int64_t steps_done) const;
  void plan_save_interval(double save_s);
  double non_finite_sets() const;
  std::vector<SavePiece> owned_pieces();
  void write_metrics(StepReport& r);
  int exit_code(const StepReport& r, bool too_many_skips, bool broken) const;

  Comm& world_;
  // 1. Plan and inputs (and the test hooks).
  Plan plan_;
  Inputs in_;
  TestHooks hooks_;
  const TrainOptions& o_ = plan_.options;
  const ModelConfig& cfg_ = plan_.model;
  const bool rank0_ = world_.rank() == 0;
  // 2. Memory check.
  MemoryCheck memory_;
  // 3. Mesh: the attention and MoE meshes over the same ranks.
  Mesh mesh_;
  Comm& tp_ = mesh_.comm("tp");
  Comm& dp_ = mesh_.comm("dp");       // data rows: CP ranks read the same windows
  Comm& grad_ = mesh_.comm("dp-cp");  // dense gradients: summed over DP and CP (each CP rank its tokens')
  Comm& pp_ = mesh_.comm("pp");
  std::unique_ptr<Comm> embedding_comm_ = embedding_group(pp_);
  // 4. Parameters, 5. start state.
  const ModelPart part_ = plan_.part(pp_.rank());
  StageParams params_;
  StartState start_;
  // 6. Model and pipeline.
  Model model_;
  Pipeline pipeline_;
  // 7. Report.
  RunInfo info_;
  double flops_per_token_ = 0;
  CpCounters cp_counters_;      // the step's, over every CP degree (take_measurements)
  SequenceCost sequence_cost_;  // document batching: the balancer's estimate a·n + b·n² (--balance-costs)
  MetricsFile metrics_;
  TensorBoardWriter tensorboard_;
  // 8. Checkpoints.
  std::optional<CheckpointWriter> writer_;
  int64_t last_saved_ = -1;
  static constexpr int64_t kAutoSaveFirst = 10;  // --save-every auto: the first save, after this many steps
  int64_t save_every_ = o_.save_every;  // --save-every auto: 0 until the first save has been timed
  std::vector<double> step_ms_;         // --save-every auto: the steps' times before that save
  // 9. The step loop's state: this DP rank's rows of a step, in micro-batches.
  std::vector<int32_t> tokens_;
  std::vector<const int32_t*> micro_tokens_;
  DocumentStep doc_step_;  // document batching: the step's sequences
  Timer run_timer_;
  int64_t current_step_ = 0;                 // the step being computed (from 1), for the gradient hook
  int64_t buffers_counted_ = 0;              // the memory check's pipeline message buffers (pipeline_message_buffers)
  bool warned_buffers_ = false;              // figures(): a step allocated more than those
  int64_t skipped_ = 0, last_update_ = 0;    // steps skipped for a non-finite loss or gradient; last step updated
  LossSpikes spikes_{o_.loss_spike_factor};  // rank 0
};

// MoE layers route every token of TP x CP once: the counts behind the router's load-balancing loss are
// summed over that group (and for the global-batch loss also over DP: the whole stage).
Run::Run(Opened opened, Comm& world)
    : world_(world),
      plan_(std::move(opened.plan)),
      in_(std::move(opened.in)),
      hooks_(std::move(opened.hooks)),
      memory_(check_run_memory(plan_, in_, world)),
      mesh_(world, plan_.mesh),
      params_(plan_, part_, mesh_, embedding_comm_.get()),
      start_(start_state(in_, params_.sets(), plan_, world)),
      model_(cfg_, params_.dense.params, TensorParallel(tp_, o_.sequence_parallel), part_, plan_.recompute,
             {&params_.experts.params, TokenDispatcher(mesh_.comm("tp-cp"), dp_, mesh_.comm("ep"), mesh_.comm("etp"))},
             ContextParallel(mesh_.comm("cp"), plan_.cp_comm, plan_.cp_a2a)),
      pipeline_(model_, pp_, {&params_.dense.dp, &params_.experts.dp}, plan_.schedule, int(plan_.micro_batches),
                o_.vpp) {
  restore_router_bias();
  hooks_.skew_router(model_.router_bias(), cfg_.num_layers, cfg_.num_experts);
  if (hooks_.slows_backward()) pipeline_.before_backward([this] { hooks_.slow_backward(); });
  buffers_counted_ = pipeline_message_buffers(o_, pp_.size(), pp_.rank(), int(o_.micro_batches(world.size())),
                                              part_.vocab_parallel());
  model_.on_grads_ready([this](int64_t offset, int64_t expert_offset) {
    hooks_.poison_gradient(current_step_, params_.dense.params.grad() + offset);
    params_.dense.dp.grads_ready(offset);
    params_.experts.dp.grads_ready(expert_offset);
  });
  if (o_.zero == 3)  // each unit's parameters gathered over its group when the model reads them
    model_.on_weights([this](WeightUse use, const Model::WeightUnit& unit) {
      params_.dense.dp.use_weights(use, unit.dense);
      params_.experts.dp.use_weights(use, unit.experts);  // not under FSSDP: its own gathers follow
    });
  if (o_.fssdp())  // each MoE layer's experts gathered over EDP after routing, only those its rows reach
    model_.on_experts([this](ExpertUse use, const ExpertBlocks& x, const std::vector<int32_t>& need) {
      DataParallel& dp = params_.experts.dp;
      if (use == ExpertUse::gather) return dp.gather_experts(x, need);
      dp.reduce_experts(x, need);
      return ExpertPlace{};
    });
  model_.set_precision(plan_.precision);  // (after on_experts: FSSDP's experts keep no bf16 copy)
  if (o_.cp_per_sequence() && cp().size() > 1) model_.set_cp_levels(cp_levels());
  info_ = {describe_layout(plan_, cp()), o_.steps, o_.documents() ? o_.tokens_per_step : o_.global_batch * o_.seq_len,
           cfg_.is_moe(), o_.quiet, &plan_.mesh};
  flops_per_token_ = train_flops_per_token(cfg_, o_.seq_len);
  if (o_.documents()) sequence_cost_ = sequence_cost(world_, cfg_, o_);
  if (rank0_ && !o_.metrics.empty()) metrics_ = MetricsFile(o_.metrics, start_.step > 0, "metrics file", start_.step);
  if (rank0_ && !o_.tensorboard.empty()) tensorboard_ = TensorBoardWriter(o_.tensorboard, start_.step);
  if (rank0_) print_startup();
  open_writer();
  if (!o_.documents()) size_rows(plan_.micro_batches);
  // --max-skipped-steps counts the whole run's skips, across resumes.
  skipped_ = start_.skipped_steps, last_update_ = start_.last_update;
  spikes_.restore(start_.recent_losses);
  run_timer_.reset();
}

// A resumed run routes with the biases it saved (and updates them with a rate).
void Run::restore_router_bias() {
  if (start_.router_bias.empty()) return;
  model_.set_router_bias(start_.router_bias, cat("'", start_.checkpoint, "/trainer_state.json'"));
}

// How a step is made: windows (the global batch) or packed documents.
std::string Run::describe_batch() const {
  const int64_t G = o_.global_batch, micro = plan_.micro_batches;
  if (!in_.docs)
    return cat(in_.data->describe(), " | global batch ", G, plan_.default_global_batch ? " (default: micro-batch x DP)" : "",
               " = ", micro, " accumulation step", micro == 1 ? "" : "s", " x micro-batch ", o_.micro_batch, " x DP ",
               dp_.size());
  return cat(o_.data, ": ", in_.data->num_tokens(), " tokens, ", in_.docs->num_documents(), " documents | steps of at "
             "most ", o_.tokens_per_step, " tokens of whole documents (cut at ", o_.seq_len, "), packed into rows of ",
             o_.seq_len, ", micro-batches of ", o_.micro_batch, " row", o_.micro_batch == 1 ? "" : "s", " x DP ",
             dp_.size(), " (balance ", o_.balance, ", ", describe_costs(), ")");
}

// The packing's cost per worker in seconds per rank (each worker's work split over world / workers
// ranks), where the costs are seconds; else empty.
std::vector<double> Run::estimated_seconds(std::vector<double> cost) const {
  if (o_.balance_costs == "flops") return {};
  for (double& c : cost) c /= double(world_.size()) / double(cost.size());
  return cost;
}

// The balancer's costs, as --balance-costs gave them.
std::string Run::describe_costs() const {
  if (o_.balance_costs == "flops") return "costs: FLOPs";
  char per[96];
  std::snprintf(per, sizeof per, "%.4g ns a token + %.4g ps a token pair", sequence_cost_.a * 1e9,
                sequence_cost_.b * 1e12);
  if (o_.balance_costs != "measure") return "costs at " + o_.balance_costs + "'s rates: " + per;
  const SequenceCost f = flop_cost(cfg_);  // measured_sequence_cost's fallback for b, the same expression
  const bool ratio = sequence_cost_.b == sequence_cost_.a * f.b / f.a;
  return std::string("costs measured here: ") + per +
         (ratio ? " (b at the FLOP counts' ratio to a: the window is too short, or the timing too noisy, to "
                  "tell it)" : " (b from the attention core)");
}

void Run::print_startup() const {
  const int64_t G = o_.global_batch;
  std::printf("origami train: %s, %lld parameters, %lld layers | data %s | %s, %d threads per rank\n",
              cfg_.model_type().c_str(), (long long)num_parameters(cfg_), (long long)cfg_.num_layers,
              describe_batch().c_str(), info_.layout.c_str(), num_threads());
  std::printf("memory: %s per rank at most (rank %zu; %s)\n",
              format_bytes(double(memory_.parts[memory_.neediest].total())).c_str(), memory_.neediest,
              memory_.budget.c_str());
  if (o_.verbose)
    for (size_t r = 0; r < memory_.parts.size(); ++r)
      std::printf("memory of rank %zu: %s; total %s\n", r, memory_.parts[r].describe().c_str(),
                  format_bytes(double(memory_.parts[r].total())).c_str());
  if (pp_.size() > 1) {
    std::printf("pipeline stages (layers per chunk):");
    for (int s = 0; s < pp_.size(); ++s) {
      std::printf(" %d:", s);
      for (const LayerRange& r : plan_.part(s).chunks) std::printf(" [%d,%d)", r.begin, r.end);
    }
    std::printf("\n");
  }
  if (in_.eval_data)
    std::printf("validation: %s | %s %s\n",
                in_.eval_docs ? cat(o_.eval_data, ": ", in_.eval_data->num_tokens(), " tokens, ",
                                    in_.eval_docs->num_documents(), " documents").c_str()
                              : in_.eval_data->describe().c_str(),
                in_.eval_docs ? cat("its first ", o_.eval_iters, " steps of documents").c_str()
                              : cat(o_.eval_iters * G, " windows (", o_.eval_iters, " x global batch)").c_str(),
                o_.eval_every > 0 ? cat("every ", o_.eval_every, " steps and after the last").c_str() : "after the last step");
  if (in_.eval_data)
    for (const std::string& shared : in_.data->shared_datasets(*in_.eval_data))
      std::fprintf(stderr, "origami train: warning: --eval-data '%s' is also training data (--data): its validation "
                   "loss measures text the model trains on\n", shared.c_str());
  std::printf("%s\n", describe_tile_gemm().c_str());
  if (plan_.precision == Precision::bf16)
    std::printf("precision: bf16 GEMMs with fp32 accumulation, fp32 master weights, gradients and optimizer state "
                "| %s | %s\n", describe_bf16_gemm().c_str(), describe_bf16_tiles().c_str());
  const char* no_group = "no DP or CP group (nor, in an MoE model, EDP group) has more than one rank";
  if (plan_.options.grad_reduce_wire() == DType::bf16 && !reduces_in_bf16(plan_))
    std::fprintf(stderr, "origami train: warning: --grad-reduce-dtype bf16 changes nothing here: %s, so no gradient "
                 "is reduced\n", no_group);
  if (o_.zero > 0 && !reduces_gradients(plan_))
    std::fprintf(stderr, "origami train: warning: --zero %d changes nothing here: %s, so nothing is sharded\n",
                 o_.zero, no_group);
  // Options this layout gives nothing to do: accepted (a run config may serve several layouts), and said.
  for (const auto& [idle, what] : {std::pair{o_.sequence_parallel && tp_.size() == 1, "--sequence-parallel (--tp is 1)"},
                                   std::pair{o_.cp_comm != "p2p" && o_.cp == 1, "--cp-comm (--cp is 1)"},
                                   std::pair{!o_.pp_schedule.empty() && pp_.size() == 1, "--pp-schedule (--pp is 1)"}})
    if (idle) std::fprintf(stderr, "origami train: warning: %s changes nothing here\n", what);
  if (o_.fssdp() && mesh_.degree("edp") == 1)  // (origami plan never proposes it)
    std::fprintf(stderr, "origami train: warning: --expert-sharding fssdp has one expert-data-parallel rank here: "
                 "nothing is sharded, and each layer's experts are copied to and from a staging area at every use\n");
  if (cfg_.document_eod >= 0)
    std::printf("attention within documents: token %d ends a document (positions restart after it)\n", cfg_.document_eod);
  const std::string& ck = start_.checkpoint;
  if (in_.fresh_start) std::printf("no checkpoint in '%s' yet: starting at step 0\n", o_.resume.c_str());
  if (!ck.empty() && !o_.resume.empty())
    std::printf("resuming from '%s' at step %lld (read in %.2f s)\n", ck.c_str(), (long long)start_.step, start_.load_s);
  else if (!ck.empty())
    std::printf("weights from '%s' (read in %.2f s)\n", ck.c_str(), start_.load_s);
  if (const std::string hooks = hooks_.describe(); !hooks.empty()) std::printf("%s\n", hooks.c_str());
  std::fflush(stdout);
}

// Checkpoints: every rank writes the pieces it owns (ckpt/checkpoint_writer.h), in place or, with
// --async-save, from a host copy while the next steps run (allocated once here: the memory check
// counted it).
void Run::open_writer() {
  if (o_.save.empty()) return;
  writer_.emplace(world_, "train", o_.save, o_.keep_last, o_.async_save,
                  rank0_ ? make_param_table(cfg_) : std::vector<ParamSpec>{});
  if (!o_.async_save) return;
  int64_t floats = 0;
  for (const SavePiece& p : owned_pieces()) floats += p.end - p.begin;
  writer_->reserve(floats);
}

// What this rank writes: the owner rule over its dense tensors (replicated over DP x CP) and its
// experts (over EDP); only the first stage writes the tied embedding.
std::vector<SavePiece> Run::owned_pieces() {
  std::vector<SavePiece> pieces;
  Comm& edp = mesh_.comm("edp");
  add_owned_pieces(params_.dense.params, params_.dense.opt, grad_.size(), grad_.rank(), part_.embedding, pieces);
  add_owned_pieces(params_.experts.params, params_.experts.opt, edp.size(), edp.rank(), true, pieces);
  return pieces;
}

// Room for `micro` micro-batches of B rows (ModelConfig::row_stride int32s each; of the longest
// rows under document batching, where a lone micro-batch's are shorter).
void Run::size_rows(int64_t micro) {
  const int64_t row = o_.micro_batch * cfg_.row_stride(o_.seq_len);
  tokens_.resize(size_t(micro * row));
  micro_tokens_.clear();
  for (int64_t m = 0; m < micro; ++m) micro_tokens_.push_back(tokens_.data() + m * row);
}

// One packed row of `len` tokens at `out`: its sequences' tokens, then their targets (each sequence's
// next tokens, −1 after its last one, kPaddingTarget on the padding).
void write_row(DocumentBatcher& docs, const std::vector<Sequence>& seqs, const std::vector<int32_t>& row, int64_t len,
               int32_t* out) {
  int32_t* target = out + len;
  int64_t at = 0;
  for (const int32_t i : row) {
    const int64_t n = seqs[size_t(i)].length;
    docs.read(seqs[size_t(i)], out + at);
    std::copy(out + at + 1, out + at + n, target + at);
    target[at + n - 1] = -1;
    at += n;
  }
  std::fill(out + at, out + len, 0);
  std::fill(target + at, target + len, kPaddingTarget);
}

// Document batching: step `step`'s sequences packed into rows (train/balance.h) and this rank's rows
// written to tokens_, micro-batch m at m·B rows of 2T. Every rank packs the whole step alike, so none
// needs to hear from another. With a CP degree per sequence, micro-batch m holds rows of d·T/C tokens,
// d its degree (Model::set_cp_degrees), at the same offsets.
DocumentStep Run::read_sequences(DocumentBatcher& docs, int64_t step) {
  const std::vector<Sequence>& seqs = docs.step(step);
  DocumentStep d;
  std::vector<int64_t> lengths;
  if (docs.num_parts() > 1) d.dataset_tokens.assign(docs.num_parts(), 0);
  for (const Sequence& q : seqs) {
    lengths.push_back(q.length), d.tokens += q.length, d.predicted += q.length - 1;
    if (docs.num_parts() > 1) d.dataset_tokens[size_t(q.part)] += q.length;
    d.flops += train_flops_per_token(cfg_, q.length) * double(q.length);  // the FLOP convention, per sequence
  }
  const int64_t T = o_.seq_len, B = o_.micro_batch, per = plan_.schedule == ScheduleKind::interleaved ? pp_.size() : 1;
  const Balance balance = parse_balance(o_.balance);
  d.sequences = int64_t(seqs.size());
  auto fill = [&](const Rows& rows, auto&& row_len) {  // B rows per micro-batch m, each of row_len(m) tokens
    for (int64_t r = 0; r < int64_t(rows.size()); ++r) {
      const int64_t m = r / B, len = row_len(m);
      write_row(docs, seqs, rows[size_t(r)], len, tokens_.data() + m * B * 2 * T + (r % B) * 2 * len);
    }
  };
  if (!o_.cp_per_sequence() || cp().size() == 1) {
    const Packing packing = pack_sequences(lengths, dp_.size(), T, B * per, balance, sequence_cost_);
    d.micro_batches = packing.rows / B, d.estimated_imbalance = packing.imbalance(), d.estimated_bound = packing.bound;
    d.estimated_s = estimated_seconds(packing.cost);
    d.over_group = cp().size() > 1 ? int64_t(seqs.size()) : 0;
    size_rows(d.micro_batches);
    fill(packing.ranks[size_t(dp_.rank())], [T](int64_t) { return T; });
    return d;
  }
  const int C = cp().size();
  const CpPacking packing = pack_sequences_cp(lengths, dp_.size(), C, T, B, per, balance, sequence_cost_, flop_cost(cfg_));
  d.micro_batches = packing.micro, d.estimated_imbalance = packing.imbalance(), d.estimated_bound = packing.bound;
  d.estimated_s = estimated_seconds(packing.cost);
  d.over_group = std::accumulate(packing.sequences.begin() + 1, packing.sequences.end(), int64_t(0));
  size_rows(d.micro_batches);
  const size_t me = size_t(dp_.rank() * C + cp().rank());
  const std::vector<int>& degree = packing.degree[me];
  fill(packing.ranks[me], [&](int64_t m) { return degree[size_t(m)] * (T / C); });
  const std::vector<int> degrees = cp_degrees(C);
  for (size_t l = 0; l < degrees.size(); ++l) {  // rank 0's micro-batches (its traffic is the one predicted)
    d.cp_degrees.emplace_back(degrees[l], packing.sequences[l]);
    d.degree_micro.emplace_back(degrees[l], std::count(packing.degree[0].begin(), packing.degree[0].end(), degrees[l]));
  }
  model_.set_cp_degrees(degree);
  return d;
}

// The CP degrees below the group's for a degree per sequence: each over the aligned subgroups of its
// size (Model::CpLevel), with its all-to-all groups as large as both the run's and the degree allow.
std::vector<Model::CpLevel> Run::cp_levels() {
  Comm &group = mesh_.comm("cp"), &tokens = mesh_.comm("tp-cp");
  const int C = group.size(), r = group.rank();
  std::vector<Model::CpLevel> levels;
  for (const int d : cp_degrees(C)) {
    if (d == C) continue;
    std::unique_ptr<Comm> sub = group.split(r / d, r, cat("cp", d));
    levels.push_back({d, d == 1 ? ContextParallel() : ContextParallel(*sub, plan_.cp_comm, std::gcd(plan_.cp_a2a, d)),
                      tokens.split(r / d, tokens.rank(), cat("tp-cp", d)), {}});
  }
  return levels;
}

// This DP rank's rows from `first_row` on, read by every pipeline stage (the first embeds them, the
// last takes its targets from them).
void Run::read_rows(DataBlend& data, int64_t first_row) {
  const int64_t T = o_.seq_len;
  for (int64_t r = 0; r < plan_.micro_batches * o_.micro_batch; ++r)
    data.window(first_row + r, tokens_.data() + r * (T + 1));
}

// Forward and backward over the step's micro-batches, the gradients' reduction and, when they are
// finite, the update. Non-finite guard: every rank learns from the norm's own all-reduce whether any
// rank's loss or gradients were not finite, and then all skip the update together.
Run::Update Run::train(int64_t step) {
  const int64_t G = o_.global_batch;
  const int dp = dp_.size();
  mesh_.reset_bytes();
  model_.reset_attention_counters();
  Update up;
  const int64_t first = in_.step_sizes->before(step);  // (windows: the step's first sample)
  if (in_.data->parts().size() > 1 && !in_.docs) up.samples = in_.data->samples_per_dataset(first, G);
  if (embedding_comm_) embedding_comm_->reset_bytes();
  up.lr = lr_at(o_.lr, step);
  up.micro = plan_.micro_batches;
  if (in_.docs) {
    doc_step_ = read_sequences(*in_.docs, step);
    up.micro = doc_step_.micro_batches;
    up.no_targets = doc_step_.predicted == 0;
    // With the micro-batches' weight 1/(micro·dp) below, the step's loss is the mean over its predicted tokens.
    model_.set_loss_tokens(double(std::max<int64_t>(1, doc_step_.predicted)) / double(up.micro * dp),
                           double(doc_step_.tokens) / double(up.micro * dp));
  } else {
    read_rows(*in_.data, first + dp_.rank() * (G / dp));
  }
  for (ParamSet* set : params_.sets()) set->dp.begin_step();
  model_.reset_expert_counts();
  model_.reset_act_peak();
  // Each micro-batch's loss enters the step's objective with weight 1/(G/B) (a mean over all of them).
  current_step_ = step + 1;
  up.sum = pipeline_.run(micro_tokens_, o_.micro_batch, o_.seq_len, 1.f / float(up.micro * dp));
  up.grads = finish_gradients({&params_.dense.dp, &params_.experts.dp}, world_, up.sum.loss);
  if (up.skip()) {
    ++skipped_;
    return up;
  }
  if (up.no_targets) return up;  // nothing to learn from: no update (the step still counts; not against
                                 // --max-skipped-steps, which counts non-finite steps)
  for (ParamSet* set : params_.sets()) {
    set->opt.step(set->params, up.lr, clip_coefficient(up.grads.norm, o_.grad_clip));
    set->dp.gather_params();  // and the GEMMs' bf16 copy of the updated weights
  }
  last_update_ = step + 1;
  return up;
}

// The step's figures over the job (metrics.h): the LM loss and per-stage figures from one rank per TP
// group (its peers hold the same values) — per-stage ones from DP rank 0 only —; the router losses and
// expert counts from every rank (each TP rank routes its own share of the tokens); CPU time and, for
// MoE, the expert-side rows from every rank; the stop flag (any rank signalled). The loss parts come
// from the stages that own them.
StepFigures Run::figures(int64_t step, const Update& up, double cpu0, bool stop) {
  const Losses& sum = up.sum;
  const double micro_dp = double(up.micro * dp_.size());
  const double weight = tp_.rank() == 0 ? 1.0 : 0.0, per = weight / micro_dp, share_per = 1.0 / micro_dp;
  const double stage_weight = grad_.rank() == 0 ? weight : 0.0;  // DP and CP rank 0
  StepFigures f;
  f.lm_loss = sum.lm_loss * per, f.aux_loss = sum.aux_loss * share_per, f.z_loss = sum.z_loss * share_per;
  f.cpu_s = cpu_seconds() - cpu0;
  f.stop = stop;
  f.expert_tokens = model_.expert_counts();
  f.expert_dropped = model_.expert_dropped();
  f.expert_near_ties = model_.expert_near_ties();
  hooks_.log_routing(step + 1, model_.expert_counts());
  const size_t ranks = size_t(world_.size()), rank = size_t(world_.rank());
  if (cfg_.is_moe()) {
    f.expert_rows.assign(ranks, 0), f.expert_rows[rank] = model_.expert_rows();
    f.expert_busiest.assign(ranks, 0), f.expert_busiest[rank] = model_.expert_busiest_rows();
  }
  if (cp().size() > 1) f.cp_pairs.assign(ranks, 0), f.cp_pairs[rank] = model_.cp_counters().pairs;
  if (o_.zero == 3 || o_.fssdp()) {
    f.gathered_bytes.assign(ranks, 0.0), f.reduced_bytes.assign(ranks, 0.0);
    for (ParamSet* set : params_.sets())
      f.gathered_bytes[rank] += set->dp.traffic().gathered_bytes, f.reduced_bytes[rank] += set->dp.traffic().reduced_bytes;
  }
  if (o_.fssdp()) f.expert_gathers.assign(ranks, 0), f.expert_gathers[rank] = params_.experts.dp.traffic().expert_gathers;
  const size_t stages = size_t(pp_.size()), stage = size_t(pp_.rank());
  const PipelineTimes& times = pipeline_.times();
  if (in_.docs) f.rank_busy_s.assign(ranks, 0.0), f.rank_busy_s[rank] = times.busy;
  if (part_.vocab_parallel()) f.vocab_s.assign(stages, 0.0), f.vocab_s[stage] = times.vocab * stage_weight;
  const double act_computed = double(memory_.parts[rank].activations);
  for (auto [v, mine] : {std::pair{&f.act_peak, double(model_.act_bytes_peak())}, std::pair{&f.act_computed, act_computed},
                         std::pair{&f.busy_s, times.busy}, std::pair{&f.total_s, times.total},
                         std::pair{&f.pp_bytes, pp_.bytes_sent()}, std::pair{&f.rss_peak, double(peak_rss_bytes())},
                         std::pair{&f.pp_buffers, double(times.message_buffers)}}) {
    v->assign(stages, 0.0);
    (*v)[stage] = mine * stage_weight;
  }
  const int64_t counted = buffers_counted_ + pipeline_.vocab_message_buffers();  // (the latter: this step's list)
  if (times.message_buffers > counted && !warned_buffers_ && stage_weight > 0) {
    warned_buffers_ = true;  // (once a run, from the stage's first rank)
    std::fprintf(stderr, "origami train: warning: rank %d: pipeline stage %zu allocated %lld message buffers in step %lld, "
                 "more than the %lld the memory check counted (a stage behind a slower one: Pipeline::buffer_bytes)\n",
                 world_.rank(), stage, (long long)times.message_buffers, (long long)step + 1, (long long)counted);
  }

  f.all_reduce(world_);
  return f;
}

// A skipped update: what was not finite, with a warning while the run goes on.
std::string Run::report_skip(const Update& up, double loss, int64_t done) const {
  const std::string what = non_finite_words(up.grads, loss);
  if (rank0_ && skipped_ <= o_.max_skipped_steps)
    std::fprintf(stderr, "origami train: warning: step %lld: %s; the update was skipped on every rank (%lld of at "
                 "most %lld skipped steps, --max-skipped-steps)\n", (long long)done, what.c_str(),
                 (long long)skipped_, (long long)o_.max_skipped_steps);
  return what;
}

int Run::step(int64_t step, StopSignals& signals) {
  if (writer_) writer_->poll();  // commits an asynchronous save every rank has finished writing
  hooks_.fail_once(step + 1, TestHooks::In::step);
  Timer step_timer;
  const double cpu0 = cpu_seconds();
  const Update up = train(step);
  StepFigures fig = figures(step, up, cpu0, signals.poll());
  // MoE: the aux-loss-free balancing's bias update from the step's load per expert over every rank.
  if (cfg_.routing.bias_rate > 0 && up.updated()) model_.update_router_bias(fig.expert_tokens);
  StepReport r;
  r.step = step + 1, r.fig = &fig, r.lr = up.lr, r.grad_norm = up.grads.norm, r.data_samples = up.samples;
  if (in_.docs) r.data_tokens = doc_step_.dataset_tokens;
  r.ms = step_timer.ms();
  r.tokens = in_.docs ? doc_step_.tokens : info_.tokens;
  if (in_.docs) r.documents = &doc_step_;
  r.gflops = (in_.docs ? doc_step_.flops : flops_per_token_ * double(r.tokens)) / (r.ms / 1000.0) / 1e9;
  r.eta_s = run_timer_.ms() / 1000.0 / double(r.step - start_.step) * double(o_.steps - r.step);
  if (rank0_) print_step_line(info_, r, !up.updated());
  if (rank0_ && up.updated()) r.loss_spike = spikes_.check(r.step, fig.loss());
  if (up.skip()) r.skipped = report_skip(up, fig.loss(), r.step);
  if (up.no_targets && !up.skip()) {
    r.skipped = "no token to predict: every sequence of the step is one token long";
    if (rank0_)
      std::fprintf(stderr, "origami train: warning: step %lld: %s; no update (a step can hold only one-token "
                   "sequences, empty documents or the one-token ends of cut ones, where more than --tokens-per-step "
                   "minus --seq-len of them come in a row)\n", (long long)r.step, r.skipped.c_str());
  }
  // A skip right after an update: if that update made the weights or moments non-finite (from finite
  // gradients: an --lr or --eps out of scale), no later step can recover (a skip keeps the weights).
  const bool broken = up.skip() && last_update_ == step && world_.all_reduce_value(non_finite_sets()) > 0;
  // Saves come before the step's metrics row, which records how long the loop was blocked.
  // (a step that skipped: a resume under a lower --max-skipped-steps than its count stops at its next skip)
  const bool too_many_skips = (up.skip() && skipped_ > o_.max_skipped_steps) || broken;
  if (fig.stop && rank0_) std::printf("stopping on signal after step %lld\n", (long long)r.step);
  if (o_.save_every_auto && save_every_ == 0) step_ms_.push_back(r.ms);
  take_measurements(r);  // (before a save, whose exchanges over the world are not the step's)
  // Validation after the step's own figures are taken (its forwards would add to them), and before its
  // save: a run that fails in it resumes from the save before and replays the step, row and all (saved
  // first, the step would resume past its row, never written). A stop saves first: its grace is short.
  const bool eval_due =
      in_.eval_data && !too_many_skips && (r.step == o_.steps || (o_.eval_every > 0 && r.step % o_.eval_every == 0));
  if (eval_due && !fig.stop) validate(r);
  if (writer_ && !too_many_skips && (fig.stop || r.step == o_.steps || save_due(r.step))) {
    r.save_blocked_s = save(r.step);
    // (a save refused for non-finite state, -1, ends the run: no interval from it)
    if (o_.save_every_auto && save_every_ == 0 && r.save_blocked_s >= 0) plan_save_interval(r.save_blocked_s);
  }
  if (eval_due && fig.stop) validate(r);
  if (metrics_ || tensorboard_) write_metrics(r);
  return exit_code(r, too_many_skips, broken);
}

// The step's communication and attention figures on this rank (rank 0's are reported).
void Run::take_measurements(StepReport& r) {
  r.comm_bytes = mesh_.bytes_sent();
  if (cp().size() > 1) r.comm_bytes["cp"] = model_.cp_bytes_sent(), r.cp = &(cp_counters_ = model_.cp_counters());
  if (model_.level_token_bytes() > 0) r.comm_bytes["tp-cp"] += model_.level_token_bytes();  // the subgroups' MoE counts
  if (embedding_comm_ && embedding_comm_->bytes_sent() > 0) r.comm_bytes["embedding"] = embedding_comm_->bytes_sent();
  r.attention_tiles = model_.attention_tiles();
  r.transfers_in_pieces = mpi_transfers_in_pieces();
  r.dispatch = model_.dispatch_times();
  r.moe_layer_s = model_.moe_layer_s();
  r.router_bias = &model_.router_bias();
}

// The step's validation loss, on its line and in its row.
void Run::validate(StepReport& r) {
  hooks_.fail_once(r.step, TestHooks::In::validation);
  Timer eval_timer;
  r.val_loss = evaluate();
  if (rank0_) print_eval_line(info_, r.step, *r.val_loss, eval_timer.ms());
}

// Validation: the mean per-token LM loss over the first eval_iters global batches of the validation
// data, rows split over DP as a training step's, forward only; the same reduction as the step's LM
// loss (one rank per TP group; the last stage's; each CP rank its part).
double Run::evaluate() {
  const int64_t G = o_.global_batch;
  const int dp = dp_.size();
  double sum = 0;
  if (in_.eval_docs) {  // the sum of every predicted token's loss, over their number
    int64_t predicted = 0;
    model_.set_loss_tokens(1, 1);
    for (int64_t k = 0; k < o_.eval_iters; ++k) {
      predicted += read_sequences(*in_.eval_docs, k).predicted;
      sum += pipeline_.evaluate(micro_tokens_, o_.micro_batch, o_.seq_len).lm_loss;
      progress_alive();  // (without TP or PP an evaluation has no collective until its end: not a hang)
    }
    const double total = world_.all_reduce_value(tp_.rank() == 0 ? sum : 0.0);
    if (predicted > 0) return total / double(predicted);
    if (rank0_)  // (a mean over no token: reported as NaN, null in the metrics row, never as a loss of 0)
      std::fprintf(stderr, "origami train: warning: validation has no token to predict: its first %lld step%s of "
                   "--eval-data hold only one-token sequences; no validation loss\n", (long long)o_.eval_iters,
                   o_.eval_iters == 1 ? "" : "s");
    return std::numeric_limits<double>::quiet_NaN();
  }
  for (int64_t k = 0; k < o_.eval_iters; ++k) {
    read_rows(*in_.eval_data, k * G + dp_.rank() * (G / dp));
    sum += pipeline_.evaluate(micro_tokens_, o_.micro_batch, o_.seq_len).lm_loss;
    progress_alive();
  }
  return world_.all_reduce_value(tp_.rank() == 0 ? sum / double(plan_.micro_batches * dp * o_.eval_iters) : 0.0);
}

// The parameter sets whose weights or AdamW moments hold a non-finite element on this rank.
double Run::non_finite_sets() const {
  double bad = 0;
  for (const ParamSet* set : {&params_.dense, &params_.experts}) {
    double sum = 0;  // x·0 is 0 for a finite element and NaN for a non-finite one
    const float* w = set->params.data();
#pragma omp parallel for simd reduction(+ : sum)
    for (int64_t i = 0; i < set->params.size(); ++i) sum += double(w[i]) * 0.0;
    for (size_t i = 0; i < set->opt.segments().size(); ++i) {
      const int64_t n = set->opt.segments()[i].end - set->opt.segments()[i].begin;
      const float *m = set->opt.exp_avg(i), *v = set->opt.exp_avg_sq(i);
#pragma omp parallel for simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) sum += double(m[j]) * 0.0 + double(v[j]) * 0.0;
    }
    bad += std::isfinite(sum) ? 0 : 1;
  }
  return bad;
}

// Returns the seconds the step loop was blocked, or -1, on every rank, when the state is not finite
// (an update from finite gradients can still overflow): nothing is written then.
double Run::save(int64_t steps_done) {
  if (world_.all_reduce_value(non_finite_sets()) > 0) {
    if (rank0_)
      std::fprintf(stderr, "origami train: error: step %lld: the weights or AdamW moments are not finite after the "
                   "update; not saving%s\n", (long long)steps_done,
                   last_saved_ >= 0 ? cat(" (", o_.save, " holds step ", last_saved_, ")").c_str() : "");
    return -1;
  }
  last_saved_ = steps_done;
  const nlohmann::json gemms = plan_.precision == Precision::bf16 ? gathered_bf16_gemms(world_) : nlohmann::json();
  std::map<std::string, std::string> files;
  if (rank0_) {
    nlohmann::json st = {{"step", steps_done},          {"adam_steps", params_.dense.opt.steps_taken()},
                         {"skipped_steps", skipped_}, {"last_update", last_update_},
                         {"recent_losses", spikes_.history()},
                         {"options", o_.as_json()}};
    if (cfg_.is_moe()) st["options"]["moe_aux_loss_coef"] = cfg_.routing.aux_coef;  // (the config's where not given)
    if (!model_.router_bias().empty()) st["router_bias"] = model_.router_bias();
    st["data_sizes"] = data_sizes(*in_.data);
    st["step_sizes"] = in_.step_sizes->stretches();  // [[first step, size], ...]
    st["kernels"] = kept_kernels(plan_.precision);
    if (!gemms.is_null()) st["kernels"]["bf16_gemms"] = gemms;  // [rank][shape]
    files["trainer_state.json"] = st.dump(2) + "\n";
    files["config.json"] = cfg_.raw.dump(2) + "\n";
    if (!in_.data->tokenizer_bytes().empty()) files["tokenizer.json"] = in_.data->tokenizer_bytes();
  }
  const MeshDims& dims = plan_.mesh.dims();
  const nlohmann::json layout = {{"world", world_.size()}, {"tp", dims.tp}, {"cp", dims.cp}, {"dp", dims.dp},
                                 {"pp", dims.pp}, {"vpp", o_.vpp}, {"ep", dims.ep}, {"etp", dims.etp},
                                 {"edp", dims.edp}, {"zero", o_.zero}, {"sequence_parallel", o_.sequence_parallel},
                                 {"description", info_.layout}};
  return writer_->save(steps_done, owned_pieces(), files, layout);
}

bool Run::save_due(int64_t steps_done) const {
  if (save_every_ > 0) return steps_done % save_every_ == 0;
  return o_.save_every_auto && steps_done == start_.step + kAutoSaveFirst;
}

// --save-every auto after its first save: Young's interval sqrt(2·δ·M) for a save blocking δ seconds
// and a mean time between failures M, in steps of the median step time so far (the largest over the
// ranks of both figures, so every rank takes the same interval).
void Run::plan_save_interval(double save_s) {
  std::vector<double> ms = step_ms_;
  std::nth_element(ms.begin(), ms.begin() + long(ms.size() / 2), ms.end());
  const double step_s = world_.all_reduce_value(ms[ms.size() / 2] / 1000, ReduceOp::max);
  const double delta = world_.all_reduce_value(save_s, ReduceOp::max), mtbf = o_.mtbf_hours * 3600;
  const double young = std::sqrt(2 * delta * mtbf);
  save_every_ = std::clamp<int64_t>(std::llround(young / step_s), 1, kMaxSteps);
  if (rank0_)
    std::printf("--save-every auto: every %lld steps (Young's interval sqrt(2 x %.4g s a save x %.4g h MTBF) = %.4g s, "
                "at %.4g s a step)\n", (long long)save_every_, delta, o_.mtbf_hours, young, step_s);
}

// Rank 0's row (to --metrics and --tensorboard); the run's first row also carries the memory check's figures and the planner's
// prediction of its comm_bytes.
void Run::write_metrics(StepReport& r) {
  r.rss_peak_bytes = peak_rss_bytes();
  if (r.step == start_.step + 1) {
    r.memory = &memory_;
    TrainOptions step = o_;  // document batching: the prediction for this step's micro-batches
    if (in_.docs) step.step_micro_batches = doc_step_.micro_batches, step.step_degree_micro_batches = doc_step_.degree_micro;
    r.comm_predicted = step_comm_bytes(cfg_, step, world_.size(), 0);
  }
  const nlohmann::json row = metrics_row(info_, r);
  ORIGAMI_CHECK(!metrics_ || metrics_.write(row), "writing the metrics file '", o_.metrics, "' failed (a full disk?)");
  if (tensorboard_) tensorboard_.write(row);
}

// Every rank takes the same branch: `skipped_` comes from the norm's all-reduce, the stop flag and the
// save's result from all-reduces too.
int Run::exit_code(const StepReport& r, bool too_many_skips, bool broken) const {
  if (broken) {
    if (rank0_)
      std::fprintf(stderr, "origami train: error: step %lld: the update of step %lld made the weights or AdamW moments "
                   "non-finite (its gradients were finite: --lr, --eps or --beta1/--beta2 out of scale?); stopping "
                   "without saving%s\n", (long long)r.step, (long long)last_update_,
                   last_saved_ >= 0 ? cat(" (", o_.save, " holds step ", last_saved_, ")").c_str() : "");
    return kExitNonFinite;
  }
  if (too_many_skips) {
    if (rank0_) {
      std::fprintf(stderr, "origami train: error: step %lld: %s; %lld skipped step%s exceed%s --max-skipped-steps %lld: "
                   "stopping without saving (%s%s)\n", (long long)r.step, r.skipped.c_str(), (long long)skipped_,
                   skipped_ == 1 ? "" : "s", skipped_ == 1 ? "s" : "", (long long)o_.max_skipped_steps,
                   last_update_ > 0 ? cat("the last update was step ", last_update_).c_str() : "no update was made",
                   last_saved_ >= 0 ? cat("; ", o_.save, " holds step ", last_saved_).c_str() : "");
      std::fflush(stderr);
    }
    return kExitNonFinite;
  }
  if (r.save_blocked_s < 0) return kExitNonFinite;
  if (r.fig->stop) return kExitSignal;
  return 0;
}

void Run::finish_saving() {
  if (writer_) writer_->finish();  // an asynchronous save still being written is committed before exit
}

void Run::finish(int exit_code) {
  if (exit_code == 0) hooks_.fail_once(o_.steps + 1, TestHooks::In::step);  // (a failure after the last step's save: its step is --steps + 1)
  if (rank0_ && skipped_ > 0 && exit_code != kExitNonFinite)
    std::fprintf(stderr, "origami train: warning: %lld step%s skipped for a non-finite loss or gradient norm%s\n",
                 (long long)skipped_, skipped_ == 1 ? " was" : "s were",
                 start_.step > 0 ? " (counted from the run's first step, across resumes)" : "");
}

}  // namespace

// A run is built in this order (the members of Run), each part from the Plan and the parts before it:
//   1. plan and inputs: make_plan validates the options against the model and the world size and
//      derives the layout, open_inputs opens and checks the data and the checkpoint — on every
//      rank, before any communication, so a mistake is one message;
//   2. memory check: every rank's needs against its node, before anything large is allocated;
//   3. mesh: the communicators of every axis group, and the tied embedding's;
//   4. parameters: this stage's part of the model, its dense tensors (TP shard, DP buckets) and its
//      experts (EP, ETP shard, EDP buckets), each set with its gradient reduction and its AdamW over
//      the elements this rank updates;
//   5. start state: the parameters initialised, or read from the checkpoint (with --resume also
//      the AdamW moments, the step and the router biases);
//   6. model and pipeline: the model over this stage's parameters and communicators, and the
//      stage's schedule;
//   7. report: the startup lines and the metrics file;
//   8. checkpoints: the writer and the pieces this rank saves;
//   9. the step loop (SIGINT/SIGTERM are taken at step boundaries: core/stop_signals.h).
int run_training(const ModelConfig& model_cfg, const TrainOptions& opts, Comm& world) {
  progress_join(world.rank());  // under origami launch: the watchdog's record of this rank
  Run run(open_run(model_cfg, opts, world), world);
  StopSignals stop_signals;
  int exit_code = 0;
  try {
    for (int64_t step = run.start_step(); step < opts.steps && exit_code == 0; ++step) {
      exit_code = run.step(step, stop_signals);
      progress_step_done(step + 1);
    }
    run.finish_saving();  // collective (the last save's commit): an error there ends the job as in a step
  } catch (const ErrorReported&) {
    throw;
  } catch (const std::exception& e) {
    // One rank's error in a step: the job ends here, while the run's buffers live (transfers in flight,
    // abandoned as the error left their scope, may still read or write them until the abort).
    if (world.size() == 1) throw;
    abort_for_rank_error("train", world, e);
  }
  // After the last collective the end is agreed: where finishing fails on one rank alone, that rank
  // does not abort the job while the others are in MPI_Finalize (a race in which Open MPI can stall
  // until the launcher's watchdog); every rank learns of it and they exit together with kExitRankFailed.
  int32_t failed = 0;
  try {
    run.finish(exit_code);
  } catch (const ErrorReported&) {
    throw;  // (reported once, on every rank)
  } catch (const std::exception& e) {
    if (world.size() == 1) throw;  // (no peers to tell: the command's own error path)
    report_rank_error("train", world, e);
    failed = 1;
  }
  return world.all_reduce_value(failed, ReduceOp::max) ? kExitRankFailed : exit_code;
}

void report_rank_error(const char* command, const Comm& world, const std::exception& e) {
  const bool oom = dynamic_cast<const std::bad_alloc*>(&e) != nullptr;
  std::fprintf(stderr, "origami %s: error (rank %d of %d): %s\n", command, world.rank(), world.size(),
               oom ? "out of memory (in an allocation outside the checked buffers)" : e.what());
  std::fflush(stderr);
}

void abort_for_rank_error(const char* command, const Comm& world, const std::exception& e) {
  report_rank_error(command, world, e);
  abort_job(kExitRankFailed);
}

TrainOptions with_checkpoint_step_size(const TrainOptions& opts, std::string* note) {
  TrainOptions o = opts;
  const bool docs = o.documents();
  if (o.resume.empty() || o.fresh_start() || (docs ? o.tokens_per_step > 0 || o.global_batch > 0 : o.global_batch > 0))
    return o;
  const nlohmann::json st = Checkpoint::trainer_state_of(o.resume);  // (open_inputs opens the checkpoint itself)
  const char* key = docs ? "tokens_per_step" : "global_batch";
  if (!st.is_object() || !st.contains("options") || !st["options"].is_object()) return o;
  const JsonField was(st["options"], o.resume + " (trainer state)");
  // Only from a run of the same batching (a windows run records no tokens per step, a documents run
  // a global batch it did not step by).
  if (was["batching"].string_or("windows") != o.batching || !was[key].present()) return o;
  const int64_t size = was[key].integer(0, kMaxBatch);
  if (size == 0) return o;
  (docs ? o.tokens_per_step : o.global_batch) = size;
  if (note)
    *note = cat("resuming with the checkpoint's ", docs ? "tokens per step " : "global batch ", size, " (",
                docs ? "--tokens-per-step" : "--global-batch", " not given: the run's steps stay the size they were)");
  return o;
}

}  // namespace origami
