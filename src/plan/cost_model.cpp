#include "plan/cost_model.h"

#include <algorithm>
#include <limits>
#include <cmath>

#include "core/error.h"
#include "model/model.h"
#include "model/params.h"
#include "parallel/mesh.h"
#include "parallel/schedule.h"
#include "train/comm_volume.h"

namespace origami {

nlohmann::json Prediction::as_json() const {
  nlohmann::json exposed = nlohmann::json::object();
  for (const auto& [axis, s] : exposed_s) exposed[axis] = s;
  nlohmann::json mem = memory.as_json(), stages = nlohmann::json::array();
  mem["rank"] = memory_rank;
  mem["total"] = memory.total();
  for (const MemoryParts& m : stage_memory) stages.push_back(m.as_json());
  nlohmann::json parts = nlohmann::json::object();
  for (const auto& [name, seconds] : breakdown()) parts[name] = seconds;
  return {{"step_time_s", step_s}, {"tokens_per_s", tokens_per_s}, {"mfu", mfu}, {"compute_s", compute_s},
          {"bubble_s", bubble_s}, {"exposed_s", exposed}, {"breakdown", parts}, {"memory_bytes_per_rank", mem},
          {"memory_bytes_per_stage", stages}, {"comm_bytes", comm_bytes},
          {"dominant", dominant}};
}

std::vector<std::pair<std::string, double>> Prediction::breakdown() const {
  std::vector<std::pair<std::string, double>> parts;
  for (const char* term : {"gemm", "attention", "elementwise", "kernels"})
    if (compute_parts.count(term)) parts.emplace_back(std::string("compute: ") + term, compute_parts.at(term));
  parts.emplace_back("bubble", bubble_s);
  for (const auto& [k, s] : exposed_s) parts.emplace_back(k == "optimizer" || k == "page faults" ? k : "exposed: " + k, s);
  return parts;
}

namespace {

// Seconds of one GEMM y[M, N] = x[M, K]·W (2·M·N·K FLOPs) at the cluster's rate for its size; a
// weight gradient adds into its C (accumulate).
double gemm_s(const Cluster& c, double M, double N, double K, bool accumulate = false) {
  return M > 0 && N > 0 && K > 0 ? 2 * M * N * K / c.gemm_rate(M, N, K, accumulate) : 0;
}
// A linear layer of `rows` rows, in → out features: forward, and backward (input and weight gradients).
using Pass = CostModel::Pass;
Pass linear(const Cluster& c, double rows, double in, double out) {
  return {gemm_s(c, rows, out, in), gemm_s(c, rows, in, out) + gemm_s(c, out, in, rows, true)};
}

// Whether the ranks of `rank`'s group along `axes` sit on more than one node.
bool spans_nodes(const MeshShape& mesh, int rank, const std::string& axes, int per_node) {
  const std::vector<int> group = mesh.group(rank, axes);
  return std::any_of(group.begin(), group.end(), [&](int r) { return r / per_node != group.front() / per_node; });
}
// How many ranks of `rank`'s group along `axes` share its node (itself included).
int in_node(const MeshShape& mesh, int rank, const std::string& axes, int per_node) {
  const std::vector<int> group = mesh.group(rank, axes);
  return int(std::count_if(group.begin(), group.end(), [&](int r) { return r / per_node == rank / per_node; }));
}

// A layer's forward passes in a step per micro-batch: full recomputation runs it again before backward.
int forward_passes(const TrainOptions& o) { return parse_recompute(o.recompute) == Recompute::full ? 2 : 1; }

}  // namespace

CostModel::CostModel(const ModelConfig& cfg, const Cluster& cluster, int devices, int64_t runtime, RoutingSkew skew)
    : cfg_(cfg), num_tensors_(int64_t(make_param_table(cfg).size())), cluster_(cluster), bf16_(cluster.at("bf16")),
      devices_(devices), runtime_(runtime), skew_(std::move(skew)) {}

const CostModel::LayerCosts& CostModel::layer_costs(const TrainOptions& o, const MeshDims& m, int terms) {
  const bool sp = o.sequence_parallel && m.tp > 1, bf16 = o.precision == "bf16";
  const auto key = std::make_tuple(m.tp, m.cp, m.ep, m.etp, o.micro_batch, o.seq_len, sp, bf16, terms);
  const auto found = layers_.find(key);
  if (found != layers_.end()) return found->second;
  const Cluster& k = at(o);
  const int t = m.tp;
  const double N = double(o.micro_batch * o.seq_len / m.cp), C = double(cfg_.hidden), D = double(cfg_.head_dim);
  const double H = double(cfg_.num_heads / t), KV = double(cfg_.num_kv_heads / t);
  // Element-wise work streams memory: `elements` read and written in forward and backward together,
  // a third of it forward. Per token, stated counts: norms and residual adds 22·C (on N/TP tokens under
  // SP), RoPE on q and k 4·(H + KV)·D, the gated activation 8·F (GELU 6·F), the dispatcher's permute
  // and combine 8·C per routed row, the cross-entropy 6·V.
  auto stream_s = [&](double elements) {
    return k.memory_bandwidth > 0 && (terms & kStreamed) ? k.activation_bytes() * elements / k.memory_bandwidth : 0;
  };
  auto streamed = [&](double elements) {
    const double s = stream_s(elements);
    return Pass{s / 3, 2 * s / 3};
  };
  // A linear's GEMMs. Under bf16 on a CPU (rounds_operands) the passes that round their operands are
  // not priced apart: the profiled bf16 curve times calls that round an fp32 operand inside, which
  // stands in for them (origami's linears round some inputs in their producer, some in the call).
  auto gemms = [&](double rows, double in, double out) { return terms & kGemm ? linear(k, rows, in, out) : Pass{}; };
  // Kernel launches (forward, backward) as Megatron-Core issues them with fused norms, FlashAttention
  // and grouped expert GEMMs: attention block 6 and 12 (norm, q|k|v, RoPE, core, output, residual
  // add), dense MLP 5 and 8, MoE MLP 13 and 24 (router, top-k, aux loss, permute, three grouped
  // GEMM steps, unpermute), head 4 and 4.
  auto kernels = [&](double fwd, double bwd) {
    return terms & kKernels ? Pass{fwd * k.kernel_overhead, bwd * k.kernel_overhead} : Pass{};
  };
  // origami's sequence parallelism with several rows a micro-batch (a CPU cluster: the runtime's own)
  // reorders each gathered or reduce-scattered [N, C] fp32 activation between the rows' order and the
  // shards' (TensorParallel::from_shards / to_shards: N·C read and written a copy). A block (attention,
  // dense MLP) copies twice forward (its norm's gather, its exit) and three times backward (the kept
  // norm output gathered again, the exit's and the entry's). Megatron's sequence-first activations
  // (GPU clusters) need no reorder. (A CPU cluster's activations are 4 bytes in either precision.)
  auto reorders = [&](double fwd, double bwd) {
    if (!sp || o.micro_batch < 2 || k.sms > 0) return Pass{};
    const double copy = stream_s(2 * N * C);
    return Pass{fwd * copy, bwd * copy};
  };
  LayerCosts l;
  l.attention_linears = gemms(N, C, (H + 2 * KV) * D);  // q|k|v
  l.attention_linears += gemms(N, H * D, C);            // attention output
  l.attention_linears += streamed((sp ? N / t : N) * 22 * C + N * 4 * (H + KV) * D);
  l.attention_linears += kernels(6, 12);
  l.attention_linears += reorders(2, 3);
  if (terms & kAttention) l.attention_core = 6 * double(o.seq_len) * H * D * N / k.attention_rate(double(o.seq_len), D);
  if (cfg_.has_dense_layers()) {
    const double F = double(cfg_.ffn / t);
    l.dense_mlp = gemms(N, C, cfg_.is_gpt2() ? F : 2 * F);
    l.dense_mlp += gemms(N, F, C);
    l.dense_mlp += streamed(N * (cfg_.is_gpt2() ? 6 : 8) * F);
    l.dense_mlp += kernels(5, 8);
    l.dense_mlp += reorders(2, 3);
  }
  if (cfg_.is_moe()) {
    // The router on this rank's share of the tokens; each local expert on the rows routed to it.
    const double share = N / t, E = double(cfg_.num_experts), El = E / m.ep, Fe = double(cfg_.expert_ffn / m.etp);
    l.moe_mlp = gemms(share, C, E);
    const double rows = share * double(cfg_.top_k) * m.etp * skew_.at(m.ep) / El;
    Pass expert = gemms(rows, C, 2 * Fe);
    expert += gemms(rows, Fe, C);
    expert += streamed(rows * 8 * (Fe + C));
    l.moe_mlp += {El * expert.fwd, El * expert.bwd};
    l.moe_mlp += kernels(13, 24);
    if (cfg_.shared_ffn > 0) {
      const double Fs = double(cfg_.shared_ffn / t);
      l.moe_mlp += gemms(N, C, 2 * Fs);
      l.moe_mlp += gemms(N, Fs, C);
      l.moe_mlp += streamed(N * 8 * Fs);
      l.moe_mlp += kernels(5, 8);
      l.moe_mlp += reorders(2, 3);  // (the shared expert runs as a dense MLP; the routed ones keep the shards)
    }
  }
  const double V = double((cfg_.vocab_size + t - 1) / t);
  l.head = gemms(N, C, V);
  l.head += streamed(N * 6 * V);
  l.head += kernels(4, 4);
  l.final_norm = reorders(1, 1);  // its gather and its backward's reduce-scatter (the embedding's pair, on the
                                  // first stage, is left out)
  return layers_.emplace(key, l).first->second;
}

const CostModel::Split& CostModel::split(const TrainOptions& o, int pp) {
  const auto key = std::make_tuple(pp, o.vpp, o.pp_layers, o.vocab_parallel);
  auto found = splits_.find(key);
  if (found == splits_.end()) {
    Split split;
    try {
      const std::vector<LayerRange> virtual_stages = partition_layers(int(cfg_.num_layers), pp, o.vpp, o.pp_layers);
      for (int s = 0; s < pp; ++s) split.parts.push_back(ModelPart::of_stage(virtual_stages, pp, s, o.vocab_parallel));
    } catch (const Error& e) {
      split = {{}, e.what()};
    }
    found = splits_.emplace(key, std::move(split)).first;
  }
  return found->second;
}

const std::string* CostModel::split_refusal(const TrainOptions& o) {
  const Split& s = split(o, o.pp);
  return s.parts.empty() ? &s.refusal : nullptr;
}

const std::vector<ModelPart>& CostModel::stage_parts(const TrainOptions& o, int pp) {
  const Split& s = split(o, pp);
  if (s.parts.empty()) fail(s.refusal);
  return s.parts;
}

std::vector<CostModel::StageCompute> CostModel::stage_compute(const TrainOptions& o, const MeshDims& m, int terms) {
  const LayerCosts& l = layer_costs(o, m, terms);
  const Recompute rc = parse_recompute(o.recompute);
  std::vector<StageCompute> out;
  for (const ModelPart& part : stage_parts(o, m.pp)) {
    Pass compute;
    double attention = 0;
    for (const LayerRange& r : part.chunks) {
      const double layers = double(r.end - r.begin), moe = double(cfg_.num_moe_layers(r.begin, r.end));
      compute += {layers * l.attention_linears.fwd, layers * l.attention_linears.bwd};
      compute += {moe * l.moe_mlp.fwd + (layers - moe) * l.dense_mlp.fwd,
                  moe * l.moe_mlp.bwd + (layers - moe) * l.dense_mlp.bwd};
      attention += layers * l.attention_core;
    }
    // Recomputation: the layers' forward (full) or the attention core's (selective) again in backward;
    // the head's never.
    const double recomputed = compute.fwd;
    if (part.head && !part.vocab_parallel()) compute += l.head;
    if (part.head) compute += l.final_norm;
    // Vocabulary parallelism: every stage's output passes run 1/p of the LM head (the vocabulary
    // slices), apart from the forwards and backwards.
    StageCompute s{compute.fwd + attention / 3, compute.bwd + 2 * attention / 3, attention,
                   part.vocab_parallel() ? (l.head.fwd + l.head.bwd) / m.pp : 0.0};
    if (rc == Recompute::full) s.bwd += recomputed + attention / 3;
    if (rc == Recompute::selective) s.bwd += attention / 3;
    out.push_back(s);
  }
  return out;
}

const RankBuffers& CostModel::buffers(const TrainOptions& o, const MeshShape& mesh, int rank) {
  const MeshDims& m = mesh.dims();
  const BufferKey key{m.tp, m.cp, m.dp, m.pp, m.ep, m.etp, o.vpp, o.bucket_mb,
                      (o.zero == 3 ? 1 : 0) + (o.fssdp() ? 2 : 0) + (o.precision == "bf16" ? 4 : 0) +
                          (o.vocab_parallel ? 8 : 0) + (o.zero >= 1 && o.precision == "bf16" ? 16 : 0),
                      rank,
                      o.mesh_order, o.pp_layers};
  const auto found = buffers_.find(key);
  if (found != buffers_.end()) return found->second;
  // The stage's tables, cut for this rank's EP rank.
  const int stage = mesh.coord(rank, "pp"), ep_rank = mesh.coord(rank, "ep");
  const auto table_key = std::make_tuple(m.pp, o.vpp, o.pp_layers, stage, m.ep, ep_rank, o.vocab_parallel);
  const ModelPart part = stage_parts(o, m.pp)[size_t(stage)];
  auto table = tables_.find(table_key);
  if (table == tables_.end())
    table = tables_.emplace(table_key, split_experts(make_param_table(cfg_, part), cfg_.num_experts, m.ep, ep_rank)).first;
  return buffers_.emplace(key, rank_buffers(o, devices_, rank, table->second, part.chunks)).first->second;
}

// The schedule with the busiest stage's times on every stage. Its makespan scales with them: in units
// of the forward, per schedule and ratios to the forward (backward, output pass). With every stage
// alike and no output passes, every schedule's makespan is its fill and drain plus the steady state,
// (m + (p − 1)/v)·(f + b) (tests/unit/test_cost_model.cpp checks the replay gives exactly that);
// the output passes' placement is replayed.
double CostModel::makespan_units(const TrainOptions& o, int64_t micro, double backward, double vocab) {
  const int p = o.layout_dims(devices_).pp, v = o.vpp;
  if (!(o.vocab_parallel && p > 1)) return (double(micro) + double(p - 1) / v) * (1 + backward);
  const auto key = std::make_tuple(int(o.schedule_kind()), p, micro, v, backward, vocab);
  auto replayed = makespans_.find(key);
  if (replayed == makespans_.end()) {
    std::vector<std::vector<Action>> lists;  // (stage_actions keeps the last pipelines' lists)
    for (int s = 0; s < p; ++s) lists.push_back(stage_actions(o.schedule_kind(), p, s, int(micro), v, true));
    const double makespan = replay_schedules(lists, p, int(micro), v, 1.0 / v, backward / v, vocab).makespan;
    replayed = makespans_.emplace(key, makespan).first;
  }
  return replayed->second;
}

double CostModel::step_bound(const TrainOptions& o) {
  const MeshDims m = o.layout_dims(devices_);
  double busy = 0, vocab = 0;  // (the output passes run once per micro-batch, outside the fill and drain)
  for (const StageCompute& s : stage_compute(o, m)) busy = std::max(busy, s.fwd + s.bwd), vocab = std::max(vocab, s.vocab);
  const double micro = double(o.micro_batches(devices_));
  return (micro + double(m.pp - 1) / o.vpp) * busy + micro * vocab;
}

// The blocking communication of one micro-batch on stage s (its first rank's bytes per step, `bytes`),
// per kind: each hides behind compute as far as the cluster overlaps it (TP, the dispatcher and
// pipeline messages block unless the file says otherwise).
std::map<std::string, double> CostModel::stage_exposed(const TrainOptions& o, const MeshShape& mesh,
                                                       const Cluster& cluster, int s,
                                                       const std::map<std::string, double>& bytes, double attention) {
  const MeshDims& m = mesh.dims();
  const int t = m.tp, c = m.cp, p = m.pp, v = o.vpp, per_node = cluster.devices_per_node;
  const int rank = mesh.group(0, "pp")[size_t(s)];
  const double micro = double(o.micro_batches(devices_));
  const double N = double(o.micro_batch * o.seq_len / c), C = double(cfg_.hidden);
  const bool sp = o.sequence_parallel && t > 1;
  const ModelPart& part = stage_parts(o, p)[size_t(s)];
  auto tier = [&](const std::string& axes) { return spans_nodes(mesh, rank, axes, per_node); };
  // One micro-batch's share of a communicator's bytes, moved by `collective` ("gather+scatter": half
  // by all-gathers, half by reduce-scatters, each with half the steps).
  auto per_micro = [&](const std::string& key, const std::string& axes, double steps, const std::string& collective) {
    const auto it = bytes.find(key);
    if (it == bytes.end()) return 0.0;
    const double x = it->second / micro;
    if (collective != "gather+scatter") return cluster.transfer_seconds(x, steps, tier(axes), collective);
    return cluster.transfer_seconds(x / 2, steps / 2, tier(axes), "all_gather") +
           cluster.transfer_seconds(x / 2, steps / 2, tier(axes), "reduce_scatter");
  };
  std::map<std::string, double> exposed;
  const double layers = double(part.num_layers());
  const double tp_shown = 1 - cluster.overlap_of("tp"), ep_shown = 1 - cluster.overlap_of("ep");
  // TP regions: all-reduces, or under SP all-gathers and reduce-scatters (twice as many, half the steps).
  exposed["tp"] = tp_shown * per_micro("tp", "tp", (layers * 6 + 3) * 2 * (t - 1), sp ? "gather+scatter" : "all_reduce");
  exposed["tp-cp"] = tp_shown * per_micro("tp-cp", "tp-cp", layers * 2 * (double(t) * c - 1), "all_reduce");
  // The dispatcher's exchanges are all-to-alls: the peers in the node over its links, the others
  // across nodes at once; ETP's are ring collectives. Per MoE layer (comm_volume.cpp): the row counts
  // in each forward (again in full recomputation's), and the rows to the experts and back in each
  // forward and in backward.
  double moe_layers = 0;  // (the step counts below are doubles: a huge layout's pass 2^31)
  for (const LayerRange& r : part.chunks) moe_layers += double(cfg_.num_moe_layers(r.begin, r.end));
  const int forwards = forward_passes(o);
  const double exchanges = moe_layers * (forwards + 2 * (forwards + 1));
  const auto dispatched = bytes.find("ep");
  const double dispatch = dispatched == bytes.end() ? 0.0
      : cluster.all_to_all_seconds(dispatched->second / micro, exchanges, m.ep, in_node(mesh, rank, "ep", per_node));
  exposed["ep"] = ep_shown * (dispatch + per_micro("etp", "etp", exchanges * (m.etp - 1), "gather+scatter"));
  // FSSDP's exchanges over EDP block inside each MoE layer (comm_volume.cpp, sparse_expert_bytes): per
  // layer and micro-batch the needs exchanged before each gather and the reduction, a gather in each
  // forward and in backward, and the reduction, each an all-to-all of run-time sizes.
  if (o.fssdp()) {
    // (under keep only the step's first gathers move anything: the needs are exchanged every time)
    const double gathers = o.fssdp_keep ? 1.0 / micro : forwards + 1;
    const double calls = std::round(moe_layers * (forwards + 3 + gathers));
    const auto sparse = bytes.find("edp");
    exposed["edp"] = sparse == bytes.end() ? 0.0
        : cluster.all_to_all_seconds(sparse->second / micro, calls, m.edp, in_node(mesh, rank, "edp", per_node)) +
              // (unpriced, as every streamed term, where the file gives no memory bandwidth)
              (cluster.memory_bandwidth > 0
                   ? fssdp_staging_bytes(o, buffers(o, mesh, rank).experts, part, m.edp) / micro / cluster.memory_bandwidth
                   : 0.0);
  }
  // The ring's transfers hide behind the attention core as far as the cluster overlaps; the
  // all-to-all (a2a) sits before and after it.
  const double cp_s = per_micro("cp", "cp", layers * 2 * c, o.cp_a2a() == c ? "all_to_all" : "send_recv");
  exposed["cp"] = o.cp_a2a() == c ? cp_s : std::max(0.0, cp_s - cluster.overlap_of("cp") * attention);
  // One message after each forward and backward of a chunk; under vocabulary parallelism also its
  // passes' collectives (two all-reduces, an all-gather, the broadcasts: their bytes, ~6 hops each).
  if (p > 1)
    exposed["pp"] = (1 - cluster.overlap_of("pp")) *
                    (part.vocab_parallel()
                         ? per_micro("pp", "pp", 2 * v + 6 * (p - 1), "all_reduce")
                         : 2 * v * cluster.transfer_seconds(cluster.activation_bytes() * (sp ? N / t : N) * C, 1,
                                                            tier("pp"), "send_recv"));
  return exposed;
}

// FSSDP's passes over memory in a step on one rank (DataParallel::gather_experts, reduce_experts), per
// MoE layer and micro-batch: each gather (every forward's and backward's; under keep, the step's
// first) writes this rank's shard of the layer into the staging area for itself — a copy, 8 bytes an
// element, or under bf16 a rounding, 6 — and under bf16 rounds it for each peer too; the reduction
// adds its own piece (fp32, 12 bytes an element) and each peer's (12; 10 from a bf16 wire, whose
// pieces it also rounds to send, 6) into its shard and clears the staged gradients (4). `experts`:
// the rank's experts' buffer figures; n: EDP.
double CostModel::fssdp_staging_bytes(const TrainOptions& o, const BufferFigures& experts, const ModelPart& part, int n) {
  const bool bf16 = o.precision == "bf16", wire16 = dtype_bytes(o.grad_reduce_wire()) == 2;
  const int64_t micro = o.micro_batches(devices_);
  const int forwards = forward_passes(o);
  const double gathers = o.fssdp_keep ? 1.0 : double(micro * (forwards + 1));
  double bytes = 0;
  for (const LayerRange& r : part.chunks)
    for (int64_t l = r.begin; l < r.end; ++l) {
      if (!cfg_.is_moe_layer(l)) continue;
      const double data = double(experts.unit_data.at(l)), shard = double(experts.unit_shard_data.at(l));
      const double gather = bf16 ? 6 * shard * n : 8 * shard;
      const double reduce = 12 * shard + (wire16 ? 10 : 12) * shard * (n - 1) + (wire16 ? 6 * (data - shard) : 0) + 4 * data;
      bytes += gathers * gather + double(micro) * reduce;
    }
  return bytes;
}

// One stage's gradient reductions after its backward, per key ("dp", "dp-cp", "edp"), from its
// first rank's bytes of the step: the buckets' tail (the last bucket of each set; of the other buckets
// what the cluster does not overlap with the backward they can hide behind: the last micro-batch's,
// or under ZeRO-2 and 3, which reduce every micro-batch, all of them) and ZeRO-1/2's parameter gather
// (as far as the cluster overlaps it with the next step's first forward). ZeRO-3's gathers, each
// unit's before its use with the next one prefetched, hide behind the forwards and backwards like
// the reductions. f, b: the busiest stage's forward and backward of one micro-batch.
std::map<std::string, double> CostModel::gradient_exposed(const TrainOptions& o, const MeshShape& mesh,
                                                          const Cluster& cluster, double f, double b, int rank,
                                                          const std::map<std::string, double>& bytes) {
  const MeshDims& m = mesh.dims();
  const int c = m.cp;
  const int64_t micro = o.micro_batches(devices_);
  std::map<std::string, double> exposed;
  const double window = (o.zero >= 2 ? double(micro) : 1.0) * (o.zero == 3 ? f + b : b);
  const RankBuffers& held = buffers(o, mesh, rank);
  for (const char* key : {"dp", "dp-cp", "edp"}) {
    const auto it = bytes.find(key);
    const std::string axes = key;
    const bool experts = axes == "edp";
    if (it == bytes.end() || (experts && o.fssdp())) continue;  // (FSSDP's exchanges block in the layers: stage_exposed)
    const int group = experts ? m.edp : axes == "dp" ? m.dp : m.dp * c, zero = o.zero_of(experts);
    const bool inter = spans_nodes(mesh, rank, experts ? "edp" : "dp-cp", cluster.devices_per_node);
    const double total = it->second;
    // (with CP the dense gradients are "dp-cp"'s; "dp" then holds only a global aux loss's router counts)
    const bool gradients = experts || axes == (c > 1 ? "dp-cp" : "dp");
    const double gather = gradients ? zero_gather_bytes(experts ? held.experts : held.dense, group, zero) : 0.0;
    // The last bucket (--bucket-mb of fp32 gradients, sent as the wire type): all-reduced, or
    // reduce-scattered under ZeRO.
    const double last = o.bucket_mb * 1024 * 1024 / 4 * dtype_bytes(o.grad_reduce_wire());
    const double tail = std::min(total - gather, zero == 0 ? all_reduce_bytes(group, last)
                                                           : scatter_gather_bytes(group, last / group));
    // ZeRO-0 all-reduces; ZeRO-1, 2 and 3 reduce-scatter (and gather). A bucket is reduced while
    // backward streams the next layers through the caches: the reduction, its last bucket and the
    // gather all move at the rate of messages beyond the caches, the largest the cluster measured.
    const std::string reduce = zero == 0 ? "all_reduce" : "reduce_scatter";
    const double step = std::numeric_limits<double>::infinity();
    const double reduce_s = cluster.transfer_seconds(total - gather, 2 * (group - 1), inter, reduce, step),
                 tail_s = cluster.transfer_seconds(tail, 0, inter, reduce, step),
                 gather_s = gather > 0 ? cluster.transfer_seconds(gather, group - 1, inter, "all_gather", step) : 0.0;
    const double hidden = cluster.overlap_of("dp") * std::clamp(reduce_s - tail_s, 0.0, window) +
                          cluster.overlap_of("param-gather") * std::min(gather_s, f);
    exposed[axes] = reduce_s + gather_s - hidden;
  }
  return exposed;
}

// After backward: the slowest stage's gradient reductions (gradient_exposed), the tied embedding and
// the world's reductions, ZeRO ≥ 2's gradient pages written afresh; then AdamW's pass over the owned
// state. f, b: the busiest stage's forward and backward of one micro-batch; stage_bytes: each
// stage's first rank's bytes of the step. Adds each part to out.exposed_s.
double CostModel::after_backward(const TrainOptions& o, const MeshShape& mesh, const Cluster& cluster, double f,
                                 double b, const std::vector<std::map<std::string, double>>& stage_bytes,
                                 Prediction& out) {
  const int devices = devices_, per_node = cluster.devices_per_node;
  const int64_t micro = o.micro_batches(devices);
  auto tier = [&](int rank, const std::string& axes) { return spans_nodes(mesh, rank, axes, per_node); };
  const std::vector<int> stage_ranks = mesh.group(0, "pp");
  std::map<std::string, double> slowest;
  double after = 0;
  for (size_t s = 0; s < stage_ranks.size(); ++s) {
    const std::map<std::string, double> exposed = gradient_exposed(o, mesh, cluster, f, b, stage_ranks[s], stage_bytes[s]);
    double sum = 0;
    for (const auto& [k, x] : exposed) sum += x;
    if (s == 0 || sum > after) slowest = exposed, after = sum;
  }
  for (const auto& [k, x] : slowest) out.exposed_s[k] = x;
  for (const char* key : {"embedding", "world"}) {
    const auto it = out.comm_bytes.find(key);
    if (it == out.comm_bytes.end()) continue;
    // A few doubles: latency-bound, a tree's 2·log2(n) steps per all-reduce (two of them for the world).
    const int n = std::string(key) == "world" ? devices : 2, steps = 2 * int(std::ceil(std::log2(double(n))));
    out.exposed_s[key] = cluster.transfer_seconds(it->second, (std::string(key) == "world" ? 2 : 1) * steps,
                                                  std::string(key) == "world" ? devices > per_node : tier(0, "pp"));
    after += out.exposed_s[key];
  }
  // ZeRO ≥ 2 returns the gradient buffer's pages outside the shards once each bucket is reduced, so
  // every micro-batch's backward writes them into fresh pages (the shards' own pages only in the first).
  // FSSDP's experts accumulate in a resident staging area instead. (ZeRO-3 also returns each unit's
  // gathered weights after use, and bf16 reductions their wire copy per bucket: not priced.)
  if (o.zero >= 2 && cluster.first_touch > 0) {
    const RankBuffers& held = buffers(o, mesh, out.memory_rank);
    double floats = double(micro) * double(held.dense.size - held.dense.shard) + double(held.dense.shard);
    if (!o.fssdp()) floats += double(micro) * double(held.experts.size - held.experts.shard) + double(held.experts.shard);
    out.exposed_s["page faults"] = 4 * floats / cluster.first_touch;
    after += out.exposed_s["page faults"];
  }
  // AdamW over the elements this rank updates (its moments are 8 bytes each): the fp32 weight,
  // gradient and two moments read, three written back, the gradient read once more for the clipping
  // norm, and under bf16 the weight's 2-byte copy written: 32 bytes (34), and 3 kernels per tensor of the stage.
  if (cluster.memory_bandwidth > 0) {
    const double owned = double(out.memory.optimizer) / 8, bytes = owned * (o.precision == "bf16" ? 34 : 32);
    const double tensors = double(num_tensors_) / mesh.dims().pp;  // about the stage's share of them
    out.exposed_s["optimizer"] = bytes / cluster.memory_bandwidth + 3 * tensors * cluster.kernel_overhead;
    after += out.exposed_s["optimizer"];
  }
  return after;
}

Prediction CostModel::predict(const TrainOptions& options, double memory_limit) {
  const TrainOptions o = options.resolved(devices_);
  o.validate(cfg_, devices_);
  const ModelConfig& cfg = cfg_;
  const Cluster& cluster = at(o);
  const int devices = devices_;
  const MeshShape mesh(devices, o.layout_dims(devices), o.mesh_order);
  const MeshDims& m = mesh.dims();
  const int p = m.pp;
  const int64_t T = o.seq_len, G = o.global_batch, micro = o.micro_batches(devices);
  // Each stage's representative, its first rank: every other coordinate 0 (rank 0's pipeline group).
  const std::vector<int> stage_ranks = mesh.group(0, "pp");

  // Memory first: every stage's first rank (the others differ only by ZeRO padding and shards); the
  // first stage over the limit ends the prediction.
  Prediction out;
  for (int r : stage_ranks) {
    out.stage_memory.push_back(rank_memory(cfg, o, devices, r, buffers(o, mesh, r), runtime_));
    if (out.stage_memory.back().total() > out.memory.total()) out.memory = out.stage_memory.back(), out.memory_rank = r;
    if (double(out.memory.total()) > memory_limit) {
      out.fits = false;
      return out;
    }
  }

  // Per stage: compute and blocking communication of one micro-batch (all its chunks).
  const std::vector<StageCompute> compute = stage_compute(o, m);
  double worst_f = 0, worst_b = 0, worst_vocab = 0, worst_compute = 0;
  int worst = 0;
  std::map<std::string, double> worst_exposed;
  std::vector<std::map<std::string, double>> stage_bytes;
  for (int s = 0; s < p; ++s) {
    const int rank = stage_ranks[size_t(s)];
    const double fwd = compute[size_t(s)].fwd, bwd = compute[size_t(s)].bwd, busy = fwd + bwd;
    // Blocking communication per micro-batch, from the stage rank's bytes per step.
    const std::map<std::string, double> bytes =
        step_comm_bytes(cfg, o, devices, rank, buffers(o, mesh, rank), skew_.at(m.ep));
    if (s == 0) out.comm_bytes = bytes;
    stage_bytes.push_back(bytes);
    const std::map<std::string, double> exposed = stage_exposed(o, mesh, cluster, s, bytes, compute[size_t(s)].attention);
    double blocking = 0;
    for (const auto& [k, x] : exposed) blocking += x;
    const double f = fwd + blocking * fwd / busy, b = bwd + blocking * bwd / busy, vocab = compute[size_t(s)].vocab;
    if (f + b + vocab > worst_f + worst_b + worst_vocab)
      worst_f = f, worst_b = b, worst_vocab = vocab, worst_compute = busy + vocab, worst_exposed = exposed, worst = s;
  }
  // The busiest stage's compute by term (they add up to compute_s).
  for (const auto& [name, term] : {std::pair{"gemm", kGemm}, {"attention", kAttention}, {"elementwise", kStreamed},
                                   {"kernels", kKernels}}) {
    const StageCompute part = stage_compute(o, m, term)[size_t(worst)];
    out.compute_parts[name] = double(micro) * (part.fwd + part.bwd + part.vocab);
  }
  const double makespan = makespan_units(o, micro, worst_b / worst_f, worst_vocab / worst_f) * worst_f;
  out.compute_s = double(micro) * worst_compute;
  for (const auto& [k, x] : worst_exposed)
    if (x > 0) out.exposed_s[k] = double(micro) * x;
  out.bubble_s = std::max(0.0, makespan - double(micro) * (worst_f + worst_b + worst_vocab));  // (no -1e-17 from rounding)

  const double after = after_backward(o, mesh, cluster, worst_f, worst_b, stage_bytes, out);
  out.step_s = makespan + after;
  out.tokens_per_s = double(G * T) / out.step_s;
  out.mfu = train_flops_per_token(cfg, T) * double(G * T) / (out.step_s * devices * cluster.peak_flops);
  double largest = out.compute_s;
  out.dominant = "compute";
  if (out.bubble_s > largest) largest = out.bubble_s, out.dominant = "bubble";
  for (const auto& [k, x] : out.exposed_s)
    if (x > largest) largest = x, out.dominant = k;
  return out;
}

}  // namespace origami
