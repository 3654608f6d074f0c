// TrainOptions: the options' rules (validate), what they derive (the layout's degrees, the buffer
// and activation shapes, the schedule) and the end-of-document id of --attention-mask document.
#include <algorithm>
#include <cfloat>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <numeric>
#include <tuple>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "data/blend.h"
#include "data/sampler.h"
#include "kernels/cpu/gemm.h"
#include "plan/cluster.h"
#include "train/balance.h"
#include "parallel/context_parallel.h"
#include "parallel/pipeline.h"
#include "train/trainer.h"

namespace origami {

int32_t document_eod(const ModelConfig& cfg, const Tokenizer* tokenizer, const std::string& data) {
  int32_t eod = -1;
  if (tokenizer) {
    eod = tokenizer->eod();
  } else {
    const nlohmann::json* eos = cfg.raw.contains("eos_token_id") ? &cfg.raw["eos_token_id"] : nullptr;
    if (eos && eos->is_array() && !eos->empty()) eos = &(*eos)[0];  // several: the first
    ORIGAMI_CHECK(eos && eos->is_number_integer(), "--attention-mask document needs the end-of-document token: the "
                  "data has no tokenizer file (", data, ".tokenizer.json) and the model config has no integer "
                  "eos_token_id");
    eod = eos->get<int32_t>();
  }
  ORIGAMI_CHECK(eod >= 0 && eod < cfg.vocab_size, "--attention-mask document: the end-of-document id ", eod,
                " is outside the model's vocabulary of ", cfg.vocab_size);
  return eod;
}

namespace {
// Whether two paths name one directory, however spelled (s9, s9/, ./s9), before it exists too.
std::filesystem::path normal_dir(const std::string& p) {
  const std::filesystem::path n = std::filesystem::weakly_canonical(std::filesystem::absolute(p));
  return n.has_filename() ? n : n.parent_path();
}

bool same_dir(const std::string& a, const std::string& b) { return normal_dir(a) == normal_dir(b); }

// Whether `resume` is the run directory `save` or one of its steps (DIR/step-N).
bool resumes_from(const std::string& resume, const std::string& save) {
  if (resume.empty()) return false;
  const std::filesystem::path r = normal_dir(resume);
  const std::string name = r.filename().string();
  const bool step = name.starts_with("step-") && name.size() > 5 &&
                    name.find_first_not_of("0123456789", 5) == std::string::npos;
  return same_dir(resume, save) || (step && r.parent_path() == normal_dir(save));
}
}  // namespace

bool TrainOptions::fresh_start() const {
  return !resume.empty() && !save.empty() && same_dir(resume, save) && !Checkpoint::committed_in(resume) &&
         !Checkpoint::is_checkpoint(resume);
}

void TrainOptions::check_save_dir() const {
  if (save.empty()) return;
  ORIGAMI_CHECK(!std::filesystem::is_regular_file(save), "--save '", save, "' is a file: give a directory (it "
                "writes DIR/step-N checkpoints)");
  ORIGAMI_CHECK(!Checkpoint::is_checkpoint(save), "--save '", save, "' is a checkpoint, not a run's directory: save "
                "into a directory of step-N checkpoints (a new one, or the run's own --save)");
  // (a run continuing from this directory's own steps saves into it; one from elsewhere would replace them)
  ORIGAMI_CHECK(resumes_from(resume, save) || overwrite_save || !Checkpoint::committed_in(save), "--save '", save, "' holds "
                "another run's checkpoints (", Checkpoint::resolved(save), "), whose steps this run",
                resume.empty() ? "" : cat(" (resuming '", resume, "', not that directory or one of its steps)"),
                " would replace: continue it with --resume ", save, ", save elsewhere, or replace them with "
                "--overwrite-save");
}

nlohmann::json TrainOptions::as_json() const {
  return {{"data", data}, {"steps", steps}, {"micro_batch", micro_batch}, {"global_batch", global_batch},
          {"tp", tp}, {"cp", cp}, {"cp_comm", cp_comm}, {"cp_a2a_size", cp_a2a()}, {"dp", dp}, {"ep", ep}, {"etp", etp},
          {"expert_sharding", expert_sharding}, {"fssdp_keep", fssdp_keep}, {"pp", pp}, {"vpp", vpp}, {"pp_schedule", schedule_kind_name(schedule_kind())},
          {"moe_aux_loss", aux_loss()}, {"moe_aux_loss_coef", moe_aux_loss_coef},
          {"moe_capacity_factor", moe_capacity_factor}, {"moe_drop_policy", moe_drop_policy},
          {"moe_pad_to_capacity", moe_pad_to_capacity}, {"moe_router_score", moe_router_score},
          {"moe_router_bias_update_rate", moe_router_bias_update_rate},
          {"pp_layers", pp_layers}, {"vocab_parallel", vocab_parallel}, {"recompute", recompute}, {"sequence_parallel", sequence_parallel}, {"zero", zero},
          {"seq_len", seq_len}, {"lr", lr.lr}, {"min_lr", lr.min_lr}, {"warmup", lr.warmup},
          {"lr_schedule", lr.schedule == LrSchedule::cosine ? "cosine" : "constant"},
          {"weight_decay", adam.weight_decay}, {"beta1", adam.beta1}, {"beta2", adam.beta2}, {"eps", adam.eps},
          {"grad_clip", grad_clip}, {"seed", seed}, {"data_order", data_order}, {"eval_data", eval_data},
          {"eval_every", eval_every}, {"eval_iters", eval_iters}, {"attention_mask", attention_mask},
          {"batching", batching}, {"tokens_per_step", tokens_per_step}, {"balance", balance}, {"static_cp", static_cp},
          {"balance_costs", balance_costs},
          {"precision", precision}, {"grad_reduce_dtype", grad_reduce_dtype}};
}

void TrainOptions::validate_routing(const ModelConfig& cfg) const {
  const AuxLoss aux = parse_aux_loss(aux_loss());
  const DropPolicy drop = parse_drop_policy(moe_drop_policy);
  const RouterScore score = parse_router_score(moe_router_score);
  ORIGAMI_CHECK(moe_capacity_factor >= 0, "--moe-capacity-factor must not be negative (0: dropless), got ",
                moe_capacity_factor);
  ORIGAMI_CHECK(moe_capacity_factor > 0 || (!moe_pad_to_capacity && drop == DropPolicy::probs),
                moe_pad_to_capacity ? "--moe-pad-to-capacity" : "--moe-drop-policy position",
                " needs --moe-capacity-factor F (without it routing is dropless)");
  // (the biases it moves lie beside scores in [0, 1]; a rate beyond 1 overflows them to inf within a
  // few steps at 1e38, and a checkpoint with them could not be read back)
  ORIGAMI_CHECK(moe_router_bias_update_rate >= 0 && moe_router_bias_update_rate <= 1,
                "--moe-router-bias-update-rate must be in [0, 1] (0: off; the router's scores lie in [0, 1]), got ",
                moe_router_bias_update_rate);
  ORIGAMI_CHECK(aux != AuxLoss::none || moe_aux_loss_coef < 0, "--moe-aux-loss-coef ", moe_aux_loss_coef,
                " weighs the load-balancing loss, which --moe-aux-loss none turns off: drop one");
  const bool any = (!moe_aux_loss.empty() && aux != AuxLoss::micro) || moe_aux_loss_coef >= 0 || moe_capacity_factor > 0 ||
                   score != RouterScore::softmax || moe_router_bias_update_rate > 0;
  ORIGAMI_CHECK(cfg.is_moe() || !any, "the --moe-* routing options need a mixture-of-experts model, and this ",
                cfg.model_type(), " model has no experts");
}

ModelConfig TrainOptions::with_routing(const ModelConfig& cfg) const {
  ModelConfig c = cfg;
  MoeRouting& r = c.routing;
  r.aux = parse_aux_loss(aux_loss());
  if (moe_aux_loss_coef >= 0) r.aux_coef = moe_aux_loss_coef;
  r.capacity_factor = moe_capacity_factor;
  r.drop = parse_drop_policy(moe_drop_policy);
  r.pad = moe_pad_to_capacity;
  r.score = parse_router_score(moe_router_score);
  r.bias_rate = moe_router_bias_update_rate;
  return c;
}

// The learning-rate schedule, AdamW and clipping.
void TrainOptions::validate_optimizer() const {
  ORIGAMI_CHECK(lr.lr >= 0, "--lr must not be negative, got ", lr.lr);
  ORIGAMI_CHECK(lr.min_lr >= 0 && lr.min_lr <= lr.lr, "--min-lr must be in [0, --lr], got ", lr.min_lr);
  ORIGAMI_CHECK(lr.schedule == LrSchedule::cosine || lr.min_lr == 0, "--min-lr ", lr.min_lr, " is the cosine "
                "schedule's floor, and --lr-schedule constant has none: drop it");
  ORIGAMI_CHECK(lr.warmup >= 0, "--warmup must not be negative, got ", lr.warmup);
  ORIGAMI_CHECK(adam.weight_decay >= 0, "--weight-decay must not be negative, got ", adam.weight_decay);
  // (AdamW runs in float: a beta within 2^-25 of 1 rounds to 1, and its moment would stop updating;
  // an eps below the smallest normal float becomes 0, and 0/0 where a gradient and its moments are 0)
  auto digits = [](double x) {  // (the default 6 digits would print 0.99999999 as 1)
    char s[32];
    std::snprintf(s, sizeof s, "%.10g", x);
    return std::string(s);
  };
  ORIGAMI_CHECK(adam.beta1 >= 0 && float(adam.beta1) < 1 && adam.beta2 >= 0 && float(adam.beta2) < 1,
                "--beta1 and --beta2 must be in [0, 0.99999994] (below 1 as 32-bit floats), got ", digits(adam.beta1),
                " and ", digits(adam.beta2));
  ORIGAMI_CHECK(adam.eps >= FLT_MIN, "--eps must be at least 1.18e-38 (the smallest normal 32-bit float), got ",
                adam.eps);
  ORIGAMI_CHECK(grad_clip >= 0, "--grad-clip must not be negative (0 disables clipping), got ", grad_clip);
}

void TrainOptions::validate(const ModelConfig& cfg, int world_size) const {
  validate_routing(cfg);
  ORIGAMI_CHECK(!data.empty(), "no training data: give --data PREFIX (made by 'origami data prepare')");
  parse_blend(data, "--data");
  if (!eval_data.empty()) parse_blend(eval_data, "--eval-data");
  ORIGAMI_CHECK(eval_every >= 0, "--eval-every must not be negative (0: after the last step only), got ", eval_every);
  ORIGAMI_CHECK(eval_iters >= 1, "--eval-iters must be at least 1, got ", eval_iters);
  ORIGAMI_CHECK(eval_every == 0 || !eval_data.empty(), "--eval-every needs --eval-data PREFIX");
  parse_attention_mask(attention_mask);
  // Layout degrees first: the global batch's default derives from them.
  ORIGAMI_CHECK(tp >= 1, "--tp must be at least 1, got ", tp);
  ORIGAMI_CHECK(pp >= 1, "--pp must be at least 1, got ", pp);
  ORIGAMI_CHECK(vpp >= 1, "--vpp must be at least 1, got ", vpp);
  ORIGAMI_CHECK(cp >= 1, "--cp must be at least 1, got ", cp);
  ORIGAMI_CHECK(dp >= 0, "--dp must be at least 1 (or omitted), got ", dp);
  ORIGAMI_CHECK(steps > 0, "--steps must be positive, got ", steps);
  ORIGAMI_CHECK(micro_batch > 0, "--micro-batch must be positive, got ", micro_batch);
  ORIGAMI_CHECK(micro_batch <= kMaxBatch, "--micro-batch must be at most ", kMaxBatch, ", got ", micro_batch);
  ORIGAMI_CHECK(global_batch > 0 && global_batch % micro_batch == 0, "--global-batch (", global_batch,
                ") must be a positive multiple of --micro-batch (", micro_batch, ")");
  check_limits();
  validate_documents(cfg);
  ORIGAMI_CHECK(seq_len > 0 && seq_len <= cfg.max_positions, "--seq-len must be in [1, ", cfg.max_positions,
                "] (the model's maximum positions), got ", seq_len);
  validate_optimizer();
  ORIGAMI_CHECK(save_every >= 0, "--save-every must not be negative, got ", save_every);
  ORIGAMI_CHECK((save_every == 0 && !save_every_auto) || !save.empty(), "--save-every needs --save DIR");
  ORIGAMI_CHECK(mtbf_hours > 0 && std::isfinite(mtbf_hours), "--mtbf-hours must be positive, got ", mtbf_hours);
  ORIGAMI_CHECK(keep_last >= 0, "--keep-last must not be negative (0 keeps all), got ", keep_last);
  ORIGAMI_CHECK((keep_last == 0 && !async_save && !overwrite_save) || !save.empty(),
                keep_last ? "--keep-last" : async_save ? "--async-save" : "--overwrite-save", " needs --save DIR");
  ORIGAMI_CHECK(init_from.empty() || resume.empty(), "--init-from (weights only) and --resume (weights, optimizer "
                "and step) exclude each other; give one");
  check_thread_count(threads);
  ORIGAMI_CHECK(max_skipped_steps >= 0, "--max-skipped-steps must not be negative, got ", max_skipped_steps);
  ORIGAMI_CHECK(loss_spike_factor == 0 || loss_spike_factor > 1,
                "--loss-spike-factor must be 0 (off) or above 1, got ", loss_spike_factor);
  ORIGAMI_CHECK(memory_limit_gb >= 0, "--memory-limit-gb must not be negative (0: the machine's memory), got ",
                memory_limit_gb);
  parse_sample_order(data_order);
  parse_precision(precision);
  grad_reduce_wire();
  // Layout.
  parse_recompute(recompute);
  ORIGAMI_CHECK(zero >= 0 && zero <= 3, "--zero must be 0, 1, 2 or 3, got ", zero);
  ORIGAMI_CHECK(bucket_mb * 1024 * 1024 >= 4, "--bucket-mb must hold one float (at least 4 bytes: 3.815e-06 MiB), "
                "got ", bucket_mb);
  validate_experts(cfg, world_size);
  // Context parallelism: 2·CP load-balanced chunks per sequence, each rank's cut again by TP under SP
  // (and by TP for MoE layers' shares); heads over the all-to-all group.
  const CpComm comm = parse_cp_comm(cp_comm);
  ORIGAMI_CHECK(cp_a2a_size == 0 || comm == CpComm::a2a_p2p, "--cp-a2a-size is for --cp-comm a2a+p2p (got --cp-comm ",
                cp_comm, ")");
  ORIGAMI_CHECK(comm != CpComm::a2a_p2p || cp_a2a_size >= 1, "--cp-comm a2a+p2p needs --cp-a2a-size A (the ranks "
                "of each all-to-all group)");
  ORIGAMI_CHECK(cp_a2a_size == 0 || cp % cp_a2a_size == 0, "--cp-a2a-size ", cp_a2a_size, " must divide --cp ", cp);
  if (cp > 1) {
    const int64_t cut = int64_t(2) * cp * (sequence_parallel || cfg.is_moe() ? tp : 1);
    ORIGAMI_CHECK(seq_len % cut == 0, "--cp ", cp, " cuts each sequence into 2 x ", cp, " chunks",
                  sequence_parallel ? cat(", each rank's split again over --tp ", tp, " (sequence parallel)")
                  : cfg.is_moe() && tp > 1 ? cat(", each rank's split again over --tp ", tp, " (MoE shares)") : "",
                  ": --seq-len (", seq_len, ") must be a multiple of ", cut);
    const int A = cp_a2a();
    const int64_t heads = cfg.num_heads / tp, kv = cfg.num_kv_heads / tp;
    ORIGAMI_CHECK(heads % A == 0, "--cp-comm ", cp_comm, " splits each rank's attention heads (", heads,
                  tp > 1 ? cat(" = ", cfg.num_heads, " / --tp ", tp) : "", ") over ", A,
                  " ranks: the heads must be a multiple of ", A);
    ORIGAMI_CHECK(kv % A == 0 || A % kv == 0, "--cp-comm ", cp_comm, " over ", A, " ranks: each rank's key/value heads (",
                  kv, ") must be a multiple of ", A, " or divide it (then they are replicated)");
    // A CP degree per sequence: a subgroup of d ranks exchanges heads over gcd(A, d) of them, the same rule.
    for (const int d : cp_per_sequence() ? cp_degrees(cp) : std::vector<int>{}) {
      const int64_t a = std::gcd(int64_t(A), int64_t(d));
      ORIGAMI_CHECK(kv % a == 0 || a % kv == 0, "--cp-comm ", cp_comm, " with a CP degree per sequence: the degree ", d,
                    " subgroups exchange heads over ", a, " ranks, and each rank's key/value heads (", kv, ") are "
                    "neither a multiple of ", a, " nor divide it; give --static-cp or another --cp");
    }
  }
  const MeshDims dims = layout_dims(world_size);
  MeshShape(world_size, dims, mesh_order);  // validates the world size and the order
  auto divides = [&](int64_t n, const char* what) {
    ORIGAMI_CHECK(n % tp == 0, "--tp ", tp, " must divide the number of ", what, " (", n, ")");
  };
  divides(cfg.num_heads, "attention heads");
  divides(cfg.num_kv_heads, "key/value heads");
  divides(cfg.hidden, "hidden features");
  if (cfg.has_dense_layers()) divides(cfg.ffn, "FFN features");  // routed experts are split by --etp instead
  if (cfg.shared_ffn > 0) divides(cfg.shared_ffn, "shared expert's FFN features");
  ORIGAMI_CHECK(global_batch % (int64_t(dims.dp) * micro_batch) == 0, "--global-batch (", global_batch,
                ") must be a multiple of --micro-batch x DP (", micro_batch, " x ", dims.dp, " = ",
                micro_batch * dims.dp, ")");
  // Pipeline: the layer split, then the schedule against the micro-batches each step has.
  ORIGAMI_CHECK(vpp == 1 || pp >= 2, "--vpp ", vpp, " splits each pipeline stage into chunks and needs --pp >= 2, "
                "got --pp ", pp);
  partition_layers(int(cfg.num_layers), pp, vpp, pp_layers);
  const ScheduleKind kind = schedule_kind();
  const int64_t m = micro_batches(world_size);
  ORIGAMI_CHECK(kind != ScheduleKind::interleaved || pp >= 2, "--pp-schedule interleaved needs --pp >= 2, got --pp ", pp);
  ORIGAMI_CHECK(kind != ScheduleKind::interleaved || vpp >= 2, "--pp-schedule interleaved needs --vpp >= 2 model chunks a "
                "stage, got --vpp ", vpp, " (with one chunk it is 1f1b with twice the warm-up forwards: give --pp-schedule "
                "1f1b)");
  ORIGAMI_CHECK(kind != ScheduleKind::interleaved || m % pp == 0, "--pp-schedule interleaved needs the micro-batches "
                "per step (--global-batch / (--micro-batch x DP) = ", global_batch, " / (", micro_batch, " x ", dims.dp,
                ") = ", m, ") to be a multiple of --pp (", pp, ")");
  ORIGAMI_CHECK(vpp == 1 || kind == ScheduleKind::interleaved, "--vpp ", vpp, " needs --pp-schedule interleaved, got ",
                schedule_kind_name(kind));
  // (the schedule holds an action per micro-batch and pass: a bound far above any real accumulation)
  ORIGAMI_CHECK(m <= (int64_t(1) << 20), "a step of ", m, " micro-batches a rank", documents() ? " (at most)" : "",
                " is more than 1048576: use a larger --micro-batch", documents() ? " or fewer --tokens-per-step" : "");
  check_schedule(kind, pp, int(m), vpp);
  Pipeline::check_tags(pp, m, vpp);
  ORIGAMI_CHECK(!vocab_parallel || pp >= 2, "--vocab-parallel splits the vocabulary over the pipeline stages and "
                "needs --pp >= 2, got --pp ", pp, " (tensor parallelism alone already splits it)");
  ORIGAMI_CHECK(!vocab_parallel || zero <= 1, "--vocab-parallel works with --zero 0 or 1, got --zero ", zero,
                ": its embedding gradients are written after the last backward, which ZeRO ",
                zero, " does not reduce");
  ORIGAMI_CHECK(!sequence_parallel || cp > 1 || seq_len % tp == 0, "--sequence-parallel splits the sequence over TP: --seq-len (",
                seq_len, ") must be a multiple of --tp (", tp, ")");
}

// The MoE mesh: experts over EP, each expert's FFN over ETP, EDP the rest of a pipeline stage's ranks;
// or FSSDP over that rest. validate() calls it.
void TrainOptions::validate_experts(const ModelConfig& cfg, int world_size) const {
  ORIGAMI_CHECK(ep >= 1 && etp >= 1, "--ep and --etp must be at least 1, got --ep ", ep, " --etp ", etp);
  ORIGAMI_CHECK(cfg.is_moe() || (ep == 1 && etp == 1), "--ep ", ep, " --etp ", etp, ": expert parallelism needs a "
                "mixture-of-experts model, and this ", cfg.model_type(), " model has no experts");
  if (cfg.is_moe()) {
    ORIGAMI_CHECK(cfg.num_experts % ep == 0, "--ep ", ep, " must divide the number of experts (", cfg.num_experts, ")");
    ORIGAMI_CHECK(cfg.expert_ffn % etp == 0, "--etp ", etp, " must divide the expert FFN features (", cfg.expert_ffn, ")");
    const int stage_ranks = world_size % pp == 0 ? world_size / pp : 0;
    const int64_t ep_etp = int64_t(ep) * etp;  // each up to kMaxDegree: the product overflows an int
    ORIGAMI_CHECK(stage_ranks > 0 && stage_ranks % ep_etp == 0, "--ep x --etp (", ep, " x ", etp, " = ", ep_etp,
                  ") must divide the ranks of a pipeline stage (", world_size, " ranks / --pp ", pp, " = ",
                  world_size / pp, "): the experts' mesh ETP x EP x EDP covers the same ranks as TP x CP x DP");
    ORIGAMI_CHECK(tp == 1 || cp > 1 || seq_len % tp == 0, "MoE layers route each TP rank's sequence shard: --seq-len (",
                  seq_len, ") must be a multiple of --tp (", tp, ")");
  }
  ORIGAMI_CHECK(!fssdp() || cfg.is_moe(), "--expert-sharding fssdp shards routed experts, and this ", cfg.model_type(),
                " model has none");
  ORIGAMI_CHECK(!fssdp_keep || fssdp(), "--fssdp-keep keeps what --expert-sharding fssdp gathers; it needs "
                "--expert-sharding fssdp");
  ORIGAMI_CHECK(!fssdp() || ep == 1, "--expert-sharding fssdp moves the experts to the tokens instead of the tokens to "
                "the experts: it shards every expert over the stage's ranks and needs --ep 1, got --ep ", ep);
}

void check_thread_count(int64_t threads) {
  ORIGAMI_CHECK(threads >= 0 && threads <= kMaxThreads, "--threads must be in [0, ", kMaxThreads,
                "] (0: all cores), got ", threads);
}

void use_threads(int64_t threads, const char* command, bool say) {
  if (threads == 0) return;
  set_num_threads(int(threads));
  if (say && num_threads() < threads)
    std::fprintf(stderr, "origami %s: warning: --threads %lld: the OpenMP runtime runs at most %d threads in a "
                 "process here, so %d run\n", command, (long long)threads, num_threads(), num_threads());
}

// Upper bounds (kMax* in trainer.h), after the lower ones validate() checks with their own words.
void TrainOptions::check_limits() const {
  for (const auto& [flag, v, most] : {std::tuple{"--steps", steps, kMaxSteps}, {"--eval-every", eval_every, kMaxSteps},
                                      {"--save-every", save_every, kMaxSteps}, {"--micro-batch", micro_batch, kMaxBatch},
                                      {"--global-batch", global_batch, kMaxBatch}})
    ORIGAMI_CHECK(v <= most, flag, " must be at most ", most, ", got ", v);
  if (documents())  // (an evaluation is --eval-iters steps of documents, no windows)
    ORIGAMI_CHECK(eval_data.empty() || eval_iters <= kMaxSteps, "--eval-iters must be at most ", kMaxSteps,
                  " steps of documents, got ", eval_iters);
  else
    ORIGAMI_CHECK(eval_data.empty() || eval_iters <= kMaxBatch / global_batch, "--eval-iters x global batch (",
                  eval_iters, " x ", global_batch, ") must be at most ", kMaxBatch, " windows; lower --eval-iters");
  for (const auto& [flag, v] : {std::pair{"--tp", tp}, {"--cp", cp}, {"--pp", pp}, {"--vpp", vpp}, {"--dp", dp},
                                {"--ep", ep}, {"--etp", etp}, {"--cp-a2a-size", cp_a2a_size}})
    ORIGAMI_CHECK(v <= kMaxDegree, flag, " must be at most ", kMaxDegree, ", got ", v);
  ORIGAMI_CHECK(bucket_mb <= kMaxBucketMb, "--bucket-mb must be at most ", kMaxBucketMb, ", got ", bucket_mb);
  ORIGAMI_CHECK(memory_limit_gb <= kMaxMemoryGb, "--memory-limit-gb must be at most ", kMaxMemoryGb, ", got ",
                memory_limit_gb);
}

ScheduleKind TrainOptions::schedule_kind() const {
  if (pp_schedule.empty()) return vpp > 1 ? ScheduleKind::interleaved : ScheduleKind::one_f_one_b;
  const ScheduleKind kind = parse_schedule_kind(pp_schedule);
  // One stage runs each micro-batch's forward and backward back to back, whatever was asked (GPipe's
  // order would only keep every micro-batch's activations at once); the trainer says it is unused.
  return pp == 1 && kind == ScheduleKind::gpipe ? ScheduleKind::one_f_one_b : kind;
}

int64_t TrainOptions::micro_batches(int world_size) const {
  if (!documents()) return global_batch / (micro_batch * layout_dims(world_size).dp);
  if (step_micro_batches > 0) return step_micro_batches;
  // Rows of `len` a worker may need (train/balance.h): lpt fails with R rows a worker only when every
  // row is more than half full, so it ends with at most ceil(2N / (workers·len)) (flex keeps no packing
  // with more micro-batches than lpt's); round-robin may give one worker almost all N tokens (next fit:
  // 2·ceil(N/len) + 1 rows).
  const int64_t N = tokens_per_step, dp_size = layout_dims(world_size).dp;
  const bool lpt = parse_balance(balance) != Balance::none;
  auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  auto micro = [&](int64_t len, int64_t workers) {
    return ceil_div(lpt ? std::max<int64_t>(1, ceil_div(2 * N, workers * len)) : 2 * ceil_div(N, len) + 1, micro_batch);
  };
  const int64_t step = schedule_kind() == ScheduleKind::interleaved ? pp : 1;
  int64_t m = micro(seq_len, dp_size);
  // A CP degree per sequence: each degree's micro-batches after the larger ones', the last (one rank
  // alone) found in increments of `step`.
  if (cp_per_sequence()) {
    for (const int d : cp_degrees(cp))
      if (d < cp) m += micro(d * (seq_len / cp), dp_size * (cp / d));
    m += step;
  }
  return ceil_div(m, step) * step;
}

bool TrainOptions::documents() const {
  if (batching == "windows") return false;
  if (batching == "documents") return true;
  throw Error(cat("--batching '", batching, "' is not one of windows, documents"));
}

// Document batching: what a step is made of (data/documents.h) and what it does not combine with.
void TrainOptions::validate_documents(const ModelConfig& cfg) const {
  if (!documents()) {
    ORIGAMI_CHECK(tokens_per_step == 0, "--tokens-per-step sizes a step of --batching documents (got --batching ",
                  batching, ")");
    ORIGAMI_CHECK(!static_cp, "--static-cp is for --batching documents (got --batching ", batching, ")");
    ORIGAMI_CHECK(balance_costs == "flops", "--balance-costs sizes the balancer's costs under --batching "
                  "documents (got --batching ", batching, ")");
    return;
  }
  ORIGAMI_CHECK(!static_cp || cp > 1, "--static-cp runs every sequence over the CP group: it needs --cp > 1");
  if (balance_costs != "flops" && balance_costs != "measure") {
    ORIGAMI_CHECK(std::filesystem::exists(balance_costs), "--balance-costs must be flops, measure or a cluster.json (as 'origami "
                  "profile' writes one), got '", balance_costs, "': no such file");
    Cluster::load(balance_costs);  // its errors name the file and the field
  }
  ORIGAMI_CHECK(parse_balance(balance) != Balance::flex || cp_per_sequence(), "--balance flex chooses a CP degree "
                "per sequence: it needs --cp > 1 without --static-cp (got --cp ", cp, static_cp ? " --static-cp" : "",
                "); use lpt");
  ORIGAMI_CHECK(tokens_per_step >= seq_len, "--tokens-per-step (", tokens_per_step, ") must be at least --seq-len (",
                seq_len, "): a step must have room for the longest sequence");
  ORIGAMI_CHECK(tokens_per_step <= kMaxBatch, "--tokens-per-step must be at most ", kMaxBatch, ", got ", tokens_per_step);
  ORIGAMI_CHECK(!parse_attention_mask(attention_mask), "--batching documents keeps every sequence to itself already: "
                "drop --attention-mask document");
  const AuxLoss aux = parse_aux_loss(aux_loss());
  ORIGAMI_CHECK(!cfg.is_moe() || aux == AuxLoss::none || aux == AuxLoss::seq, "--batching documents: --moe-aux-loss ",
                aux_loss(), " counts experts over the sequences that share a micro-batch, which depends on the "
                "layout; use seq (per sequence, the default) or none");
  ORIGAMI_CHECK(!cfg.is_moe() || moe_capacity_factor == 0, "--batching documents: --moe-capacity-factor drops "
                "assignments by what shares a row, which depends on the layout; it needs dropless routing (0)");
}

std::string TrainOptions::aux_loss() const {
  if (!moe_aux_loss.empty()) return moe_aux_loss;
  return batching == "documents" ? "seq" : "micro";
}

TrainOptions TrainOptions::resolved(int world_size) const {
  TrainOptions r = *this;
  // Only from values validate() accepts (it names the others), so the products cannot overflow.
  if (r.global_batch == 0 && tp >= 1 && cp >= 1 && pp >= 1 && dp >= 0 && micro_batch <= kMaxBatch)  // DP only: validate() names MoE mistakes
    r.global_batch = r.micro_batch * MeshShape::derive(world_size, {tp, cp, dp, pp, 1, 1, 0}).dp;
  if (r.tokens_per_step == 0 && r.batching == "documents" && r.global_batch > 0 && r.global_batch <= kMaxBatch &&
      r.seq_len > 0 && r.seq_len <= std::numeric_limits<int64_t>::max() / r.global_batch)
    r.tokens_per_step = r.global_batch * r.seq_len;
  return r;
}

ParamLayout TrainOptions::param_layout(int tp_size, int tp_rank, int dp_size, bool experts) const {
  const int z = zero_of(experts);
  return {tp_size, tp_rank, dp_size, int64_t(bucket_mb * 1024 * 1024 / sizeof(float)), z == 3,
          z >= 1 && parse_precision(precision) == Precision::bf16 && !(experts && fssdp())};
}

bool TrainOptions::fssdp() const {
  if (expert_sharding == "ep") return false;
  if (expert_sharding == "fssdp") return true;
  throw Error(cat("--expert-sharding '", expert_sharding, "' is not one of ep, fssdp"));
}

ActivationShape TrainOptions::activation_shape(int tp_size) const {
  return {micro_batch, seq_len / cp, tp_size, sequence_parallel && tp_size > 1, parse_recompute(recompute), etp, ep,
          cp, cp_a2a(), vocab_parallel ? pp : 1, parse_precision(precision), std::max(threads, 1), cp_per_sequence()};
}

DType TrainOptions::grad_reduce_wire() const {
  if (grad_reduce_dtype == "fp32") return DType::f32;
  if (grad_reduce_dtype == "bf16") return DType::bf16;
  throw Error(cat("--grad-reduce-dtype '", grad_reduce_dtype, "' is not one of fp32, bf16"));
}

int TrainOptions::cp_a2a() const {
  switch (parse_cp_comm(cp_comm)) {
    case CpComm::p2p: return 1;
    case CpComm::a2a: return cp;
    case CpComm::a2a_p2p: return cp_a2a_size;
  }
  return 1;
}

MeshDims TrainOptions::layout_dims(int world_size) const {
  MeshDims d;
  d.tp = tp, d.cp = cp, d.pp = pp, d.dp = dp;
  d.etp = etp, d.ep = ep, d.edp = 0;
  return MeshShape::derive(world_size, d);
}

}  // namespace origami
