#include "train/trainer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <tuple>
#include <sys/resource.h>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_writer.h"
#include "core/files.h"
#include "ckpt/safetensors.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "parallel/pipeline.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/stop_signals.h"
#include "core/timer.h"
#include "data/blend.h"
#include "data/sampler.h"
#include "data/tokenizer.h"
#include "kernels/cpu/gemm.h"
#include "model/model.h"
#include "model/params.h"
#include "train/comm_volume.h"
#include "train/memory_plan.h"
#include "train/plan.h"

namespace origami {

namespace {

// --loss-spike-factor: the running median is over the last kSpikeWindow finite losses, from kSpikeMinSteps on.
constexpr size_t kSpikeWindow = 100, kSpikeMinSteps = 10;

std::string format_duration(double seconds) {
  const int64_t s = int64_t(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(s / 3600), long(s / 60 % 60));
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", long(s / 60), long(s % 60));
  else std::snprintf(buf, sizeof buf, "%lds", long(s));
  return buf;
}

}  // namespace

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

bool TrainOptions::fresh_start() const {
  return !resume.empty() && resume == save && !Checkpoint::committed_in(resume);
}

nlohmann::json TrainOptions::as_json() const {
  return {{"data", data}, {"steps", steps}, {"micro_batch", micro_batch}, {"global_batch", global_batch},
          {"tp", tp}, {"cp", cp}, {"cp_comm", cp_comm}, {"cp_a2a_size", cp_a2a()}, {"dp", dp}, {"ep", ep}, {"etp", etp}, {"pp", pp}, {"vpp", vpp}, {"pp_schedule", schedule_kind_name(schedule_kind())},
          {"moe_aux_loss", moe_aux_loss}, {"moe_aux_loss_coef", moe_aux_loss_coef},
          {"moe_capacity_factor", moe_capacity_factor}, {"moe_drop_policy", moe_drop_policy},
          {"moe_pad_to_capacity", moe_pad_to_capacity}, {"moe_router_score", moe_router_score},
          {"moe_router_bias_update_rate", moe_router_bias_update_rate},
          {"pp_layers", pp_layers}, {"recompute", recompute}, {"sequence_parallel", sequence_parallel}, {"zero", zero},
          {"seq_len", seq_len}, {"lr", lr.lr}, {"min_lr", lr.min_lr}, {"warmup", lr.warmup},
          {"lr_schedule", lr.schedule == LrSchedule::cosine ? "cosine" : "constant"},
          {"weight_decay", adam.weight_decay}, {"beta1", adam.beta1}, {"beta2", adam.beta2}, {"eps", adam.eps},
          {"grad_clip", grad_clip}, {"seed", seed}, {"data_order", data_order}, {"eval_data", eval_data},
          {"eval_every", eval_every}, {"eval_iters", eval_iters}, {"attention_mask", attention_mask}};
}

void TrainOptions::validate_routing(const ModelConfig& cfg) const {
  const AuxLoss aux = parse_aux_loss(moe_aux_loss);
  const DropPolicy drop = parse_drop_policy(moe_drop_policy);
  const RouterScore score = parse_router_score(moe_router_score);
  ORIGAMI_CHECK(moe_capacity_factor >= 0, "--moe-capacity-factor must not be negative (0: dropless), got ",
                moe_capacity_factor);
  ORIGAMI_CHECK(moe_capacity_factor > 0 || (!moe_pad_to_capacity && drop == DropPolicy::probs),
                moe_pad_to_capacity ? "--moe-pad-to-capacity" : "--moe-drop-policy position",
                " needs --moe-capacity-factor F (without it routing is dropless)");
  ORIGAMI_CHECK(moe_router_bias_update_rate >= 0, "--moe-router-bias-update-rate must not be negative (0: off), got ",
                moe_router_bias_update_rate);
  const bool any = aux != AuxLoss::micro || moe_aux_loss_coef >= 0 || moe_capacity_factor > 0 ||
                   score != RouterScore::softmax || moe_router_bias_update_rate > 0;
  ORIGAMI_CHECK(cfg.is_moe() || !any, "the --moe-* routing options need a mixture-of-experts model, and this ",
                cfg.model_type(), " model has no experts");
}

ModelConfig TrainOptions::with_routing(const ModelConfig& cfg) const {
  ModelConfig c = cfg;
  MoeRouting& r = c.routing;
  r.aux = parse_aux_loss(moe_aux_loss);
  if (moe_aux_loss_coef >= 0) r.aux_coef = moe_aux_loss_coef;
  r.capacity_factor = moe_capacity_factor;
  r.drop = parse_drop_policy(moe_drop_policy);
  r.pad = moe_pad_to_capacity;
  r.score = parse_router_score(moe_router_score);
  r.bias_rate = moe_router_bias_update_rate;
  return c;
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
  ORIGAMI_CHECK(global_batch > 0 && global_batch % micro_batch == 0, "--global-batch (", global_batch,
                ") must be a positive multiple of --micro-batch (", micro_batch, ")");
  ORIGAMI_CHECK(seq_len > 0 && seq_len <= cfg.max_positions, "--seq-len must be in [1, ", cfg.max_positions,
                "] (the model's maximum positions), got ", seq_len);
  ORIGAMI_CHECK(lr.lr >= 0, "--lr must not be negative, got ", lr.lr);
  ORIGAMI_CHECK(lr.min_lr >= 0 && lr.min_lr <= lr.lr, "--min-lr must be in [0, --lr], got ", lr.min_lr);
  ORIGAMI_CHECK(lr.warmup >= 0, "--warmup must not be negative, got ", lr.warmup);
  ORIGAMI_CHECK(adam.weight_decay >= 0, "--weight-decay must not be negative, got ", adam.weight_decay);
  ORIGAMI_CHECK(adam.beta1 >= 0 && adam.beta1 < 1 && adam.beta2 >= 0 && adam.beta2 < 1,
                "--beta1 and --beta2 must be in [0, 1), got ", adam.beta1, " and ", adam.beta2);
  ORIGAMI_CHECK(adam.eps > 0, "--eps must be positive, got ", adam.eps);
  ORIGAMI_CHECK(grad_clip >= 0, "--grad-clip must not be negative (0 disables clipping), got ", grad_clip);
  ORIGAMI_CHECK(save_every >= 0, "--save-every must not be negative, got ", save_every);
  ORIGAMI_CHECK(save_every == 0 || !save.empty(), "--save-every needs --save DIR");
  ORIGAMI_CHECK(keep_last >= 0, "--keep-last must not be negative (0 keeps all), got ", keep_last);
  ORIGAMI_CHECK((keep_last == 0 && !async_save) || !save.empty(), keep_last ? "--keep-last" : "--async-save",
                " needs --save DIR");
  ORIGAMI_CHECK(init_from.empty() || resume.empty(), "--init-from (weights only) and --resume (weights, optimizer "
                "and step) exclude each other; give one");
  ORIGAMI_CHECK(threads >= 0, "--threads must not be negative, got ", threads);
  ORIGAMI_CHECK(max_skipped_steps >= 0, "--max-skipped-steps must not be negative, got ", max_skipped_steps);
  ORIGAMI_CHECK(loss_spike_factor == 0 || loss_spike_factor > 1,
                "--loss-spike-factor must be 0 (off) or above 1, got ", loss_spike_factor);
  ORIGAMI_CHECK(memory_limit_gb >= 0, "--memory-limit-gb must not be negative (0: the machine's memory), got ",
                memory_limit_gb);
  parse_sample_order(data_order);
  // Layout.
  parse_recompute(recompute);
  ORIGAMI_CHECK(zero >= 0 && zero <= 2, "--zero must be 0, 1 or 2, got ", zero);
  ORIGAMI_CHECK(bucket_mb > 0, "--bucket-mb must be positive, got ", bucket_mb);
  // The MoE mesh: experts over EP, each expert's FFN over ETP, EDP the rest of a pipeline stage's ranks.
  ORIGAMI_CHECK(ep >= 1 && etp >= 1, "--ep and --etp must be at least 1, got --ep ", ep, " --etp ", etp);
  ORIGAMI_CHECK(cfg.is_moe() || (ep == 1 && etp == 1), "--ep ", ep, " --etp ", etp, ": expert parallelism needs a "
                "mixture-of-experts model, and this ", cfg.model_type(), " model has no experts");
  if (cfg.is_moe()) {
    ORIGAMI_CHECK(cfg.num_experts % ep == 0, "--ep ", ep, " must divide the number of experts (", cfg.num_experts, ")");
    ORIGAMI_CHECK(cfg.expert_ffn % etp == 0, "--etp ", etp, " must divide the expert FFN features (", cfg.expert_ffn, ")");
    const int stage_ranks = world_size % pp == 0 ? world_size / pp : 0;
    ORIGAMI_CHECK(stage_ranks > 0 && stage_ranks % (ep * etp) == 0, "--ep x --etp (", ep, " x ", etp, " = ", ep * etp,
                  ") must divide the ranks of a pipeline stage (", world_size, " ranks / --pp ", pp, " = ",
                  world_size / pp, "): the experts' mesh ETP x EP x EDP covers the same ranks as TP x CP x DP");
    ORIGAMI_CHECK(tp == 1 || cp > 1 || seq_len % tp == 0, "MoE layers route each TP rank's sequence shard: --seq-len (",
                  seq_len, ") must be a multiple of --tp (", tp, ")");
  }
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
  partition_layers(int(cfg.num_layers), pp, vpp, pp_layers);
  const ScheduleKind kind = schedule_kind();
  const int64_t m = micro_batches(world_size);
  ORIGAMI_CHECK(kind != ScheduleKind::interleaved || pp >= 2, "--pp-schedule interleaved needs --pp >= 2, got --pp ", pp);
  ORIGAMI_CHECK(kind != ScheduleKind::interleaved || m % pp == 0, "--pp-schedule interleaved needs the micro-batches "
                "per step (--global-batch / (--micro-batch x DP) = ", global_batch, " / (", micro_batch, " x ", dims.dp,
                ") = ", m, ") to be a multiple of --pp (", pp, ")");
  ORIGAMI_CHECK(vpp == 1 || kind == ScheduleKind::interleaved, "--vpp ", vpp, " needs --pp-schedule interleaved, got ",
                schedule_kind_name(kind));
  check_schedule(kind, pp, int(m), vpp);
  Pipeline::check_tags(pp, int(m), vpp);
  ORIGAMI_CHECK(!sequence_parallel || cp > 1 || seq_len % tp == 0, "--sequence-parallel splits the sequence over TP: --seq-len (",
                seq_len, ") must be a multiple of --tp (", tp, ")");
}

ScheduleKind TrainOptions::schedule_kind() const {
  if (pp_schedule.empty()) return vpp > 1 ? ScheduleKind::interleaved : ScheduleKind::one_f_one_b;
  return parse_schedule_kind(pp_schedule);
}

int64_t TrainOptions::micro_batches(int world_size) const {
  return global_batch / (micro_batch * layout_dims(world_size).dp);
}

TrainOptions TrainOptions::resolved(int world_size) const {
  TrainOptions r = *this;
  if (r.global_batch == 0 && tp >= 1 && cp >= 1 && pp >= 1 && dp >= 0)  // DP only: validate() names MoE mistakes
    r.global_batch = r.micro_batch * MeshShape::derive(world_size, {tp, cp, dp, pp, 1, 1, 0}).dp;
  return r;
}

ParamLayout TrainOptions::param_layout(int tp_size, int tp_rank, int dp_size) const {
  return {tp_size, tp_rank, dp_size, int64_t(bucket_mb * 1024 * 1024 / sizeof(float))};
}

ActivationShape TrainOptions::activation_shape(int tp_size) const {
  return {micro_batch, seq_len / cp,        tp_size, sequence_parallel && tp_size > 1, parse_recompute(recompute), etp, ep,
          cp,          cp_a2a()};
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

namespace {

// The memory check before allocation: every rank's parts (computed by rank_memory) and what its node
// has available (measured once every rank has set up its libraries) are gathered, and every rank
// takes the same decision, so one message — naming the neediest rank's breakdown and what shrinks
// its largest part — ends the job before anything large is allocated.
struct MemoryCheck {
  std::vector<MemoryParts> parts;  // per rank
  size_t neediest = 0;             // the rank with the largest total
  std::string budget;              // what rank 0's node (or the per-rank limit) allows, in words
};

MemoryCheck check_memory(const Plan& plan, int64_t sampler, Comm& world) {
  const TrainOptions& o = plan.options;
  const int64_t runtime = resident_bytes();
  MemoryParts mine;
  check_on_every_rank(world, "train",
                      [&] { mine = rank_memory(plan.model, o, world.size(), world.rank(), runtime, sampler); });
  world.barrier();  // every rank on a node holds its runtime memory before any measures what is left
  const AvailableMemory avail = available_memory();
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  // Per rank: the parts, a node id (a host-name hash exact in a double), available bytes, which bound.
  constexpr int K = MemoryParts::kCount + 3;
  std::vector<double> row(K), all(size_t(K) * size_t(world.size()));
  for (int i = 0; i < MemoryParts::kCount; ++i) row[size_t(i)] = double(mine[i]);
  row[K - 3] = double(std::hash<std::string>{}(host) & ((uint64_t(1) << 52) - 1));
  row[K - 2] = double(avail.bytes);
  row[K - 1] = avail.source == "MemAvailable" ? 0 : 1;
  world.all_gather(all.data(), row.data(), K, DType::f64);
  MemoryCheck out;
  out.parts.resize(size_t(world.size()));
  for (size_t r = 0; r < out.parts.size(); ++r) {
    for (int i = 0; i < MemoryParts::kCount; ++i) out.parts[r][i] = int64_t(all[r * K + size_t(i)]);
    if (out.parts[r].total() > out.parts[out.neediest].total()) out.neediest = r;
  }
  const std::vector<MemoryParts>& parts = out.parts;
  auto needs = [&](size_t worst) {
    const MemoryParts& w = parts[worst];
    return cat("rank ", worst, " needs ", format_bytes(double(w.total())), " (", w.describe(), "; the largest part is ",
               MemoryParts::name(w.largest()), ")");
  };
  const double limit = o.memory_limit_gb * double(1 << 30);
  out.budget = o.memory_limit_gb > 0 ? cat("--memory-limit-gb ", o.memory_limit_gb, " per rank")
                                     : cat(format_bytes(all[K - 2]), " available on rank 0's node");
  check_on_every_rank(world, "train", [&] {
    if (o.memory_limit_gb > 0) {
      const MemoryParts& w = parts[out.neediest];
      ORIGAMI_CHECK(double(w.total()) <= limit, "not enough memory: ", needs(out.neediest), ", more than --memory-limit-gb ",
                    o.memory_limit_gb, " (", format_bytes(limit), "); ", MemoryParts::advice(w.largest()));
      return;
    }
    // Per node: what its ranks will allocate beyond what they hold now, against what it has available.
    std::map<double, std::vector<size_t>> nodes;
    for (size_t r = 0; r < parts.size(); ++r) nodes[all[r * K + K - 3]].push_back(r);
    for (const auto& [id, ranks] : nodes) {
      double more = 0;
      size_t worst = ranks[0];
      for (size_t r : ranks) {
        more += double(parts[r].total() - parts[r].runtime);
        if (parts[r].total() > parts[worst].total()) worst = r;
      }
      const double* first = &all[ranks[0] * K];
      ORIGAMI_CHECK(more <= first[K - 2], "not enough memory: ", needs(worst), "; ",
                    ranks.size() == 1 ? std::string("its node") : cat("the ", ranks.size(), " ranks on its node"),
                    " would allocate ", format_bytes(more), " and it has ", format_bytes(first[K - 2]), " available (",
                    first[K - 1] == 0 ? "MemAvailable" : "its control group's limit", "); ",
                    MemoryParts::advice(parts[worst].largest()), " (--memory-limit-gb sets a limit per rank instead)");
    }
  });
  return out;
}

// One parameter set of this rank with its gradient reduction and optimizer: the dense tensors on the
// attention mesh (TP shards, reduced over DP) or the routed experts on the MoE mesh (ETP shards of
// this EP rank's experts, reduced over EDP). A dense model's expert set is empty.
struct ParamSet {
  Params params;
  DataParallel dp;
  AdamW opt;
  ParamSet(std::vector<ParamSpec> table, const TrainOptions& o, Comm& dp_group, Comm& tp_group, bool sequence_parallel,
           Comm* embedding)
      : params(std::move(table), o.param_layout(tp_group.size(), tp_group.rank(), dp_group.size())),
        dp(params, dp_group, tp_group, o.zero, sequence_parallel, embedding),
        opt(params, o.adam, dp.owned()) {}
};

// The run's inputs, opened on every rank and checked before any communication: the training data
// (its tokenizer against the model's vocabulary), the validation data and the checkpoint to start
// from (against the model). Completes the plan's model config with the end-of-document id of
// --attention-mask document (the data's tokenizer names it).
struct Inputs {
  std::optional<DataBlend> data, eval_data;  // the training data and the validation data (if any)
  std::optional<Checkpoint> checkpoint;      // --resume or --init-from
  bool fresh_start = false;                  // --resume DIR --save DIR before DIR holds a checkpoint
  // Test-only fault injection: ORIGAMI_TEST_NAN_GRAD=STEP:RANK makes world rank RANK's gradient at
  // the first parameter backward reaches in step STEP NaN, before any reduction — as a fault in one
  // rank's backward would. The non-finite guard must stop every rank.
  long long nan_step = -1;
  int nan_rank = -1;
};

Inputs open_inputs(Plan& plan) {
  const TrainOptions& o = plan.options;
  ModelConfig& cfg = plan.model;
  Inputs in;
  const std::vector<BlendPart> parts = parse_blend(o.data, "--data");
  in.data.emplace(parts, o.seq_len, parse_sample_order(o.data_order), o.seed, "--data");
  const std::string& tokenizer_path = in.data->tokenizer_path();
  std::unique_ptr<Tokenizer> tok;
  if (!tokenizer_path.empty()) {
    tok = load_tokenizer_file(tokenizer_path);
    ORIGAMI_CHECK(tok->vocab_size() <= cfg.vocab_size, "the dataset's tokenizer (", tokenizer_path, ") has ",
                  tok->vocab_size(), " tokens but the model's vocab_size is ", cfg.vocab_size);
  }
  if (!o.eval_data.empty()) {
    // The validation windows, in order: the first eval_iters × G samples, none read twice.
    in.eval_data.emplace(parse_blend(o.eval_data, "--eval-data"), o.seq_len, SampleOrder::sequential, o.seed,
                         "--eval-data");
    in.data->require_same_tokenizer(*in.eval_data, cat("--data '", o.data, "' and --eval-data '", o.eval_data, "'"));
    in.eval_data->require_no_repeat(o.eval_iters * o.global_batch,
                                    cat("--eval-data: an evaluation (--eval-iters x global batch = ", o.eval_iters,
                                        " x ", o.global_batch, "; lower --eval-iters or give more validation data)"));
  }
  if (parse_attention_mask(o.attention_mask)) cfg.document_eod = document_eod(cfg, tok.get(), parts[0].prefix);
  in.fresh_start = o.fresh_start();
  const std::string& from = o.resume.empty() ? o.init_from : o.resume;
  if (!from.empty() && !in.fresh_start) {  // the checkpoint to start from, checked against the model
    in.checkpoint = Checkpoint::open(from);
    in.checkpoint->bind(cfg);
    ORIGAMI_CHECK(o.resume.empty() || in.checkpoint->has_optimizer(), "--resume '", o.resume, "' (",
                  in.checkpoint->path(), ") holds weights only, no optimizer state or step: start from it with "
                  "--init-from");
  }
  if (const char* e = std::getenv("ORIGAMI_TEST_NAN_GRAD"))
    ORIGAMI_CHECK(std::sscanf(e, "%lld:%d", &in.nan_step, &in.nan_rank) == 2 && in.nan_step >= 1 && in.nan_rank >= 0,
                  "ORIGAMI_TEST_NAN_GRAD must be STEP:RANK (a step from 1, a world rank), got '", e, "'");
  return in;
}

// Where the run starts: step 0 with the parameters initialised from the seed, or the checkpoint's
// weights (--init-from) and, with --resume, its AdamW moments, step and router biases.
struct StartState {
  int64_t step = 0;
  std::vector<std::vector<float>> router_bias;  // the router's selection biases of a resumed checkpoint
  double load_s = 0;                            // reading (and checking) the checkpoint: the slowest rank's
};

StartState start_state(Checkpoint* ck, const std::array<ParamSet*, 2>& sets, const Plan& plan, Comm& world) {
  const TrainOptions& o = plan.options;
  StartState start;
  if (!ck) {
    for (ParamSet* set : sets) set->params.init(o.seed, plan.model.num_layers);
    return start;
  }
  // Every rank reads only its own shards (any layout wrote them) and checks the checksums of its
  // share of the files; a damaged or missing file is one message and every rank exits 1.
  Timer load_timer;
  check_on_every_rank(world, "train", [&] {
    ck->verify_checksums(world.rank(), world.size());
    for (ParamSet* set : sets) ck->read_weights(set->params);
    if (o.resume.empty()) return;
    const nlohmann::json& st = ck->trainer_state();
    ORIGAMI_CHECK(st.contains("step") && st["step"].is_number_integer() && st.contains("adam_steps"), "'",
                  ck->path(), "/trainer_state.json' needs integer 'step' and 'adam_steps'");
    for (ParamSet* set : sets) {
      const ParamLayout& lay = set->params.layout();
      for (size_t i = 0; i < set->opt.segments().size(); ++i) {
        const Segment& seg = set->opt.segments()[i];
        const int64_t at = set->params.offset(seg.param);
        const ParamSpec& spec = set->params.table()[seg.param];
        ck->read(StateKind::exp_avg, spec, lay.tp, lay.tp_rank, seg.begin - at, seg.end - at, set->opt.exp_avg(i));
        ck->read(StateKind::exp_avg_sq, spec, lay.tp, lay.tp_rank, seg.begin - at, seg.end - at, set->opt.exp_avg_sq(i));
      }
      set->opt.set_steps_taken(st["adam_steps"].get<int64_t>());
    }
    start.step = st["step"].get<int64_t>();
    // A resume continues the run: options that change what it learns from are worth a word when changed.
    if (world.rank() == 0 && st.contains("options") && st["options"].is_object()) {
      const nlohmann::json& was = st["options"];
      for (const auto& [key, flag, now] : {std::tuple{"attention_mask", "--attention-mask", o.attention_mask},
                                           std::tuple{"data", "--data", o.data}}) {
        const std::string before = was.contains(key) && was[key].is_string() ? was[key].get<std::string>()
                                   : std::string(key) == "attention_mask" ? "causal" : "";
        if (before != now)
          std::fprintf(stderr, "origami train: warning: resuming with %s '%s'; '%s' trained with '%s'\n", flag,
                       now.c_str(), ck->path().c_str(), before.c_str());
      }
    }
    if (st.contains("router_bias")) start.router_bias = st["router_bias"].get<std::vector<std::vector<float>>>();
    ORIGAMI_CHECK(start.step < o.steps, "checkpoint '", ck->path(), "' is already at step ", start.step,
                  "; ask for more --steps to continue");
  });
  start.load_s = world.all_reduce_value(load_timer.ms() / 1000.0, ReduceOp::max);
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

}  // namespace

// A run is built in this order, each part from the Plan and the parts before it:
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
//   9. the step loop.
int run_training(const ModelConfig& model_cfg, const TrainOptions& opts, Comm& world) {
  // 1. Plan and inputs: everything a user can get wrong is checked first, on every rank, before any
  // communication.
  std::optional<Plan> planned;
  Inputs in;
  check_on_every_rank(world, "train", [&] {
    planned.emplace(make_plan(model_cfg, opts, world.size()));
    in = open_inputs(*planned);
  });
  const Plan& plan = *planned;
  const TrainOptions& o = plan.options;
  const ModelConfig& cfg = plan.model;
  std::optional<DataBlend> &data = in.data, &eval_data = in.eval_data;

  // 2. Memory check (the libraries' thread pools and buffers are set up first: the check measures
  // them as the runtime part).
  if (o.threads > 0) set_num_threads(o.threads);
  warm_up_gemm();
  const int64_t data_bytes = data->bytes(o.global_batch) + (eval_data ? eval_data->bytes(o.eval_iters * o.global_batch) : 0);
  const MemoryCheck memory = check_memory(plan, data_bytes, world);
  const bool rank0 = world.rank() == 0;

  // 3. Mesh: the attention and MoE meshes over the same ranks.
  Mesh mesh(world, plan.mesh);
  Comm& tp_comm = mesh.comm("tp");
  Comm& dp_comm = mesh.comm("dp");        // data rows: CP ranks read the same windows
  Comm& grad_comm = mesh.comm("dp-cp");   // dense gradients: summed over DP and CP (each CP rank its tokens')
  Comm& pp_comm = mesh.comm("pp");
  Comm &ep_comm = mesh.comm("ep"), &etp_comm = mesh.comm("etp"), &edp_comm = mesh.comm("edp");
  const int dp = dp_comm.size(), dp_rank = dp_comm.rank(), pp = pp_comm.size(), stage = pp_comm.rank();
  // The tied embedding's gradient is summed over the first and last stage (a group of 2; the middle
  // stages form groups of their own, unused).
  std::unique_ptr<Comm> embedding_comm;
  if (pp > 1) embedding_comm = pp_comm.split(stage == 0 || stage == pp - 1 ? 0 : 1, stage, "embedding");

  // 4. Parameters: this rank's pipeline stage (its chunks of layers), the TP shard and DP buckets of
  // its dense tensors, and its experts (EP) with their ETP shard and EDP buckets.
  const ModelPart part = plan.part(stage);
  SplitTable tables = split_experts(make_param_table(cfg, part), cfg.num_experts, ep_comm.size(), ep_comm.rank());
  ParamSet dense(std::move(tables.dense), o, grad_comm, tp_comm, o.sequence_parallel,
                 part.embedding != part.head ? embedding_comm.get() : nullptr);
  ParamSet experts(std::move(tables.experts), o, edp_comm, etp_comm, false, nullptr);
  const std::array<ParamSet*, 2> sets = {&dense, &experts};
  Params& params = dense.params;

  // 5. Start state.
  const StartState start = start_state(in.checkpoint ? &*in.checkpoint : nullptr, sets, plan, world);
  const int64_t start_step = start.step;
  // Unmapped once read: a later --keep-last removal of that step then frees its disk space.
  const std::string ck_path = in.checkpoint ? in.checkpoint->path() : "";
  in.checkpoint.reset();

  // 6. Model and pipeline. MoE layers route every token of TP x CP once: the counts behind the
  // router's load-balancing loss are summed over that group (and for the global-batch loss also
  // over DP: the whole stage).
  Model model(cfg, params, TensorParallel(tp_comm, o.sequence_parallel), part, plan.recompute,
              {&experts.params, TokenDispatcher(mesh.comm("tp-cp"), dp_comm, ep_comm, etp_comm)},
              ContextParallel(mesh.comm("cp"), plan.cp_comm, plan.cp_a2a));
  ContextParallel& cp = model.context_parallel();
  if (!start.router_bias.empty()) {  // a resumed run routes with the biases it saved (and updates them with a rate)
    ORIGAMI_CHECK(start.router_bias.size() == size_t(cfg.num_layers) &&
                      start.router_bias[0].size() == size_t(cfg.num_experts),
                  "'", ck_path, "/trainer_state.json': router_bias is not [layers][experts] of this model");
    model.router_bias() = start.router_bias;
  }
  int64_t current_step = 0;
  bool injected = false;
  model.on_grads_ready([&](int64_t offset, int64_t expert_offset) {
    if (current_step == in.nan_step && in.nan_rank == world.rank() && !injected) {
      params.grad()[offset] = std::numeric_limits<float>::quiet_NaN();
      injected = true;
    }
    dense.dp.grads_ready(offset);
    experts.dp.grads_ready(expert_offset);
  });
  const int64_t B = o.micro_batch, G = o.global_batch, T = o.seq_len, micro = plan.micro_batches;
  Pipeline pipeline(model, pp_comm, {&dense.dp, &experts.dp}, plan.schedule, int(micro), o.vpp);
  // Activation memory this stage should peak at (the memory check's figure, compared with the measured peak).
  const int64_t act_computed = memory.parts[size_t(world.rank())].activations;

  // 7. Report: the metrics file, the layout in words (also in every metrics row and checkpoint) and
  // the startup lines.
  std::unique_ptr<std::ofstream> metrics;
  if (rank0 && !o.metrics.empty()) {
    metrics = std::make_unique<std::ofstream>(o.metrics, start_step > 0 ? std::ios::app : std::ios::trunc);
    ORIGAMI_CHECK(*metrics, "cannot write metrics file '", o.metrics, "'");
  }
  const double flops_per_step = train_flops_per_token(cfg, T) * double(G * T);
  const MeshDims& dims = plan.mesh.dims();
  std::string layout_name = plan.mesh.describe(cfg.is_moe()) + (o.sequence_parallel && dims.tp > 1 ? " +SP" : "") +
                            (o.zero > 0 && dims.dp > 1 ? " ZeRO-" + std::to_string(o.zero) : "");
  if (dims.cp > 1) layout_name += cat(" cp ", cp.describe(cfg.num_kv_heads / dims.tp));
  if (dims.pp > 1) layout_name += cat(" ", schedule_kind_name(plan.schedule), o.vpp > 1 ? cat(" v", o.vpp) : "");
  if (plan.recompute != Recompute::none) layout_name += cat(" recompute ", recompute_name(plan.recompute));
  if (rank0) {
    std::printf("origami train: %s, %lld parameters, %lld layers | data %s | "
                "global batch %lld%s = %lld accumulation step%s x micro-batch %lld x DP %d | %s, %d threads per rank\n",
                cfg.model_type().c_str(), (long long)num_parameters(cfg), (long long)cfg.num_layers,
                data->describe().c_str(), (long long)G,
                plan.default_global_batch ? " (default: micro-batch x DP)" : "", (long long)micro, micro == 1 ? "" : "s",
                (long long)B, dp, layout_name.c_str(), num_threads());
    std::printf("memory: %s per rank at most (rank %zu; %s)\n",
                format_bytes(double(memory.parts[memory.neediest].total())).c_str(), memory.neediest,
                memory.budget.c_str());
    if (o.verbose)
      for (size_t r = 0; r < memory.parts.size(); ++r)
        std::printf("memory of rank %zu: %s; total %s\n", r, memory.parts[r].describe().c_str(),
                    format_bytes(double(memory.parts[r].total())).c_str());
    if (pp > 1) {
      std::printf("pipeline stages (layers per chunk):");
      for (int s = 0; s < pp; ++s) {
        std::printf(" %d:", s);
        for (const LayerRange& r : plan.part(s).chunks) std::printf(" [%d,%d)", r.begin, r.end);
      }
      std::printf("\n");
    }
    if (eval_data)
      std::printf("validation: %s | %lld windows (%lld x global batch) %s\n", eval_data->describe().c_str(),
                  (long long)(o.eval_iters * G), (long long)o.eval_iters,
                  o.eval_every > 0 ? cat("every ", o.eval_every, " steps and after the last").c_str() : "after the last step");
    if (cfg.document_eod >= 0)
      std::printf("attention within documents: token %d ends a document (positions restart after it)\n",
                  cfg.document_eod);
    if (in.fresh_start) std::printf("no checkpoint in '%s' yet: starting at step 0\n", o.resume.c_str());
    if (!ck_path.empty() && !o.resume.empty())
      std::printf("resuming from '%s' at step %lld (read in %.2f s)\n", ck_path.c_str(), (long long)start_step, start.load_s);
    else if (!ck_path.empty())
      std::printf("weights from '%s' (read in %.2f s)\n", ck_path.c_str(), start.load_s);
    if (in.nan_step >= 1)
      std::printf("test fault injection: a NaN in rank %d's gradient at step %lld (ORIGAMI_TEST_NAN_GRAD)\n",
                  in.nan_rank, in.nan_step);
    std::fflush(stdout);
  }

  // 8. Checkpoints: every rank writes the pieces it owns (ckpt/checkpoint_writer.h), in place or, with
  // --async-save, from a host copy while the next steps run.
  std::optional<CheckpointWriter> writer;
  if (!o.save.empty())
    writer.emplace(world, "train", o.save, o.keep_last, o.async_save,
                   rank0 ? make_param_table(cfg) : std::vector<ParamSpec>{});
  // What this rank writes: the owner rule over its dense tensors (replicated over DP x CP) and its
  // experts (over EDP); only the first stage writes the tied embedding.
  auto owned_pieces = [&] {
    std::vector<SavePiece> pieces;
    add_owned_pieces(dense.params, dense.opt, grad_comm.size(), grad_comm.rank(), part.embedding, pieces);
    add_owned_pieces(experts.params, experts.opt, edp_comm.size(), edp_comm.rank(), true, pieces);
    return pieces;
  };
  if (o.async_save) {  // the host copy, allocated once (the memory check counted it)
    int64_t floats = 0;
    for (const SavePiece& p : owned_pieces()) floats += p.end - p.begin;
    writer->reserve(floats);
  }
  int64_t last_saved = -1;
  // Returns the seconds the step loop was blocked, or -1, on every rank, when the state is not finite
  // (an update from finite gradients can still overflow): nothing is written then.
  auto save = [&](int64_t steps_done) -> double {
    double bad = 0;
    for (ParamSet* set : sets) {
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
    if (world.all_reduce_value(bad) > 0) {
      if (rank0)
        std::fprintf(stderr, "origami train: error: step %lld: the weights or AdamW moments are not finite after the "
                     "update; not saving%s\n", (long long)steps_done,
                     last_saved >= 0 ? cat(" (", o.save, " holds step ", last_saved, ")").c_str() : "");
      return -1;
    }
    last_saved = steps_done;
    std::map<std::string, std::string> files;
    if (rank0) {
      nlohmann::json st = {{"step", steps_done}, {"adam_steps", dense.opt.steps_taken()}, {"options", o.as_json()}};
      if (!model.router_bias().empty()) st["router_bias"] = model.router_bias();
      files["trainer_state.json"] = st.dump(2) + "\n";
      files["config.json"] = cfg.raw.dump(2) + "\n";
      if (!data->tokenizer_path().empty()) files["tokenizer.json"] = read_file_bytes(data->tokenizer_path());
    }
    const nlohmann::json layout = {{"world", world.size()}, {"tp", dims.tp}, {"cp", dims.cp}, {"dp", dims.dp},
                                   {"pp", dims.pp}, {"vpp", o.vpp}, {"ep", dims.ep}, {"etp", dims.etp},
                                   {"edp", dims.edp}, {"zero", o.zero}, {"sequence_parallel", o.sequence_parallel},
                                   {"description", layout_name}};
    return writer->save(steps_done, owned_pieces(), files, layout);
  };

  // 9. The step loop, on this DP rank's token windows.
  StopSignals stop_signals;  // SIGINT/SIGTERM are taken here, at step boundaries (core/stop_signals.h)
  std::vector<int32_t> tokens(size_t(micro * B * (T + 1)));
  std::vector<const int32_t*> micro_tokens;
  for (int64_t m = 0; m < micro; ++m) micro_tokens.push_back(tokens.data() + m * B * (T + 1));
  // Validation: the mean per-token LM loss over the first eval_iters global batches of the validation
  // data, rows split over DP as a training step's, forward only; the same reduction as the step's LM
  // loss (one rank per TP group; the last stage's; each CP rank its part).
  auto evaluate = [&]() -> double {
    double sum = 0;
    for (int64_t k = 0; k < o.eval_iters; ++k) {
      const int64_t row0 = k * G + dp_rank * (G / dp);
      for (int64_t r = 0; r < micro * B; ++r) eval_data->window(row0 + r, tokens.data() + r * (T + 1));
      sum += pipeline.evaluate(micro_tokens, B, T).lm_loss;
    }
    return world.all_reduce_value(tp_comm.rank() == 0 ? sum / double(micro * dp * o.eval_iters) : 0.0);
  };
  Timer run_timer;
  int exit_code = 0;
  int64_t skipped = 0, last_update = start_step;  // steps skipped for a non-finite loss or gradient; last step updated
  std::deque<double> recent_losses;                 // the last finite losses, for --loss-spike-factor (rank 0)
  const size_t num_moe = cfg.is_moe() ? size_t(cfg.num_layers * cfg.num_experts) : 0;
  // Test-only: ORIGAMI_TEST_ROUTING=DIR makes every rank append its own routed counts per step to
  // DIR/routing.RANK.jsonl, from which a test derives the dispatcher's bytes independently.
  std::unique_ptr<std::ofstream> routing_log;
  if (const char* dir = std::getenv("ORIGAMI_TEST_ROUTING"); dir && cfg.is_moe())
    routing_log = std::make_unique<std::ofstream>(cat(dir, "/routing.", world.rank(), ".jsonl"), std::ios::app);
  for (int64_t step = start_step; step < o.steps; ++step) {
    if (writer) writer->poll();  // commits an asynchronous save every rank has finished writing
    Timer step_timer;
    const double cpu0 = cpu_seconds();
    mesh.reset_bytes();
    cp.reset_counters();
    const std::vector<int64_t> step_samples = data->samples_per_dataset(step * G, G);
    if (embedding_comm) embedding_comm->reset_bytes();
    const double lr = lr_at(o.lr, step);
    // This DP rank's rows of the step, read by every pipeline stage (the first embeds them, the last
    // takes its targets from them).
    const int64_t row0 = step * G + dp_rank * (G / dp);
    for (int64_t r = 0; r < micro * B; ++r) data->window(row0 + r, tokens.data() + r * (T + 1));
    for (ParamSet* set : sets) set->dp.begin_step();
    model.reset_expert_counts();
    model.reset_act_peak();
    // Each micro-batch's loss enters the step's objective with weight 1/(G/B) (a mean over all of them).
    current_step = step + 1;
    const Losses sum = pipeline.run(micro_tokens, B, T, 1.f / float(micro * dp));
    // Non-finite guard: every rank learns from the norm's own all-reduce whether any rank's loss or
    // gradients were not finite, and then all skip the update together.
    const Gradients grads = finish_gradients({&dense.dp, &experts.dp}, world, sum.loss);
    const double gnorm = grads.norm;
    const bool skip = !grads.finite();
    if (!skip) {
      for (ParamSet* set : sets) {
        set->opt.step(set->params, lr, clip_coefficient(gnorm, o.grad_clip));
        set->dp.gather_params();
      }
      last_update = step + 1;
    } else {
      ++skipped;
    }

    // Step metrics over the job: the LM loss and per-stage figures from one rank per TP group (its
    // peers hold the same values) — per-stage ones from DP rank 0 only —; the router losses and expert
    // counts from every rank (each TP rank routes its own share of the tokens); CPU time and, for MoE,
    // the expert-side rows from every rank; the stop flag (any rank signalled). The loss parts come
    // from the stages that own them.
    const double weight = tp_comm.rank() == 0 ? 1.0 : 0.0, per = weight / double(micro * dp);
    const double share_per = 1.0 / double(micro * dp);
    const double stage_weight = grad_comm.rank() == 0 ? weight : 0.0;  // DP and CP rank 0
    std::vector<double> red = {sum.lm_loss * per, sum.aux_loss * share_per, sum.z_loss * share_per,
                               cpu_seconds() - cpu0, stop_signals.poll() ? 1.0 : 0.0};
    for (const auto& layer : model.expert_counts())
      for (int64_t c : layer) red.push_back(double(c));
    const size_t dropped_at = red.size();  // MoE: assignments the capacity dropped per layer
    for (int64_t d : model.expert_dropped()) red.push_back(double(d));
    if (routing_log) *routing_log << nlohmann::json({{"step", step + 1}, {"expert_counts", model.expert_counts()}}).dump() << std::endl;
    const size_t rows_at = red.size();  // MoE: expert-side rows per rank
    if (cfg.is_moe()) {
      red.resize(rows_at + size_t(world.size()), 0.0);
      red[rows_at + size_t(world.rank())] = double(model.expert_rows());
    }
    const size_t pairs_at = red.size();  // CP: the causal pairs each rank's attention computed
    if (cp.size() > 1) {
      red.resize(pairs_at + size_t(world.size()), 0.0);
      red[pairs_at + size_t(world.rank())] = double(cp.counters().pairs);
    }
    const size_t stage_at = red.size();  // per stage: measured and computed activation peak, busy, schedule and pp bytes
    red.resize(stage_at + 5 * size_t(pp), 0.0);
    const double stage_values[5] = {double(model.act_bytes_peak()), double(act_computed), pipeline.times().busy,
                                    pipeline.times().total, pp_comm.bytes_sent()};
    for (size_t k = 0; k < 5; ++k) red[stage_at + k * size_t(pp) + size_t(stage)] = stage_values[k] * stage_weight;
    world.all_reduce(red.data(), int64_t(red.size()));
    // MoE: the step's load per expert over every rank, and the aux-loss-free balancing's bias update.
    std::vector<std::vector<int64_t>> load(size_t(cfg.is_moe() ? cfg.num_layers : 0), std::vector<int64_t>(size_t(cfg.num_experts)));
    for (size_t i = 0; i < num_moe; ++i) load[i / size_t(cfg.num_experts)][i % size_t(cfg.num_experts)] = std::llround(red[5 + i]);
    if (cfg.routing.bias_rate > 0 && !skip) model.update_router_bias(load);
    auto per_stage = [&](size_t k) {
      return std::vector<double>(red.begin() + long(stage_at + k * size_t(pp)), red.begin() + long(stage_at + (k + 1) * size_t(pp)));
    };
    const double loss = red[0] + red[1] + red[2];
    const double ms = step_timer.ms();
    const double tok_s = double(G * T) / (ms / 1000.0);
    const double gflops = flops_per_step / (ms / 1000.0) / 1e9;
    const int64_t done = step + 1;
    const double eta = run_timer.ms() / 1000.0 / double(done - start_step) * double(o.steps - done);
    if (rank0 && (!o.quiet || done == o.steps || done % 50 == 0 || skip)) {
      std::printf("step %lld/%lld | loss %.4f", (long long)done, (long long)o.steps, loss);
      if (cfg.is_moe()) std::printf(" (lm %.4f aux %.4f z %.5f)", red[0], red[1], red[2]);
      std::printf(" | lr %.3e | grad norm %.3f | %.0f tok/s | %.1f ms | %.1f GFLOP/s | eta %s%s\n", lr, gnorm, tok_s, ms,
                  gflops, format_duration(eta).c_str(), skip ? " | update skipped" : "");
      std::fflush(stdout);
    }
    // A loss spike (above --loss-spike-factor times the median of the last finite losses) is a warning.
    bool spike = false;
    if (rank0 && o.loss_spike_factor > 0 && !skip) {
      if (recent_losses.size() >= kSpikeMinSteps) {
        std::vector<double> sorted(recent_losses.begin(), recent_losses.end());
        std::nth_element(sorted.begin(), sorted.begin() + long(sorted.size() / 2), sorted.end());
        const double median = sorted[sorted.size() / 2];
        if ((spike = loss > o.loss_spike_factor * median))
          std::fprintf(stderr, "origami train: warning: step %lld: loss spike: %.4f is %.2fx the median %.4f of the last %zu "
                       "steps (--loss-spike-factor %g)\n", (long long)done, loss, loss / median, median,
                       recent_losses.size(), o.loss_spike_factor);
      }
      recent_losses.push_back(loss);
      if (recent_losses.size() > kSpikeWindow) recent_losses.pop_front();
    }
    std::string non_finite;  // what was not finite, when the update was skipped
    if (skip) {
      non_finite = !grads.loss_finite && !std::isfinite(gnorm) ? cat("the loss (", loss, ") and the gradient norm (", gnorm, ") are not finite")
                   : !grads.loss_finite                         ? cat("the loss is not finite (", loss, ")")
                                                                : cat("the gradient norm is not finite (", gnorm, ")");
      if (rank0 && skipped <= o.max_skipped_steps)
        std::fprintf(stderr, "origami train: warning: step %lld: %s; the update was skipped on every rank (%lld of at "
                     "most %lld skipped steps, --max-skipped-steps)\n", (long long)done, non_finite.c_str(),
                     (long long)skipped, (long long)o.max_skipped_steps);
    }
    // Saves come before the step's metrics row, which records how long the loop was blocked.
    const bool stop = red[4] > 0, too_many_skips = skipped > o.max_skipped_steps;
    if (stop && rank0) std::printf("stopping on signal after step %lld\n", (long long)done);
    double save_blocked = 0;
    if (writer && !too_many_skips && (stop || done == o.steps || (o.save_every > 0 && done % o.save_every == 0)))
      save_blocked = save(done);
    // Validation after the step's own figures are taken (its forwards would add to them).
    const CpCounters step_cp = cp.counters();
    const std::map<std::string, double> step_bytes = mesh.bytes_sent();
    const double step_cp_bytes = cp.bytes_sent();
    const DispatchTimes step_dispatch = model.dispatch_times();
    const double step_moe_s = model.moe_layer_s();
    double val_loss = std::numeric_limits<double>::quiet_NaN();
    if (eval_data && !too_many_skips && (done == o.steps || (o.eval_every > 0 && done % o.eval_every == 0))) {
      Timer eval_timer;
      val_loss = evaluate();
      if (rank0) {
        std::printf("step %lld/%lld | val loss %.4f | val ppl %.3f | %.1f ms\n", (long long)done, (long long)o.steps,
                    val_loss, std::exp(val_loss), eval_timer.ms());
        std::fflush(stdout);
      }
    }
    if (metrics) {
      nlohmann::json bytes = nlohmann::json::object(), j_cp;
      for (const auto& [axis, b] : step_bytes) bytes[axis] = std::llround(b);
      if (cp.size() > 1) {
        bytes["cp"] = std::llround(step_cp_bytes);
        // Rank 0's ring: transfer time and the part waited for; every rank's causal pairs.
        j_cp = {{"ring_s", step_cp.transfer_s}, {"ring_wait_s", step_cp.wait_s},
                {"pairs", std::vector<int64_t>(red.begin() + long(pairs_at), red.begin() + long(pairs_at) + world.size())}};
      }
      if (embedding_comm && embedding_comm->bytes_sent() > 0) bytes["embedding"] = std::llround(embedding_comm->bytes_sent());
      auto as_int = [](const std::vector<double>& v) {
        std::vector<int64_t> r;
        for (double x : v) r.push_back(std::llround(x));
        return r;
      };
      auto as_ms = [](std::vector<double> v) {
        for (double& x : v) x *= 1000.0;
        return v;
      };
      nlohmann::json j = {{"step", done}, {"loss", loss}, {"lm_loss", red[0]}, {"aux_loss", red[1]},
                          {"z_loss", red[2]}, {"grad_norm", gnorm}, {"lr", lr}, {"tokens", G * T},
                          {"ms", ms}, {"tokens_per_s", tok_s}, {"gflops", gflops}, {"cpu_s", red[3]},
                          {"layout", layout_name}, {"comm_bytes", bytes},
                          {"act_bytes_peak", as_int(per_stage(0))}, {"act_bytes_computed", as_int(per_stage(1))},
                          {"pp_busy_ms", as_ms(per_stage(2))}, {"pp_ms", as_ms(per_stage(3))},
                          {"pp_bytes", as_int(per_stage(4))}};
      if (!j_cp.is_null()) j["cp"] = j_cp;
      j["attention_tiles"] = step_cp.tiles;  // rank 0's forward score tiles (fewer under document masking)
      if (data->parts().size() > 1) j["data_samples"] = step_samples;  // the step's rows from each dataset
      if (!std::isnan(val_loss)) j["val_loss"] = val_loss;
      if (skip) j["skipped"] = non_finite;
      if (spike) j["loss_spike"] = true;
      if (save_blocked > 0) j["save_blocked_s"] = save_blocked;
      j["rss_peak_bytes"] = peak_rss_bytes();  // rank 0's, so far
      if (done == start_step + 1) {  // the memory check's figures: the neediest rank's parts, every rank's total
        std::vector<int64_t> totals;
        for (const MemoryParts& m : memory.parts) totals.push_back(m.total());
        j["memory_bytes"] = memory.parts[memory.neediest].as_json();
        j["memory_bytes"]["rank"] = memory.neediest;
        j["memory_bytes_per_rank"] = totals;
        // The planner's prediction of this row's comm_bytes (train/comm_volume.h; the dispatcher's
        // payloads for evenly spread tokens).
        nlohmann::json predicted = nlohmann::json::object();
        for (const auto& [axis, b] : step_comm_bytes(cfg, o, world.size(), 0)) predicted[axis] = std::llround(b);
        j["comm_bytes_predicted"] = predicted;
      }
      if (cfg.is_moe()) {
        j["expert_tokens"] = load;
        std::vector<int64_t> dropped;
        for (int64_t l = 0; l < cfg.num_layers; ++l) dropped.push_back(std::llround(red[dropped_at + size_t(l)]));
        j["expert_dropped"] = dropped;
        if (!model.router_bias().empty()) j["router_bias"] = model.router_bias();
        // The rows each rank's experts computed, and per stage the most over the mean (the imbalance
        // the dispatcher saw; the largest over stages).
        std::vector<int64_t> rows(red.begin() + long(rows_at), red.begin() + long(rows_at) + world.size());
        double imbalance = 1;
        for (int s = 0; s < pp; ++s) {
          double most = 0, total = 0, n = 0;
          for (int r = 0; r < world.size(); ++r)
            if (plan.mesh.coord(r, "pp") == s) most = std::max(most, double(rows[size_t(r)])), total += double(rows[size_t(r)]), ++n;
          if (total > 0) imbalance = std::max(imbalance, most / (total / n));
        }
        j["expert_rows"] = rows;
        j["expert_imbalance"] = imbalance;
        // Rank 0's MoE layers: their time, the exchanges', and the dispatcher's own work (regrouping,
        // permute and combine), the overhead the exchanges do not explain.
        const DispatchTimes& dt = step_dispatch;
        j["moe_times"] = {{"layer_s", step_moe_s}, {"exchange_s", dt.exchange_s}, {"regroup_s", dt.regroup_s},
                          {"permute_s", dt.permute_s}};
      }
      *metrics << j.dump() << "\n";
      metrics->flush();
    }
    if (too_many_skips) {  // every rank takes this branch: `skipped` comes from the norm's all-reduce
      if (rank0) {
        std::fprintf(stderr, "origami train: error: step %lld: %s; %lld skipped step%s exceed%s --max-skipped-steps %lld: "
                     "stopping without saving (%s%s)\n", (long long)done,
                     non_finite.c_str(), (long long)skipped, skipped == 1 ? "" : "s", skipped == 1 ? "s" : "",
                     (long long)o.max_skipped_steps,
                     last_update > 0 ? cat("the last update was step ", last_update).c_str() : "no update was made",
                     last_saved >= 0 ? cat("; ", o.save, " holds step ", last_saved).c_str() : "");
        std::fflush(stderr);
      }
      exit_code = kExitNonFinite;
      break;
    }
    if (save_blocked < 0) {
      exit_code = kExitNonFinite;
      break;
    }
    if (stop) {
      exit_code = kExitSignal;
      break;
    }
  }
  if (writer) writer->finish();  // an asynchronous save still being written is committed before exit
  if (rank0 && skipped > 0 && exit_code != kExitNonFinite)
    std::fprintf(stderr, "origami train: warning: %lld step%s skipped for a non-finite loss or gradient norm\n",
                 (long long)skipped, skipped == 1 ? " was" : "s were");
  return exit_code;
}

}  // namespace origami
